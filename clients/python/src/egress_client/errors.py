"""One exception per error code, all under :class:`EgressError`.

The sidecar's answer decides: ``code``, ``retryable`` and ``suggested_retry_after`` are
copied from its ``ErrorPayload`` (the sidecar may say ``retryable: false`` for a code
that usually is, e.g. after an upstream's ``x-should-retry: false``). The class is only
the code, so that ``except CapacityExceeded`` reads like the sidecar's error-code table::

    EgressError                 any code; a code newer than this client raises this
    ├── InvalidPayload          INVALID_PAYLOAD       400/413  no
    ├── SchemaMismatch          SCHEMA_MISMATCH       400  no
    ├── PermissionDenied        PERMISSION_DENIED     403  no
    ├── EgressDenied            EGRESS_DENIED         403  no
    ├── SecretNotFound          SECRET_NOT_FOUND      500  no
    ├── SecretAccessDenied      SECRET_ACCESS_DENIED  403  no
    ├── CapacityExceeded        CAPACITY_EXCEEDED     429  yes
    ├── QuotaExhausted          QUOTA_EXHAUSTED       429  no
    ├── BudgetExceeded          BUDGET_EXCEEDED       429  no
    ├── CallChainRefused        CALL_CHAIN_REFUSED    409  no
    ├── ApprovalPending         APPROVAL_PENDING      428  yes
    ├── ApprovalDenied          APPROVAL_DENIED       403  no
    ├── CircuitOpen             CIRCUIT_OPEN          503  yes
    ├── DependencyFailed        DEPENDENCY_FAILED     502  yes
    │   └── SidecarUnavailable  (client side) the sidecar could not be reached
    ├── AgentTimeout            AGENT_TIMEOUT         504  yes
    ├── UpstreamRejected        UPSTREAM_REJECTED     the upstream's 4xx  no
    ├── IdempotencyConflict     IDEMPOTENCY_CONFLICT  422  no
    ├── OutcomeUnknown          OUTCOME_UNKNOWN       502  no
    ├── ResponseTooLarge        RESPONSE_TOO_LARGE    502  no
    ├── StreamInterrupted       STREAM_INTERRUPTED    502  yes
    ├── ShuttingDown            SHUTTING_DOWN         503  yes
    ├── AgentStopped            AGENT_STOPPED         423  no
    ├── RepeatedCall            REPEATED_CALL         429  no
    └── UnknownError            UNKNOWN               500  no
        └── NotAnEnvelope       (client side) the answer was not an ExternalCallResponse

The two client-side classes have no answer behind them (``response`` is None) and say
so in ``details.source: "client"``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from egress_client.models import ErrorCode

if TYPE_CHECKING:
    from egress_client.models import ExternalCallResponse


class EgressError(Exception):
    """A call the sidecar answered with an error (or, for the client-side classes, one
    that got no answer).

    ``code`` is the error code (an :class:`ErrorCode`, or a plain string for a code newer
    than this client); ``retryable`` whether the same call can succeed later;
    ``suggested_retry_after`` (alias ``retry_after``) seconds to wait first, or None;
    ``details`` the machine-readable context; ``response`` the whole answer.
    """

    default_code: ClassVar[ErrorCode | str] = ErrorCode.UNKNOWN
    default_retryable: ClassVar[bool] = False

    def __init__(
        self,
        message: str,
        *,
        code: ErrorCode | str | None = None,
        retryable: bool | None = None,
        suggested_retry_after: float | None = None,
        details: dict[str, Any] | None = None,
        response: ExternalCallResponse | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code: ErrorCode | str = self.default_code if code is None else code
        self.retryable = self.default_retryable if retryable is None else retryable
        self.suggested_retry_after = suggested_retry_after
        self.details: dict[str, Any] = dict(details or {})
        self.response = response

    @property
    def retry_after(self) -> float | None:
        """Same as ``suggested_retry_after`` (seconds)."""
        return self.suggested_retry_after

    @property
    def status_code(self) -> int | None:
        """The upstream's HTTP status, when the call reached it."""
        return None if self.response is None else self.response.status_code

    @property
    def data(self) -> Any:
        """The upstream's parsed body, if any (an UPSTREAM_REJECTED's error body)."""
        return None if self.response is None else self.response.data

    def __str__(self) -> str:
        hint = ""
        if self.suggested_retry_after is not None:
            hint = f" (retry after {self.suggested_retry_after:g} s)"
        return f"{self.code}: {self.message}{hint}"

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(code={str(self.code)!r}, retryable={self.retryable}, "
            f"suggested_retry_after={self.suggested_retry_after!r})"
        )


class InvalidPayload(EgressError):
    default_code = ErrorCode.INVALID_PAYLOAD


class SchemaMismatch(EgressError):
    default_code = ErrorCode.SCHEMA_MISMATCH


class PermissionDenied(EgressError):
    default_code = ErrorCode.PERMISSION_DENIED


class EgressDenied(EgressError):
    default_code = ErrorCode.EGRESS_DENIED


class SecretNotFound(EgressError):
    default_code = ErrorCode.SECRET_NOT_FOUND


class SecretAccessDenied(EgressError):
    default_code = ErrorCode.SECRET_ACCESS_DENIED


class CapacityExceeded(EgressError):
    default_code = ErrorCode.CAPACITY_EXCEEDED
    default_retryable = True


class QuotaExhausted(EgressError):
    default_code = ErrorCode.QUOTA_EXHAUSTED


class BudgetExceeded(EgressError):
    """A cost budget of the sidecar's policy is spent; ``suggested_retry_after`` is the
    seconds until its window resets."""

    default_code = ErrorCode.BUDGET_EXCEEDED


class CallChainRefused(EgressError):
    """The call chain (agents calling agents) is refused: ``details.reason`` is
    ``circular_call_detected``, ``max_depth_exceeded``, ``ttl_expired`` or
    ``invalid_chain``; ``details.call_chain`` the agent ids, origin first."""

    default_code = ErrorCode.CALL_CHAIN_REFUSED


class ApprovalPending(EgressError):
    """The call waits for a person's approval: ``details.approval_id`` names the request;
    send the same call again (same arguments) after ``suggested_retry_after`` seconds."""

    default_code = ErrorCode.APPROVAL_PENDING
    default_retryable = True


class ApprovalDenied(EgressError):
    """A person refused this call (``details.approval_id``); sending it again is refused."""

    default_code = ErrorCode.APPROVAL_DENIED


class CircuitOpen(EgressError):
    default_code = ErrorCode.CIRCUIT_OPEN
    default_retryable = True


class DependencyFailed(EgressError):
    default_code = ErrorCode.DEPENDENCY_FAILED
    default_retryable = True


class SidecarUnavailable(DependencyFailed):
    """The sidecar could not be reached (connection refused, connect timeout), or the
    connection broke under a call that is safe to resend (an idempotent method or an
    idempotency key). Retryable: the sidecar restarts within seconds in a pod."""


class AgentTimeout(EgressError):
    default_code = ErrorCode.AGENT_TIMEOUT
    default_retryable = True


class UpstreamRejected(EgressError):
    default_code = ErrorCode.UPSTREAM_REJECTED


class IdempotencyConflict(EgressError):
    default_code = ErrorCode.IDEMPOTENCY_CONFLICT


class OutcomeUnknown(EgressError):
    """The request may have been processed: never resent automatically."""

    default_code = ErrorCode.OUTCOME_UNKNOWN


class ResponseTooLarge(EgressError):
    default_code = ErrorCode.RESPONSE_TOO_LARGE


class StreamInterrupted(EgressError):
    default_code = ErrorCode.STREAM_INTERRUPTED
    default_retryable = True


class ShuttingDown(EgressError):
    default_code = ErrorCode.SHUTTING_DOWN
    default_retryable = True


class AgentStopped(EgressError):
    """An operator stopped this agent, its target or the fleet (``details.scope``,
    ``details.reason``): do not retry until someone resumes it."""

    default_code = ErrorCode.AGENT_STOPPED


class RepeatedCall(EgressError):
    """The same call was repeated too often (``details.count`` within
    ``details.window_s``): change the arguments or stop looping."""

    default_code = ErrorCode.REPEATED_CALL


class UnknownError(EgressError):
    default_code = ErrorCode.UNKNOWN


class NotAnEnvelope(UnknownError):
    """What answered was not the sidecar's envelope (a wrong URL or port, a proxy's HTML
    page): ``details`` has the HTTP status and content type."""


#: The class of each code (every :class:`ErrorCode` has one).
ERROR_CLASSES: dict[str, type[EgressError]] = {
    cls.default_code: cls
    for cls in (
        InvalidPayload,
        SchemaMismatch,
        PermissionDenied,
        EgressDenied,
        SecretNotFound,
        SecretAccessDenied,
        CapacityExceeded,
        QuotaExhausted,
        BudgetExceeded,
        CallChainRefused,
        ApprovalPending,
        ApprovalDenied,
        CircuitOpen,
        DependencyFailed,
        AgentTimeout,
        UpstreamRejected,
        IdempotencyConflict,
        OutcomeUnknown,
        ResponseTooLarge,
        StreamInterrupted,
        ShuttingDown,
        AgentStopped,
        RepeatedCall,
        UnknownError,
    )
}


def error_for(response: ExternalCallResponse) -> EgressError:
    """The typed exception for a failed answer (its ``error`` payload); an answer with
    ``success: false`` and no payload is an :class:`UnknownError`."""
    payload = response.error
    if payload is None:
        return UnknownError(
            "the sidecar answered success: false without an error payload",
            details={"source": "client"},
            response=response,
        )
    cls = ERROR_CLASSES.get(str(payload.code), EgressError)
    return cls(
        payload.message,
        code=payload.code,
        retryable=payload.retryable,
        suggested_retry_after=payload.suggested_retry_after,
        details=payload.details,
        response=response,
    )
