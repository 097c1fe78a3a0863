"""One call's context and its audit record (pure: no I/O, no structlog).

:class:`CallContext` collects what a call learned on its way through the pipeline;
:func:`audit_record` turns it into the canonical audit record (fields:
:mod:`gateway.audit.schema`), and :func:`observe` into metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

from gateway.call.attempts import AttemptLog
from gateway.envelope import ErrorCode, ExternalCallRequest, ExternalCallResponse
from gateway.metrics import Metrics, Outcome
from gateway.policy import CompiledTarget
from gateway.policy.egress import origin_label
from gateway.providers import TokenUsage

#: Envelope fields copied into the audit record, even from an envelope that failed
#: validation (as strings, cut to 256 characters).
CLAIMED: Final = ("trace_id", "correlation_id", "target_system", "endpoint", "method", "agent_id")


@dataclass(slots=True)
class CallContext:
    """What one call learned on its way; becomes the audit record."""

    started: float
    agent_id: str
    request: ExternalCallRequest | None = None
    target: CompiledTarget | None = None
    api_key_ref: str | None = None
    attempt_log: AttemptLog = field(default_factory=AttemptLog)
    usage: TokenUsage | None = None
    request_bytes: int = 0
    request_sha256: str | None = None
    rate_limit_group: str | None = None
    idempotency_key: str | None = None
    replayed: bool = False
    traceparent: str | None = None
    decision: str = "invalid"
    warnings: list[str] = field(default_factory=list)
    #: Identifiers read from an envelope that failed validation, for its audit record.
    claimed: dict[str, str] = field(default_factory=dict)


def audit_record(ctx: CallContext, response: ExternalCallResponse) -> dict[str, Any]:
    """The audit record of a call that ended with ``response`` (schema v1)."""
    log = ctx.attempt_log
    request, target, usage, error = ctx.request, ctx.target, ctx.usage, response.error
    ids: dict[str, Any] = {k: getattr(request, k) for k in CLAIMED} if request else ctx.claimed
    warnings = [*ctx.warnings, *log.warnings]
    if error is not None and error.code is ErrorCode.EGRESS_DENIED:
        warnings.append(f"egress denied: {error.message}")  # the destination, for auditors
    return {
        "agent_id": ctx.agent_id if request else ids.get("agent_id") or ctx.agent_id,
        "trace_id": ids.get("trace_id"),
        "correlation_id": ids.get("correlation_id"),
        "target_system": ids.get("target_system"),
        "endpoint": ids.get("endpoint"),
        "method": ids.get("method"),
        "upstream": origin_label(target.base_url) if target else None,
        "decision": "replayed" if ctx.replayed else ctx.decision,
        "success": response.success,
        "status_code": response.status_code,
        "error_code": error.code.value if error else None,
        "retryable": error.retryable if error else None,
        "attempts": log.attempts,
        "latency_ms": response.latency_ms,
        "upstream_latency_ms": (
            round(log.upstream_latency_s * 1000, 3) if log.upstream_latency_s is not None else None
        ),
        "tokens_used": usage.total if usage else None,
        "tokens_input": usage.input if usage else None,
        "tokens_output": usage.output if usage else None,
        "tokens_cached": usage.cached if usage else None,
        "request_bytes": ctx.request_bytes,
        "request_sha256": ctx.request_sha256,
        "response_bytes": log.response_bytes,
        "api_key_ref": ctx.api_key_ref,
        "rate_limit_group": ctx.rate_limit_group,
        "rate_limit_wait_ms": round(log.rate_limit_wait_s * 1000, 3),
        "idempotency_key": ctx.idempotency_key,
        "replayed": ctx.replayed,
        "warnings": warnings,
        "metadata": request.metadata if request else {},
        "traceparent": ctx.traceparent,
    }


def observe(metrics: Metrics, ctx: CallContext, response: ExternalCallResponse) -> None:
    """Count the call in ``metrics`` (labels: policy names and fixed enums only)."""
    claimed = ctx.request.target_system if ctx.request else ctx.claimed.get("target_system")
    target = claimed or "_none"  # names outside the policy are counted as "_unknown"
    outcome: Outcome = "replay" if ctx.replayed else "success" if response.success else "error"
    metrics.observe_call(
        target,
        outcome,
        response.error.code if response.error else None,
        response.latency_ms / 1000,
        ctx.attempt_log.upstream_latency_s,
    )
    if ctx.usage is not None:
        metrics.observe_tokens(target, ctx.usage.input, ctx.usage.output, ctx.usage.cached)
    for _ in range(max(ctx.attempt_log.attempts - 1, 0)):
        metrics.observe_retry(target)
