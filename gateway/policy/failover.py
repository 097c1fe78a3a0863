"""A target's failover policy (design.md, "Failover and key pools"; docs/features/failover.md).

``fallbacks:`` is an ordered list of ``{target, model}``: when the target's own attempts
end in a retryable failure before any byte reached the agent, the call is sent to the
next option, its model rewritten (:func:`gateway.providers.with_model`), inside the
same deadline. Only the target's own list is tried (a fallback's ``fallbacks`` are not
followed). ``fallback_on`` adds non-retryable answers that still move on
(``context_length_exceeded``: toward a model with a larger window).
``first_byte_timeout_s`` bounds each attempt's wait for the upstream's answer (its
headers), so a silent primary cannot spend the whole deadline.

:func:`fallback_problems` is what ``validate`` refuses (key path, message):
an unknown target, another dialect, an MCP target (its checks are its own), a fallback
to itself with the same model, a cycle between targets, a fallback's ``model`` that a
``models.allow`` rule refuses (the fallback target's, or an agent's that may call the
target: the model is sent as written, so the rule would otherwise be passed by).
:func:`fallback_warnings`: a ``first_byte_timeout_s`` above the target's ``timeout_s``
(it would never act).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from gateway.policy.budgets import ModelName
from gateway.policy.stores import StrictModel

#: Non-retryable failures a rule may still fail over on (``fallback_on``).
FallbackOn = Literal["context_length_exceeded"]


class FallbackSpec(StrictModel):
    """One fallback: the policy's ``target`` to send to and the ``model`` to name
    instead (None: the request's own model)."""

    target: str
    model: ModelName | None = None


#: (key path, message); a list index is an int, so the loader finds its line.
Problem = tuple[tuple[str | int, ...], str]


def fallback_problems(
    targets: Mapping[str, Any], agents: Mapping[str, Any] | None = None
) -> list[Problem]:
    """Problems of the targets' ``fallbacks`` (``targets``: name -> TargetSpec;
    ``agents``: name -> AgentSpec): an unknown target, a target of another ``usage``
    dialect, an MCP target on either side, the target itself without another model, a
    target with ``approval:`` behind one without (a failover would step around it), a
    cycle (A falls back to B, which falls back to A), a model a ``models.allow`` rule
    refuses (:func:`_model_refusals`); and ``retry.resend_unanswered: true`` on a target
    without a provider dialect (a lost request sent twice may act twice there)."""
    problems = _model_refusals(targets, agents or {})
    for name, spec in targets.items():
        if spec.retry.resend_unanswered and spec.usage == "none":
            problems.append(
                (
                    ("targets", name, "retry", "resend_unanswered"),
                    "needs 'usage' (openai, anthropic or gemini): only a provider's inference "
                    "endpoints cost tokens alone when sent twice; elsewhere give the target "
                    "an 'idempotency' block",
                )
            )
        for index, option in enumerate(spec.fallbacks):
            loc = ("targets", name, "fallbacks", index, "target")
            other = targets.get(option.target)
            if other is None:
                known = ", ".join(sorted(targets))
                problems.append((loc, f"no target {option.target!r} (known: {known})"))
            elif other.usage != spec.usage:
                problems.append(
                    (
                        loc,
                        f"{option.target!r} speaks the {other.usage!r} dialect, not "
                        f"{spec.usage!r}: a fallback must take the same request",
                    )
                )
            elif spec.mcp is not None or other.mcp is not None:
                # The MCP checks (tools, listings) are the target's own: not carried over.
                problems.append((loc, "an MCP target neither has nor is a fallback"))
            elif option.target == name and option.model is None:
                problems.append((loc, "a target cannot fall back to itself with the same model"))
            elif other.approval is not None and spec.approval is None:
                # Its approval is asked of calls to it, not of a failover reaching it.
                problems.append(
                    (
                        loc,
                        f"{option.target!r} holds calls for approval and {name!r} does not: "
                        "a failover would send them unapproved",
                    )
                )
        cycle = _cycle_from(name, targets)
        if cycle:
            problems.append(
                (("targets", name, "fallbacks"), f"a fallback cycle: {' -> '.join(cycle)}")
            )
    return problems


def _model_refusals(targets: Mapping[str, Any], agents: Mapping[str, Any]) -> list[Problem]:
    """Each fallback ``model`` outside an enforcing ``models.allow`` that applies where
    it is sent: the fallback target's, and the agents' that may call the target (their
    ``targets`` list it, or they list none). A call would reach a model the policy
    refuses, because a fallback's model is sent as written (no rule is asked again)."""
    problems: list[Problem] = []
    for name, spec in targets.items():
        callers = [
            (f"agents.{a}.models", agent.models)
            for a, agent in agents.items()
            if agent.models is not None and (agent.targets is None or name in agent.targets)
        ]
        for index, option in enumerate(spec.fallbacks):
            other = targets.get(option.target)
            if option.model is None or other is None:
                continue  # the request's own model (its rules apply), or reported above
            rules = [(f"targets.{option.target}.models", other.models), *callers]
            for owner, rule in rules:
                if rule is not None and rule.mode == "enforce" and not rule.allows(option.model):
                    problems.append(
                        (
                            ("targets", name, "fallbacks", index, "model"),
                            f"{option.model!r} is not in the 'allow' of {owner}: the "
                            "fallback would send a model the policy refuses",
                        )
                    )
    return problems


def _cycle_from(start: str, targets: Mapping[str, Any]) -> list[str]:
    """A path of fallbacks from ``start`` back to ``start`` through other targets, or []."""
    stack: list[tuple[str, list[str]]] = [(start, [start])]
    seen: set[str] = set()
    while stack:
        name, path = stack.pop()
        spec = targets.get(name)
        for option in spec.fallbacks if spec is not None else ():
            if option.target == name:
                continue  # the same target with another model: not a cycle
            if option.target == start:
                return [*path, start]
            if option.target not in seen:
                seen.add(option.target)
                stack.append((option.target, [*path, option.target]))
    return []


def fallback_warnings(targets: Mapping[str, Any]) -> list[Problem]:
    """Warnings for ``validate``: a ``first_byte_timeout_s`` not below the target's
    ``timeout_s`` never acts (the attempt's own timeout ends it first)."""
    warnings: list[Problem] = []
    for name, spec in targets.items():
        limit = spec.first_byte_timeout_s
        if limit is not None and limit >= spec.timeout_s:
            warnings.append(
                (
                    ("targets", name, "first_byte_timeout_s"),
                    f"{limit:g} s is not below timeout_s ({spec.timeout_s:g} s): it never acts",
                )
            )
    return warnings
