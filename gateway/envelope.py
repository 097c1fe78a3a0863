"""The wire contract between an agent and the sidecar.

``ExternalCallRequest`` is what an agent POSTs to ``/v1/calls``; ``ExternalCallResponse``
is what it always gets back, whatever happened; ``ErrorPayload`` says what went wrong,
whether retrying can help and when. ``ErrorCode`` is the closed list of error codes: codes
may be added, never renamed or removed (the agent decides from ``code`` and ``retryable``).

This module is the contract: it imports nothing else of the package. The models are
frozen and strictly typed (``"5"`` is not an int, ``true`` is not an int); strings the
sidecar copies into headers, answers or logs (ids, ``idempotency_key``, ``api_key_ref``...)
hold no control characters. Unknown top-level fields of a request, and the bounds of
``metadata`` (its size, depth and keys), are checked by :mod:`gateway.call.intake`, which
can name them and suggest the closest known field.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any, Final, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

#: Protocol versions this sidecar speaks. An envelope naming another gets SCHEMA_MISMATCH.
SUPPORTED_PROTOCOL_VERSIONS: Final = frozenset({"1"})
PROTOCOL_VERSION: Final = "1"

#: Envelope defaults (the seed contract's values).
DEFAULT_TIMEOUT_S: Final = 30.0
MAX_TIMEOUT_S: Final = 600.0
DEFAULT_MAX_RETRIES: Final = 3
MAX_RETRIES_LIMIT: Final = 10
#: ``metadata`` is copied into the audit record: it is bounded (UTF-8 bytes of its
#: compact JSON, as the audit line holds it).
MAX_METADATA_BYTES: Final = 16 * 1024

HttpMethod = Literal["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
#: Methods that RFC 9110 section 9.2.2 defines as idempotent: safe to resend after a lost answer.
IDEMPOTENT_METHODS: Final = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})
#: Methods whose ``parameters`` travel as the query string; the others send a JSON body.
QUERY_METHODS: Final = frozenset({"GET", "HEAD", "DELETE"})
#: Methods that may carry a ``body`` (an upload) instead of ``parameters``.
BODY_METHODS: Final = frozenset({"POST", "PUT", "PATCH"})

#: C0 controls, DEL and C1 controls: never in a string the sidecar copies into a header,
#: an answer or a log line (CR/LF split headers, ESC drives terminals reading logs).
CONTROL_CHARACTERS: Final = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _no_controls(value: str) -> str:
    if CONTROL_CHARACTERS.search(value):
        raise ValueError(
            "must not contain control characters (U+0000-U+001F, U+007F-U+009F: CR, LF, "
            "NUL, ESC...); it is copied into headers and log lines"
        )
    return value


_NoControls = AfterValidator(_no_controls)
Identifier = Annotated[str, StringConstraints(min_length=1, max_length=256), _NoControls]
SecretRefText = Annotated[str, StringConstraints(min_length=1, max_length=512), _NoControls]
IdempotencyKey = Annotated[str, StringConstraints(min_length=1, max_length=255), _NoControls]
VersionText = Annotated[str, StringConstraints(max_length=16), _NoControls]


class ErrorCode(StrEnum):
    """Every error code the sidecar answers with. Added to, never renamed or removed."""

    INVALID_PAYLOAD = "INVALID_PAYLOAD"
    SCHEMA_MISMATCH = "SCHEMA_MISMATCH"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    EGRESS_DENIED = "EGRESS_DENIED"
    SECRET_NOT_FOUND = "SECRET_NOT_FOUND"  # noqa: S105 - a code, not a password
    SECRET_ACCESS_DENIED = "SECRET_ACCESS_DENIED"  # noqa: S105 - a code, not a password
    CAPACITY_EXCEEDED = "CAPACITY_EXCEEDED"
    QUOTA_EXHAUSTED = "QUOTA_EXHAUSTED"
    BUDGET_EXCEEDED = "BUDGET_EXCEEDED"
    CALL_CHAIN_REFUSED = "CALL_CHAIN_REFUSED"
    APPROVAL_PENDING = "APPROVAL_PENDING"
    APPROVAL_DENIED = "APPROVAL_DENIED"
    CIRCUIT_OPEN = "CIRCUIT_OPEN"
    DEPENDENCY_FAILED = "DEPENDENCY_FAILED"
    AGENT_TIMEOUT = "AGENT_TIMEOUT"
    UPSTREAM_REJECTED = "UPSTREAM_REJECTED"
    IDEMPOTENCY_CONFLICT = "IDEMPOTENCY_CONFLICT"
    OUTCOME_UNKNOWN = "OUTCOME_UNKNOWN"
    RESPONSE_TOO_LARGE = "RESPONSE_TOO_LARGE"
    STREAM_INTERRUPTED = "STREAM_INTERRUPTED"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    AGENT_STOPPED = "AGENT_STOPPED"
    REPEATED_CALL = "REPEATED_CALL"
    UNKNOWN = "UNKNOWN"


class RequestBody(BaseModel):
    """A request body that is not JSON (an upload: audio, a file, a form), instead of
    ``parameters``: its media type and its bytes in standard base64 (RFC 4648 section 4)."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    content_type: Annotated[str, StringConstraints(min_length=1, max_length=256), _NoControls]
    base64: str


class CallChain(BaseModel):
    """The call chain an agent received with the request it is working on (agents
    calling agents), passed on so that its sidecar can check and extend it: the values
    of the ``x-egress-call-chain`` (``agents``: agent ids, origin first),
    ``x-egress-deadline`` (``deadline_ms``: absolute, Unix milliseconds) and
    ``x-egress-call-chain-sig`` (``signature``) headers. Only the types are checked
    here; the chain's own rules (ids, length, deadline, signature) are the sidecar's, and
    a chain breaking them is refused with CALL_CHAIN_REFUSED, as the headers would be."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    agents: list[str]
    deadline_ms: int | None = None
    signature: str | None = None


class ExternalCallRequest(BaseModel):
    """One outbound call an agent asks the sidecar to make.

    ``timeout`` is the deadline of the whole call in seconds (queueing, secret resolution
    and retries included); ``max_retries`` is capped by the target's policy. ``parameters``
    is the upstream's business and passes through untouched: the query string for
    GET/HEAD/DELETE, the JSON body otherwise.
    """

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    trace_id: Identifier
    correlation_id: Identifier
    target_system: Identifier
    # Control characters in an endpoint are an egress question (PERMISSION_DENIED).
    endpoint: Annotated[str, StringConstraints(min_length=1, max_length=2048)]
    method: HttpMethod
    parameters: dict[str, Any] = Field(default_factory=dict)
    api_key_ref: SecretRefText | None = None
    rate_limit_group: Identifier | None = None
    timeout: float = Field(DEFAULT_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S)
    max_retries: int = Field(DEFAULT_MAX_RETRIES, ge=0, le=MAX_RETRIES_LIMIT)
    # Optional additions, all defaulted so that older agents keep working.
    idempotency_key: IdempotencyKey | None = None
    protocol_version: VersionText = PROTOCOL_VERSION
    #: A claim, checked against who calls as the sidecar established it (design.md, "Who
    #: is calling"): a different id is refused (PERMISSION_DENIED, agent_mismatch).
    agent_id: Identifier | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    #: Query string items for any method (Gemini's ``?alt=sse``), after those that
    #: ``parameters`` gives a GET/HEAD/DELETE; lists repeat the name.
    query: dict[str, Any] = Field(default_factory=dict)
    #: For POST/PUT/PATCH, a body that is not JSON, instead of ``parameters``.
    body: RequestBody | None = None
    #: The call chain the agent received, when it works for another agent (absent: this
    #: call starts a chain).
    call_chain: CallChain | None = None


class ErrorPayload(BaseModel):
    """Why a call failed. ``suggested_retry_after`` is in seconds; null means "no hint"."""

    model_config = ConfigDict(frozen=True)

    code: ErrorCode
    message: str
    details: dict[str, Any] = Field(default_factory=dict)
    retryable: bool
    suggested_retry_after: float | None = None
    failed_agent: str | None = None
    stack_trace: str | None = None


class ServedBy(BaseModel):
    """Who answered a call to a target with ``fallbacks``: the policy's ``target`` and
    the ``model`` the request named there (null for a target without a provider
    dialect, or none named). A call that failed over names its fallback (README,
    "Failover")."""

    model_config = ConfigDict(frozen=True)

    target: str
    model: str | None = None


class ModelNames(BaseModel):
    """The model a call asked for and the one sent (a ``models.pin`` rewrites an alias
    to its snapshot before sending); on answers of targets with ``models:`` rules."""

    model_config = ConfigDict(frozen=True)

    requested: str
    sent: str


class ExternalCallResponse(BaseModel):
    """The sidecar's answer to every call.

    ``status_code`` is the upstream's HTTP status when there was one, ``data`` its parsed
    body (JSON as is; anything else as ``{"content_type": ..., "text": ...}``),
    ``latency_ms`` the wall time spent inside the sidecar, ``tokens_used`` the total token
    count the upstream reported (null when it reported none), ``served_by`` the target
    and model that answered a call to a target with ``fallbacks`` (null for any other
    target, whose answer is its own, and when no upstream answered well), ``model`` the
    model asked for and the one sent, under ``models:`` rules (null otherwise).
    """

    model_config = ConfigDict(frozen=True)

    success: bool
    status_code: int | None = None
    data: Any = None
    error: ErrorPayload | None = None
    latency_ms: float
    tokens_used: int | None = None
    trace_id: str | None = None
    correlation_id: str | None = None
    replayed: bool = False
    served_by: ServedBy | None = None
    model: ModelNames | None = None


REQUEST_FIELDS: Final = frozenset(ExternalCallRequest.model_fields)
