"""The policy's ``controls`` section: the operator's stop switch and the repeated-call
breaker (docs/features/stopping.md).

```yaml
controls:
  operator_token_ref: file:///var/run/secrets/egress/operator-token   # the ops API's token
  stop_switch: {scope: cluster, on_redis_error: fail_open}           # local | cluster (Redis)
  repeated_calls: {max_repeats: 5, window_s: 60, scope: local, mode: enforce}
  repeat_exempt: ["/v1/jobs/*", "get_status"]   # endpoint paths or MCP tool names ('*' globs)
```

``operator_token_ref`` is a secret reference (``vault://``, ``env://``, ``file://``); the
agent never holds it, so it cannot lift a stop. Without it the stop and resume routes
of the ops listener refuse every request (401). ``stop_switch.on_redis_error`` (cluster
scope): ``fail_open`` (default) keeps the last state read from Redis while Redis is
unreachable; ``fail_closed`` refuses every call with AGENT_STOPPED until Redis answers.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any, Literal

from pydantic import Field, field_validator

from gateway.policy import defaults as d
from gateway.policy.budgets import Mode, ToolGlob
from gateway.policy.refs import check_ref
from gateway.policy.stores import StrictModel

#: An endpoint path (starts with ``/``) or an MCP tool name, ``*`` matching any run of
#: characters.
ExemptGlob = ToolGlob  # an endpoint path (trailing slashes dropped) or an MCP tool


class StopSwitchSpec(StrictModel):
    """Where stops live: ``local`` (this sidecar only) or ``cluster`` (Redis: every
    sidecar sharing ``redis.key_prefix`` obeys within ``poll_interval_s`` plus a Redis
    round trip, one that starts later obeys at start)."""

    scope: Literal["local", "cluster"] = "local"
    on_redis_error: Literal["fail_open", "fail_closed"] = "fail_open"
    poll_interval_s: float = Field(
        d.DEFAULT_STOP_POLL_INTERVAL_S, ge=d.MIN_STOP_POLL_INTERVAL_S, le=d.MAX_STOP_POLL_INTERVAL_S
    )


class RepeatedCallsSpec(StrictModel):
    """The repeated-call breaker: the same agent, target, endpoint (or MCP tool) and
    canonical arguments more than ``max_repeats`` times within ``window_s`` seconds is
    REPEATED_CALL. ``mode: shadow`` records the refusal it would give and lets the call
    go. ``on_redis_error`` (cluster scope): ``fail_open`` (default) counts on this
    sidecar alone while Redis is unreachable; ``fail_closed`` refuses (CAPACITY_EXCEEDED,
    retryable)."""

    max_repeats: int = Field(ge=1, le=d.MAX_REPEATS)
    window_s: float = Field(gt=0, le=d.MAX_REPEAT_WINDOW_S)
    scope: Literal["local", "cluster"] = "local"
    mode: Mode = "enforce"
    on_redis_error: Literal["fail_open", "fail_closed"] = "fail_open"


class ControlsSpec(StrictModel):
    """The operator's controls over the agent (see the module docstring)."""

    operator_token_ref: str | None = None
    stop_switch: StopSwitchSpec = Field(default_factory=StopSwitchSpec)
    repeated_calls: RepeatedCallsSpec | None = None
    repeat_exempt: list[ExemptGlob] = Field(default_factory=list, max_length=d.MAX_REPEAT_EXEMPT)

    @field_validator("operator_token_ref")
    @classmethod
    def _ref(cls, v: str | None) -> str | None:
        if v is not None:
            check_ref(v)
        return v


def controls_problems(
    spec: ControlsSpec, has_redis: bool, has_vault: bool
) -> list[tuple[tuple[str, ...], str]]:
    """Cross-references of ``controls`` to other sections: (key path, message) pairs."""
    problems: list[tuple[tuple[str, ...], str]] = []
    ref = spec.operator_token_ref
    if ref is not None and ref.startswith("vault://") and not has_vault:
        problems.append(
            (("controls", "operator_token_ref"), f"{ref!r} needs a secrets.vault section")
        )
    needs = "'cluster' needs a redis section"
    if spec.stop_switch.scope == "cluster" and not has_redis:
        problems.append((("controls", "stop_switch", "scope"), needs))
    repeats = spec.repeated_calls
    if repeats is not None and repeats.scope == "cluster" and not has_redis:
        problems.append((("controls", "repeated_calls", "scope"), needs))
    return problems


def tool_cap_warnings(policy: Any) -> list[tuple[tuple[str, ...], str]]:
    """Budgets whose ``applies_to.tool`` names no tool or endpoint the policy could ever
    send (a typo would cap nothing): (key path, message) pairs for ``validate``.
    ``policy`` is a :class:`gateway.policy.root.Policy`. A path glob is compared with
    the endpoint paths, a tool glob with the MCP targets' ``tools.allow`` globs, of the
    budget's target (or of every target); either way round counts as a match."""
    warnings: list[tuple[tuple[str, ...], str]] = []
    for name, spec in policy.budgets.items():
        glob = spec.applies_to.tool
        if glob is None:
            continue
        wanted = spec.applies_to.target
        known: list[str] = []
        for target_name, target in policy.targets.items():
            if wanted is not None and target_name != wanted:
                continue
            if glob.startswith("/"):
                known += [rule.path for rule in target.endpoints or ()]
            elif target.mcp is not None:
                known += list(target.mcp.tools.allow)
        if not any(fnmatchcase(k, glob) or fnmatchcase(glob, k) for k in known):
            where = f"target {wanted!r}" if wanted else "any target"
            message = f"{glob!r} matches no {'endpoint' if glob.startswith('/') else 'MCP tool'}"
            warnings.append(
                (("budgets", name, "applies_to", "tool"), f"{message} of {where}: it caps nothing")
            )
    return warnings
