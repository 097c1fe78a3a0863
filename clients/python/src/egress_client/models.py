"""The envelope contract, as the agent sees it (the sidecar's docs/api/envelope.md).

These models mirror the sidecar's own (``gateway/envelope.py``) field for field: the
sidecar's test suite compares their JSON Schemas and round-trips them through a real
sidecar, so what :class:`ExternalCallRequest` serialises is what the sidecar accepts and
what the sidecar answers parses as :class:`ExternalCallResponse`.

Two deliberate differences, both for agents that outlive a sidecar upgrade: the answer's
models ignore fields they do not know (fields are added, never removed), and
``ErrorPayload.code`` keeps a code this client does not know as a plain string (codes
are added, never renamed or removed) instead of refusing the whole answer.
"""

from __future__ import annotations

import base64
import re
from enum import StrEnum
from typing import Annotated, Any, Final, Literal, Self

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

PROTOCOL_VERSION: Final = "1"
DEFAULT_TIMEOUT_S: Final = 30.0
MAX_TIMEOUT_S: Final = 600.0
DEFAULT_MAX_RETRIES: Final = 3
MAX_RETRIES_LIMIT: Final = 10

HttpMethod = Literal["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
#: RFC 9110 section 9.2.2: safe to resend after a lost answer.
IDEMPOTENT_METHODS: Final = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})

#: C0, DEL and C1 controls: the sidecar refuses them in every string it copies into
#: headers or log lines (ids, references, keys).
CONTROL_CHARACTERS: Final = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _no_controls(value: str) -> str:
    if CONTROL_CHARACTERS.search(value):
        raise ValueError(
            "must not contain control characters (U+0000-U+001F, U+007F-U+009F: CR, LF, "
            "NUL, ESC...); the sidecar copies it into headers and log lines"
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
    """A request body that is not JSON (an upload: audio, a file, a form), for
    POST/PUT/PATCH instead of ``parameters``: its media type and its bytes in standard
    base64 (RFC 4648 section 4). :meth:`of` builds one from bytes."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    content_type: Annotated[str, StringConstraints(min_length=1, max_length=256), _NoControls]
    base64: str

    @classmethod
    def of(cls, content_type: str, data: bytes) -> RequestBody:
        """The body for ``data`` sent with ``Content-Type: content_type``."""
        return cls(content_type=content_type, base64=base64.b64encode(data).decode("ascii"))


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
    """One outbound call for the sidecar to make (``POST /v1/calls``).

    ``timeout`` is the deadline of the whole call in seconds (queueing and the sidecar's
    retries included), 0 < timeout <= 600; ``max_retries`` (0-10) is capped by the
    target's policy. ``parameters`` go as the query string for GET/HEAD/DELETE and as
    the JSON body otherwise; ``query`` adds query items for any method (lists repeat
    the name); ``body`` replaces ``parameters`` with a body that is not JSON (POST, PUT,
    PATCH). ``api_key_ref`` is a secret reference (``vault://...``), never a key.
    Strictly typed like the sidecar: ``"5"`` is not an int.
    """

    # NaN and infinities are written as such, not as null: the sidecar refuses them
    # (INVALID_PAYLOAD, not_finite) rather than forwarding a changed value.
    model_config = ConfigDict(
        strict=True, frozen=True, extra="forbid", ser_json_inf_nan="constants"
    )

    trace_id: Identifier
    correlation_id: Identifier
    target_system: Identifier
    endpoint: Annotated[str, StringConstraints(min_length=1, max_length=2048)]
    method: HttpMethod
    parameters: dict[str, Any] = Field(default_factory=dict)
    api_key_ref: SecretRefText | None = None
    rate_limit_group: Identifier | None = None
    timeout: float = Field(DEFAULT_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S)
    max_retries: int = Field(DEFAULT_MAX_RETRIES, ge=0, le=MAX_RETRIES_LIMIT)
    idempotency_key: IdempotencyKey | None = None
    protocol_version: VersionText = PROTOCOL_VERSION
    agent_id: Identifier | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    query: dict[str, Any] = Field(default_factory=dict)
    body: RequestBody | None = None
    call_chain: CallChain | None = None


class ErrorPayload(BaseModel):
    """Why a call failed. ``retryable`` says whether the same call can succeed later,
    ``suggested_retry_after`` when (seconds; null: no hint); ``details`` is
    machine-readable (``details.reason``...)."""

    model_config = ConfigDict(frozen=True)

    # A code newer than this client stays a plain string (left_to_right: a known code
    # becomes the enum member, not an equal str).
    code: Annotated[ErrorCode | str, Field(union_mode="left_to_right")]
    message: str
    details: dict[str, Any] = Field(default_factory=dict)
    retryable: bool
    suggested_retry_after: float | None = None
    failed_agent: str | None = None
    stack_trace: str | None = None


class ServedBy(BaseModel):
    """Who answered a call to a target with ``fallbacks``: the policy's ``target`` and
    the ``model`` the request named there (null: the target has no provider dialect, or
    none was named). A call that failed over names its fallback."""

    model_config = ConfigDict(frozen=True)

    target: str
    model: str | None = None


class ModelNames(BaseModel):
    """The model a call asked for and the one the sidecar sent (a policy pin rewrites
    an alias to its snapshot)."""

    model_config = ConfigDict(frozen=True)

    requested: str
    sent: str


class ExternalCallResponse(BaseModel):
    """The sidecar's answer to every call, whatever happened.

    ``status_code`` is the upstream's HTTP status (null when the call never reached it),
    ``data`` its parsed body (null in the final event of a stream: the events carried
    it), ``latency_ms`` the wall time inside the sidecar, ``tokens_used`` the total tokens
    the upstream reported (null when none), ``replayed`` true for an answer replayed
    from the sidecar's idempotency store, ``served_by`` the target and model that
    answered a call to a target with ``fallbacks`` (null for any other target, when
    none answered well, or from an older sidecar), ``model`` the model asked for and
    the one sent when the policy controls the target's models (null otherwise).
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

    def raise_for_error(self) -> Self:
        """Return ``self`` when the call succeeded; otherwise raise the typed
        :class:`egress_client.errors.EgressError` of ``error.code``
        (``CapacityExceeded``, ``PermissionDenied``...)."""
        if self.success:
            return self
        from egress_client.errors import error_for  # the errors know this model

        raise error_for(self)
