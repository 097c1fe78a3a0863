"""A typed client for the egress sidecar's envelope API (``POST /v1/calls``).

::

    from egress_client import EgressClient

    with EgressClient("http://127.0.0.1:8181") as client:
        answer = client.call("openai", "/v1/chat/completions", "POST", {"model": "..."})
        answer.raise_for_error()          # CapacityExceeded, PermissionDenied, ...
        print(answer.data, answer.tokens_used)

:class:`EgressClient` (blocking) and :class:`AsyncEgressClient` (asyncio) have the same
methods: ``call``, ``stream`` (the upstream's server-sent events as they arrive, then
the final answer), ``call_with_retries`` (retries what the error contract says may
succeed, within a deadline) and ``send`` (a built :class:`ExternalCallRequest`).
It depends on httpx and pydantic only, never on the sidecar's package.
"""

from egress_client.async_client import AsyncCallStream, AsyncEgressClient
from egress_client.client import CallStream, EgressClient
from egress_client.errors import (
    ERROR_CLASSES,
    AgentStopped,
    AgentTimeout,
    ApprovalDenied,
    ApprovalPending,
    BudgetExceeded,
    CallChainRefused,
    CapacityExceeded,
    CircuitOpen,
    DependencyFailed,
    EgressDenied,
    EgressError,
    IdempotencyConflict,
    InvalidPayload,
    NotAnEnvelope,
    OutcomeUnknown,
    PermissionDenied,
    QuotaExhausted,
    RepeatedCall,
    ResponseTooLarge,
    SchemaMismatch,
    SecretAccessDenied,
    SecretNotFound,
    ShuttingDown,
    SidecarUnavailable,
    StreamInterrupted,
    UnknownError,
    UpstreamRejected,
    error_for,
)
from egress_client.ids import bind_ids
from egress_client.models import (
    CallChain,
    ErrorCode,
    ErrorPayload,
    ExternalCallRequest,
    ExternalCallResponse,
    RequestBody,
    ServedBy,
)
from egress_client.retry import RetryPolicy
from egress_client.sse import ServerSentEvent, SSEDecoder

__version__ = "0.1.0"

__all__ = [
    "ERROR_CLASSES",
    "AgentStopped",
    "AgentTimeout",
    "ApprovalDenied",
    "ApprovalPending",
    "AsyncCallStream",
    "AsyncEgressClient",
    "BudgetExceeded",
    "CallChain",
    "CallChainRefused",
    "CallStream",
    "CapacityExceeded",
    "CircuitOpen",
    "DependencyFailed",
    "EgressClient",
    "EgressDenied",
    "EgressError",
    "ErrorCode",
    "ErrorPayload",
    "ExternalCallRequest",
    "ExternalCallResponse",
    "IdempotencyConflict",
    "InvalidPayload",
    "NotAnEnvelope",
    "OutcomeUnknown",
    "PermissionDenied",
    "QuotaExhausted",
    "RepeatedCall",
    "RequestBody",
    "ResponseTooLarge",
    "RetryPolicy",
    "SSEDecoder",
    "SchemaMismatch",
    "SecretAccessDenied",
    "SecretNotFound",
    "ServedBy",
    "ServerSentEvent",
    "ShuttingDown",
    "SidecarUnavailable",
    "StreamInterrupted",
    "UnknownError",
    "UpstreamRejected",
    "__version__",
    "bind_ids",
    "error_for",
]
