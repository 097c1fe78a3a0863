"""The models stage of a call (design.md, "Models under control"; pure, no I/O).

After the egress decision, :func:`checked` applies the ``models:`` rules of the agent
and of the target (:mod:`gateway.policy.modelrules`) to the model the request asks for,
read by the target's dialect (:func:`gateway.providers.request_model`):

* a model outside an ``allow`` is PERMISSION_DENIED (``details.reason:
  model_not_allowed``), nothing sent; under ``mode: shadow`` it is recorded
  (``shadow_denied``: ``models:target:NAME`` or ``models:agent:NAME``) and sent;
* a pinned alias is rewritten to its snapshot (:func:`gateway.providers.with_model`)
  before anything else reads the request: budgets, cost, rate-limit estimates and the
  upstream all see the model sent. A Gemini pin changes the path: the new path is
  decided again by the endpoint rules.

:func:`drift` compares the model an answer names with the one sent: a mismatch is
recorded, and refused (DEPENDENCY_FAILED, ``details.reason: model_drift``, not
retryable) under ``on_drift: refuse``. A stream is judged on its first event that names
a model, before any byte of it reaches the agent (:class:`gateway.call.relay.Relayed`'s
``gate``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gateway import providers
from gateway.envelope import ExternalCallRequest
from gateway.errors import DependencyFailed, GatewayError, PermissionDenied
from gateway.policy import PolicySet
from gateway.policy import egress as egress_rules
from gateway.policy.egress import Decision
from gateway.policy.modelrules import ModelChoice, ModelsSpec, choose


@dataclass(frozen=True, slots=True)
class Checked:
    """What :func:`checked` gives: the request to send, its egress decision (decided
    again when a pin changed the path), the models decision (None: no rule applies, or
    the request names no model) and the refusal to answer with (None: send it)."""

    request: ExternalCallRequest
    decision: Decision
    choice: ModelChoice | None
    refusal: GatewayError | None = None


def rules_for(policy: PolicySet, decision: Decision, agent_id: str) -> list[tuple[str, ModelsSpec]]:
    """The ``models:`` rules of a call: the agent's (under ``agents:``), then the
    target's, each with its owner (``agent:NAME``, ``target:NAME``)."""
    rules: list[tuple[str, ModelsSpec]] = []
    agent = policy.policy.agents.get(agent_id)
    if agent is not None and agent.models is not None:
        rules.append((f"agent:{agent_id}", agent.models))
    target = decision.target
    if target.spec.models is not None:
        rules.append((f"target:{target.name}", target.spec.models))
    return rules


def ruled(policy: PolicySet, decision: Decision, agent_id: str) -> bool:
    """Whether any ``models:`` rule applies to a call (:func:`rules_for` not empty),
    without building the list: a call under none skips the stage (most calls)."""
    if decision.target.spec.models is not None:
        return True
    agent = policy.policy.agents.get(agent_id)
    return agent is not None and agent.models is not None


def checked(
    policy: PolicySet, request: ExternalCallRequest, decision: Decision, agent_id: str
) -> Checked:
    """Apply the models rules to ``request`` (see the module docstring). A model outside
    ``allow`` gives ``refusal``, PermissionDenied (``model_not_allowed``: nothing is to
    be sent); raises what the egress decision raises for a pinned Gemini path that the
    endpoint rules refuse."""
    rules = rules_for(policy, decision, agent_id)
    if not rules:
        return Checked(request, decision, None)
    plain = egress_rules.unescaped_path(request.endpoint)
    if plain != request.endpoint:  # "models/x%3AgenerateContent" names model x too: sent so
        request = request.model_copy(update={"endpoint": plain})
        decision = egress_rules.decide(policy, request)
    usage = decision.target.spec.usage
    requested = providers.request_model(usage, request.endpoint, request.parameters)
    if requested is None:
        return Checked(request, decision, None)
    choice = choose(rules, requested)
    if choice.denied_by:
        shown = requested if choice.sent == requested else f"{requested} (pinned to {choice.sent})"
        refusal = PermissionDenied(
            f"model {shown!r} is not allowed on target {decision.target.name!r} "
            f"(models.allow of {', '.join(choice.denied_by)})",
            details={
                "reason": "model_not_allowed",
                "model": requested,
                "sent_model": choice.sent,
                "rules": list(choice.denied_by),
            },
        )
        return Checked(request, decision, choice, refusal)
    if choice.sent != requested:
        endpoint, parameters = providers.with_model(
            usage, request.endpoint, request.parameters, choice.sent
        )
        moved = endpoint != request.endpoint
        request = request.model_copy(update={"endpoint": endpoint, "parameters": parameters})
        if moved:
            decision = egress_rules.decide(policy, request)
    return Checked(request, decision, choice)


def as_sent(choice: ModelChoice, usage: str, request: ExternalCallRequest) -> ModelChoice:
    """``choice`` with ``sent`` the model ``request`` names as it goes out (a fallback
    may name another than the pinned one: drift is judged against the model sent)."""
    sent = providers.request_model(usage, request.endpoint, request.parameters)
    if sent is None or sent == choice.sent:
        return choice
    return dataclasses.replace(choice, sent=sent)


def shadow_rules(choice: ModelChoice | None) -> list[str]:
    """The ``shadow_denied`` entries of a model a ``mode: shadow`` rule would refuse."""
    return [] if choice is None else [f"models:{owner}" for owner in choice.shadow_by]


def drift(choice: ModelChoice, answered: str | None, target: str) -> GatewayError | None:
    """The refusal of an answer naming ``answered`` when the call sent ``choice.sent``:
    DEPENDENCY_FAILED (``model_drift``, not retryable: the upstream gave another model)
    under ``on_drift: refuse``, else None (also when the answer names no model)."""
    if answered is None or answered == choice.sent or not choice.refuse_drift:
        return None
    return DependencyFailed(
        f"target {target!r} answered with model {answered!r}, not the {choice.sent!r} "
        "that was sent (models.on_drift: refuse); the answer was not passed on",
        details={"reason": "model_drift", "sent": choice.sent, "answered": answered},
        retryable=False,
    )
