"""The agents of a policy, ready for :func:`gateway.agents.identity.identify`: built at
start and on each reload, with each agent's token read once through the secret
resolvers (so a ``vault://`` token works as a ``file://`` one) and kept as a digest."""

from __future__ import annotations

from gateway.agents.identity import Agents, build_agents
from gateway.policy import PolicySet
from gateway.policy.refs import parse_ref
from gateway.secrets import SecretResolvers


async def resolve_agents(policy: PolicySet, resolvers: SecretResolvers) -> Agents:
    """The agents of ``policy`` with their tokens' digests, each token resolved once
    through ``resolvers``. Raises :class:`gateway.errors.SecretError` (a token that
    cannot be read) or ValueError (an empty one). Never shows a token's value."""
    entries = []
    for name, spec in policy.policy.agents.items():
        token = None
        if spec.token_ref is not None:
            token = (await resolvers.resolve(parse_ref(spec.token_ref))).secret.reveal()
            if not token.strip():
                raise ValueError(f"agents.{name}.token_ref: the agent token is empty")
        entries.append((name, spec.uid, token, spec.targets))
    return build_agents(policy.policy.agent_id, entries)
