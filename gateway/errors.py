"""The sidecar's exception tree, and the one place that turns an error into an answer.

Every failure the sidecar can answer with is a :class:`GatewayError`; each class knows
its error code, the HTTP status of the sidecar's answer and whether retrying can help::

    GatewayError
    ├── InvalidPayload          INVALID_PAYLOAD      400 (413 when too large)  no
    ├── SchemaMismatch          SCHEMA_MISMATCH      400  no
    ├── PermissionDenied        PERMISSION_DENIED    403  no
    ├── EgressDenied            EGRESS_DENIED        403  no
    ├── SecretError
    │   ├── SecretNotFound      SECRET_NOT_FOUND     500  no
    │   ├── SecretAccessDenied  SECRET_ACCESS_DENIED 403  no
    │   └── SecretBackendUnavailable DEPENDENCY_FAILED 502 yes
    ├── CapacityExceeded        CAPACITY_EXCEEDED    429  yes
    ├── QuotaExhausted          QUOTA_EXHAUSTED      429  no
    ├── BudgetExceeded          BUDGET_EXCEEDED      429  no
    ├── CallChainRefused        CALL_CHAIN_REFUSED   409  no
    ├── ApprovalPending         APPROVAL_PENDING     428  yes
    ├── ApprovalDenied          APPROVAL_DENIED      403  no
    ├── CircuitOpen             CIRCUIT_OPEN         503  yes
    ├── DependencyFailed        DEPENDENCY_FAILED    502  yes
    ├── DeadlineExceeded        AGENT_TIMEOUT        504  yes
    ├── UpstreamRejected        UPSTREAM_REJECTED    upstream's 4xx  no
    ├── IdempotencyConflict     IDEMPOTENCY_CONFLICT 422  no
    ├── OutcomeUnknown          OUTCOME_UNKNOWN      502  no
    ├── ResponseTooLarge        RESPONSE_TOO_LARGE   502  no
    ├── StreamInterrupted       STREAM_INTERRUPTED   502  yes
    ├── ShuttingDown            SHUTTING_DOWN        503  yes
    ├── AgentStopped            AGENT_STOPPED        423  no
    ├── RepeatedCall            REPEATED_CALL        429  no
    └── InternalError           UNKNOWN              500  no

Foreign exceptions are translated where they enter (the module that owns the library).
Messages never contain secret values or credential-bearing URLs.
"""

from __future__ import annotations

from typing import Any, ClassVar

from gateway.envelope import ErrorCode, ErrorPayload, ExternalCallResponse


class GatewayError(Exception):
    """Root of every error the sidecar answers with.

    ``message`` is for a person and must say what to do; ``details`` is machine-readable
    context (never secret values); ``status_code`` is the upstream's status when there
    was one; ``data`` the upstream's parsed body, if any.
    """

    code: ClassVar[ErrorCode] = ErrorCode.UNKNOWN
    http_status: ClassVar[int] = 500
    retryable: ClassVar[bool] = False

    def __init__(
        self,
        message: str,
        *,
        details: dict[str, Any] | None = None,
        retry_after_s: float | None = None,
        status_code: int | None = None,
        data: Any = None,
        http_status: int | None = None,
        retryable: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.details = details or {}
        self.retry_after_s = retry_after_s
        self.status_code = status_code
        self.data = data
        if http_status is not None:
            self.http_status = http_status  # type: ignore[misc]
        if retryable is not None:
            self.retryable = retryable  # type: ignore[misc]

    def to_payload(self, *, failed_agent: str | None = None) -> ErrorPayload:
        retry_after = self.retry_after_s
        if retry_after is not None:
            retry_after = round(max(retry_after, 0.0), 3)
        return ErrorPayload(
            code=self.code,
            message=self.message,
            details=self.details,
            retryable=self.retryable,
            suggested_retry_after=retry_after,
            failed_agent=failed_agent,
        )


class InvalidPayload(GatewayError):
    code = ErrorCode.INVALID_PAYLOAD
    http_status = 400


class SchemaMismatch(GatewayError):
    code = ErrorCode.SCHEMA_MISMATCH
    http_status = 400


class PermissionDenied(GatewayError):
    code = ErrorCode.PERMISSION_DENIED
    http_status = 403


class EgressDenied(GatewayError):
    code = ErrorCode.EGRESS_DENIED
    http_status = 403


class SecretError(GatewayError):
    """A secret reference could not be turned into a credential."""


class SecretNotFound(SecretError):
    code = ErrorCode.SECRET_NOT_FOUND
    http_status = 500


class SecretAccessDenied(SecretError):
    code = ErrorCode.SECRET_ACCESS_DENIED
    http_status = 403


class SecretBackendUnavailable(SecretError):
    code = ErrorCode.DEPENDENCY_FAILED
    http_status = 502
    retryable = True


class CapacityExceeded(GatewayError):
    code = ErrorCode.CAPACITY_EXCEEDED
    http_status = 429
    retryable = True


class QuotaExhausted(GatewayError):
    """The provider says the account is out of quota, credit or spend (OpenAI
    ``insufficient_quota``, Anthropic ``billing_error``...), or it sent
    ``x-should-retry: false`` on a 429: retrying cannot help until someone acts."""

    code = ErrorCode.QUOTA_EXHAUSTED
    http_status = 429


class BudgetExceeded(GatewayError):
    """A cost budget of the policy (``budgets:``) cannot cover the call: nothing was sent.
    Not retryable until the budget's window resets; ``retry_after_s`` says when (None
    when the call alone costs more than the budget's limit)."""

    code = ErrorCode.BUDGET_EXCEEDED
    http_status = 429


class CallChainRefused(GatewayError):
    """The call chain the call came with is refused before any upstream contact:
    ``details.reason`` is ``circular_call_detected``, ``max_depth_exceeded``,
    ``ttl_expired`` or ``invalid_chain``; ``details.call_chain`` the chain as received
    (agent ids, origin first; null when it could not be read) (:mod:`gateway.agents.chain`).
    Not retryable: the same call with the same chain is refused again."""

    code = ErrorCode.CALL_CHAIN_REFUSED
    http_status = 409


class ApprovalPending(GatewayError):
    """The call needs a person's approval (the target's ``approval:``) and none was given
    within the call's deadline: nothing was sent. ``details.approval_id`` names the
    request an operator decides (:mod:`gateway.agents.approvals`); the same call sent
    again after the approval runs once. Retryable: ``retry_after_s`` says when to ask."""

    code = ErrorCode.APPROVAL_PENDING
    http_status = 428
    retryable = True


class ApprovalDenied(GatewayError):
    """A person refused this call (``details.approval_id``, ``details.decided_by``):
    nothing was sent. Not retryable: the same call is refused again."""

    code = ErrorCode.APPROVAL_DENIED
    http_status = 403


class CircuitOpen(GatewayError):
    code = ErrorCode.CIRCUIT_OPEN
    http_status = 503
    retryable = True


class DependencyFailed(GatewayError):
    code = ErrorCode.DEPENDENCY_FAILED
    http_status = 502
    retryable = True


class DeadlineExceeded(GatewayError):
    code = ErrorCode.AGENT_TIMEOUT
    http_status = 504
    retryable = True


class UpstreamRejected(GatewayError):
    code = ErrorCode.UPSTREAM_REJECTED
    http_status = 400


class IdempotencyConflict(GatewayError):
    code = ErrorCode.IDEMPOTENCY_CONFLICT
    http_status = 422


class OutcomeUnknown(GatewayError):
    code = ErrorCode.OUTCOME_UNKNOWN
    http_status = 502


class ResponseTooLarge(GatewayError):
    code = ErrorCode.RESPONSE_TOO_LARGE
    http_status = 502


class StreamInterrupted(GatewayError):
    """A stream ended (or was cut) before the provider's terminal marker: what arrived
    is a partial answer, never a success."""

    code = ErrorCode.STREAM_INTERRUPTED
    http_status = 502
    retryable = True


class ShuttingDown(GatewayError):
    code = ErrorCode.SHUTTING_DOWN
    http_status = 503
    retryable = True


class AgentStopped(GatewayError):
    """An operator's stop switch holds this agent, target or the whole fleet
    (``details.scope``, ``details.reason``): nothing is sent until someone resumes it."""

    code = ErrorCode.AGENT_STOPPED
    http_status = 423


class RepeatedCall(GatewayError):
    """The repeated-call breaker: the same call (agent, target, endpoint or tool and
    canonical arguments) more than ``max_repeats`` times within ``window_s``
    (``details.count``, ``details.window_s``). Not retryable with the same arguments."""

    code = ErrorCode.REPEATED_CALL
    http_status = 429


class InternalError(GatewayError):
    code = ErrorCode.UNKNOWN
    http_status = 500


def error_response(
    error: GatewayError,
    *,
    latency_ms: float,
    failed_agent: str | None = None,
    trace_id: str | None = None,
    correlation_id: str | None = None,
    tokens_used: int | None = None,
) -> ExternalCallResponse:
    """Turn a :class:`GatewayError` into the agent's answer (the only place that does)."""
    return ExternalCallResponse(
        success=False,
        status_code=error.status_code,
        data=error.data,
        error=error.to_payload(failed_agent=failed_agent),
        latency_ms=round(latency_ms, 3),
        tokens_used=tokens_used,
        trace_id=trace_id,
        correlation_id=correlation_id,
    )
