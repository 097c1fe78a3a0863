"""The policy's ``agents:`` section: the agents of one pod, how the sidecar recognises
each, and what each may use (design.md, "Who is calling: agent identity").

```yaml
agents:
  planner:
    uid: 1001                            # the UID its container runs as (kernel's word)
    targets: [openai, anthropic]         # the targets it may call (absent: every target)
  interpreter:
    token_ref: file:///var/run/egress/interpreter-token  # mounted only into its container
    targets: [search]
    models: {allow: [gpt-4o-mini*]}      # models it may ask for (gateway.policy.modelrules)
```

A caller is recognised by its UID first, then by its token (header
``x-egress-agent-token``); with ``agents:`` a caller recognised as none is refused.
Per-agent budgets are budgets with ``applies_to.agent``; an agent's
``rate_limit_group`` (a group of ``rate_limit_groups``) is taken once by every call it
makes, besides the group of the call's target (:mod:`gateway.call.agentgroup`). Without
``agents:`` every call is the policy's ``agent_id`` (:mod:`gateway.agents.identity`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Annotated, Any

from pydantic import Field, StringConstraints, field_validator, model_validator

from gateway.policy import defaults as d
from gateway.policy.budgets import BudgetSpec
from gateway.policy.modelrules import ModelsSpec
from gateway.policy.refs import check_ref
from gateway.policy.stores import StrictModel

_Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")]


class AgentSpec(StrictModel):
    """One agent: ``uid`` (the UID its processes run as) and/or ``token_ref`` (a secret
    reference to its token), the ``targets`` it may call (None: every target), the
    ``models`` it may ask for on every one (:mod:`gateway.policy.modelrules`) and the
    ``rate_limit_group`` every call it makes takes from, besides its target's (None:
    only its target's)."""

    uid: int | None = Field(None, ge=0, le=d.MAX_AGENT_UID)
    token_ref: str | None = None
    targets: list[_Name] | None = None
    models: ModelsSpec | None = None  # the models it may ask for, with every target's rules
    #: A group of ``rate_limit_groups`` each of its calls takes one request (and its
    #: token estimate) from, besides the call's own group: this agent's pace.
    rate_limit_group: _Name | None = None

    @field_validator("token_ref")
    @classmethod
    def _ref(cls, v: str | None) -> str | None:
        if v is not None:
            check_ref(v)
        return v

    @model_validator(mode="after")
    def _recognisable(self) -> AgentSpec:
        if self.uid is None and self.token_ref is None:
            raise ValueError("set 'uid' or 'token_ref' (how the sidecar recognises this agent)")
        return self


Agents = Annotated[dict[_Name, AgentSpec], Field(max_length=d.MAX_AGENTS)]


def agent_problems(
    agents: Mapping[str, AgentSpec],
    targets: Mapping[str, Any],
    budgets: Mapping[str, BudgetSpec],
    has_vault: bool,
    groups: Collection[str] = (),
) -> list[tuple[tuple[str, ...], str]]:
    """Cross-references of ``agents`` to other sections: (key path, message) pairs. Two
    agents with one UID, a target not in the policy, a ``rate_limit_group`` not in
    ``groups`` (the policy's ``rate_limit_groups``), a vault:// token without a
    ``secrets.vault`` section, and (with ``agents:``) a budget's ``applies_to.agent``
    that names no agent."""
    problems: list[tuple[tuple[str, ...], str]] = []
    owners: dict[int, str] = {}
    for name, spec in agents.items():
        if spec.uid is not None:
            first = owners.setdefault(spec.uid, name)
            if first != name:
                message = f"UID {spec.uid} is also agent {first!r}'s: one UID, one agent"
                problems.append((("agents", name, "uid"), message))
        for target in spec.targets or ():
            if target not in targets:
                known = ", ".join(sorted(targets)) or "none"
                message = f"no target {target!r} (known: {known})"
                problems.append((("agents", name, "targets"), message))
        if spec.rate_limit_group is not None and spec.rate_limit_group not in groups:
            known = ", ".join(sorted(groups)) or "none"
            message = f"no rate-limit group {spec.rate_limit_group!r} (known: {known})"
            problems.append((("agents", name, "rate_limit_group"), message))
        if spec.token_ref is not None and spec.token_ref.startswith("vault://") and not has_vault:
            message = f"{spec.token_ref!r} needs a secrets.vault section"
            problems.append((("agents", name, "token_ref"), message))
    for name, budget in budgets.items() if agents else ():
        agent = budget.applies_to.agent
        if agent is not None and agent not in agents:
            message = f"no agent {agent!r} in agents: (known: {', '.join(sorted(agents))})"
            problems.append((("budgets", name, "applies_to", "agent"), message))
    return problems
