"""The audit record: one JSON line per outbound call (schema version 1).

This is the documented, versioned shape operators audit (see ``docs/audit.md``). Field
names and event names are defined once here: :class:`Fields` holds the names the
writers use (the record builder :mod:`gateway.call.record` and :mod:`gateway.audit.log`;
a test checks that they are exactly :class:`AuditRecord`'s fields), and the query tool
imports them too. Fields may be added in a minor change; a renamed or removed field
bumps ``AUDIT_SCHEMA_VERSION``.

Units: ``*_ms`` are milliseconds (float), ``*_bytes`` bytes, token counts are integers,
``timestamp`` is ISO 8601 in UTC with a ``Z`` suffix, the time the call finished.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict

AUDIT_SCHEMA_VERSION: Final = 1
CALL_EVENT: Final = "egress_call"
BREAKER_EVENT: Final = "breaker_state_change"
POLICY_RELOAD_EVENT: Final = "policy_reload"
#: A sidecar's start: the policy it started with (``policy_sha256``, its targets).
POLICY_START_EVENT: Final = "policy_start"

#: ``prev_hash`` of the first record of a chain (``seq`` 1): 64 zero hex digits.
GENESIS_HASH: Final = "0" * 64

#: ``shadow_denied``: allowed, and a ``mode: shadow`` rule would have refused it
#: (``shadow_denied`` names the rules).
Decision = Literal["allowed", "denied", "invalid", "replayed", "shadow_denied"]


class AuditRecord(BaseModel):
    """One outbound call, written once when the call ends, whatever its outcome."""

    model_config = ConfigDict(extra="forbid", strict=True)

    audit_schema: Literal[1]
    event: Literal["egress_call"]
    timestamp: str
    level: str
    sidecar_id: str
    agent_id: str
    trace_id: str | None
    correlation_id: str | None
    target_system: str | None
    endpoint: str | None
    method: str | None
    upstream: str | None  # scheme://host:port only: never a path, query or credential
    decision: Decision
    success: bool
    status_code: int | None
    error_code: str | None
    retryable: bool | None
    attempts: int
    latency_ms: float
    upstream_latency_ms: float | None
    tokens_used: int | None
    tokens_input: int | None
    tokens_output: int | None
    tokens_cached: int | None
    request_bytes: int
    request_sha256: str | None
    response_bytes: int | None
    api_key_ref: str | None  # the reference, never the value
    rate_limit_group: str | None
    rate_limit_wait_ms: float
    idempotency_key: str | None
    replayed: bool
    warnings: list[str]
    metadata: dict[str, Any]
    # W3C traceparent sent upstream (trace-id and this call's parent-id); added in 1.x.
    traceparent: str | None = None
    # The sidecar's own request line and answer status, for an answer given before the
    # envelope was read (unknown route, method not allowed, body too large or
    # unreadable); null otherwise. Added in 1.x.
    http_method: str | None = None
    http_path: str | None = None  # percent-encoded as received, without the query
    http_status: int | None = None
    # Streams (added in 1.x): relayed to the agent as they arrived (``stream``), how many
    # events, and the time from the call's start to the first relayed byte; reasoning
    # tokens (part of the output) where the provider reports them.
    stream: bool = False
    stream_events: int | None = None
    time_to_first_byte_ms: float | None = None
    tokens_reasoning: int | None = None
    # Which API the call came in by (added in 1.x): the envelope (``POST /v1/calls``) or a
    # drop-in provider route (``/proxy/{target}/...``, an SDK pointed at the sidecar).
    api: Literal["envelope", "proxy", "mcp", "database", "a2a"] = "envelope"
    # Cost (added in 1.x): USD from the call's usage and its model's price, null when
    # unknown with ``cost_reason`` saying why (gateway.cost: no_dialect, no_price,
    # usage_unknown, not_sent, not_billed...); the model priced and its source (``policy`` or
    # ``genai-prices``); the budgets the call was booked in; and the shadow-mode rules
    # that would have refused it (``endpoint:/v1/**``, ``rate_limit_group:llm``,
    # ``budget:llm-daily``).
    cost_usd: float | None = None
    cost_reason: str | None = None
    cost_model: str | None = None
    cost_source: str | None = None
    budgets: list[str] = []
    shadow_denied: list[str] = []
    # MCP targets (added in 1.x; ``api: mcp`` or an envelope to an MCP target): one
    # record per JSON-RPC request, its method, tool (``tools/call``), id, the result's
    # ``isError`` and a JSON-RPC error's code; null for other calls.
    mcp_method: str | None = None
    mcp_tool: str | None = None
    mcp_request_id: str | None = None
    mcp_is_error: bool | None = None
    mcp_error_code: int | None = None
    # A2A targets (added in 1.x; ``api: a2a``): one record per JSON-RPC request, its
    # method and id, the task and context it concerns, and a JSON-RPC error's code.
    a2a_method: str | None = None
    a2a_request_id: str | None = None
    a2a_task_id: str | None = None
    a2a_context_id: str | None = None
    a2a_error_code: int | None = None
    # Who called (added in 1.x): how ``agent_id`` was established (``uid``: the kernel's
    # word about the calling process; ``token``: the agent's token; ``policy``: the
    # policy's agent_id; null: not established, the call refused ``unknown_agent``), a
    # claimed id that differed (``agent_mismatch``), and the caller's UID as the kernel
    # gave it (null: not asked, or unreadable). The SHA-256 of the policy file that
    # decided the call.
    agent_auth: Literal["uid", "token", "policy"] | None = None
    agent_claimed: str | None = None
    peer_uid: int | None = None
    policy_sha256: str | None = None
    # Agents calling agents (added in 1.x; gateway.agents.chain): the call chain the call
    # went out with, or was refused with (agent ids, origin first, this agent last), and
    # its depth; null when the call ended before its chain was read, or it was unreadable.
    call_chain: list[str] | None = None
    call_chain_depth: int | None = None
    # Failover (added in 1.x; docs/features/failover.md): for a target with ``fallbacks``
    # (null for any other), who answered, ``{target, model}`` (null when none answered
    # well); every attempt in order, of every option (of a target without fallbacks: when
    # the call was retried, else null): ``{target, model, api_key_ref (a reference name,
    # never a key), attempts (1; 0: refused before sending), outcome (an error code, "ok"
    # or "credential_changed"), upstream_status, reason (e.g. a transport failure's kind:
    # connect, reset, timeout), response_bytes, duration_ms}``.
    served_by: dict[str, str | None] | None = None
    tried: list[dict[str, Any]] | None = None
    # Models under control (added in 1.x; the target's or the agent's ``models:``): the
    # model the request asked for, the one sent (after a pin), and ``{sent, answered}``
    # when the answer named another model than the one sent; null without a models rule.
    model_requested: str | None = None
    model_sent: str | None = None
    model_drift: dict[str, str] | None = None
    # Database targets (added in 1.x; ``api: database``): the statement's name, the
    # SHA-256 of its SQL and of its parameters as canonical JSON (never their values),
    # the database user, the rows answered, the SQLSTATE of an error, the wait for a
    # pooled connection, and the SQLSTATEs of transactions retried; null for other calls.
    db_statement: str | None = None
    db_sql_sha256: str | None = None
    db_params_sha256: str | None = None
    db_user: str | None = None
    db_rows: int | None = None
    db_sqlstate: str | None = None
    db_pool_wait_ms: float | None = None
    db_retries: list[str] | None = None
    # Rate limits per agent (added in 1.x; the policy's agents.NAME.rate_limit_group): the
    # calling agent's own group the call took from besides ``rate_limit_group`` (null: it
    # has none, or it is that group), and the group that refused the call
    # (CAPACITY_EXCEEDED from the sidecar's own limits: the agent's group or
    # ``rate_limit_group``; null: none did).
    agent_rate_limit_group: str | None = None
    rate_limit_refused: str | None = None
    # Present only with audit.chain: true (tamper evidence, per sidecar start).
    seq: int | None = None
    prev_hash: str | None = None
    hash: str | None = None
    # With the chain on: the prev_hash of this start's seq 1 (the hash of the record its
    # audit file ended with when it started; 64 zeros for none), so that records
    # deleted from the start of a restart's segment are detected (added in 1.x).
    chain_start: str | None = None


class Fields:
    """The audit record's field names (:class:`AuditRecord`), for the code that writes
    records: a misspelt name is then an error for mypy, not a silent new key."""

    AUDIT_SCHEMA: Final = "audit_schema"
    EVENT: Final = "event"
    TIMESTAMP: Final = "timestamp"
    LEVEL: Final = "level"
    SIDECAR_ID: Final = "sidecar_id"
    AGENT_ID: Final = "agent_id"
    TRACE_ID: Final = "trace_id"
    CORRELATION_ID: Final = "correlation_id"
    TARGET_SYSTEM: Final = "target_system"
    ENDPOINT: Final = "endpoint"
    METHOD: Final = "method"
    UPSTREAM: Final = "upstream"
    DECISION: Final = "decision"
    SUCCESS: Final = "success"
    STATUS_CODE: Final = "status_code"
    ERROR_CODE: Final = "error_code"
    RETRYABLE: Final = "retryable"
    ATTEMPTS: Final = "attempts"
    LATENCY_MS: Final = "latency_ms"
    UPSTREAM_LATENCY_MS: Final = "upstream_latency_ms"
    TOKENS_USED: Final = "tokens_used"
    TOKENS_INPUT: Final = "tokens_input"
    TOKENS_OUTPUT: Final = "tokens_output"
    TOKENS_CACHED: Final = "tokens_cached"
    REQUEST_BYTES: Final = "request_bytes"
    REQUEST_SHA256: Final = "request_sha256"
    RESPONSE_BYTES: Final = "response_bytes"
    API_KEY_REF: Final = "api_key_ref"
    RATE_LIMIT_GROUP: Final = "rate_limit_group"
    RATE_LIMIT_WAIT_MS: Final = "rate_limit_wait_ms"
    IDEMPOTENCY_KEY: Final = "idempotency_key"
    REPLAYED: Final = "replayed"
    WARNINGS: Final = "warnings"
    METADATA: Final = "metadata"
    TRACEPARENT: Final = "traceparent"
    HTTP_METHOD: Final = "http_method"
    HTTP_PATH: Final = "http_path"
    HTTP_STATUS: Final = "http_status"
    STREAM: Final = "stream"
    STREAM_EVENTS: Final = "stream_events"
    TIME_TO_FIRST_BYTE_MS: Final = "time_to_first_byte_ms"
    TOKENS_REASONING: Final = "tokens_reasoning"
    API: Final = "api"
    COST_USD: Final = "cost_usd"
    COST_REASON: Final = "cost_reason"
    COST_MODEL: Final = "cost_model"
    COST_SOURCE: Final = "cost_source"
    BUDGETS: Final = "budgets"
    SHADOW_DENIED: Final = "shadow_denied"
    MCP_METHOD: Final = "mcp_method"
    MCP_TOOL: Final = "mcp_tool"
    MCP_REQUEST_ID: Final = "mcp_request_id"
    MCP_IS_ERROR: Final = "mcp_is_error"
    MCP_ERROR_CODE: Final = "mcp_error_code"
    A2A_METHOD: Final = "a2a_method"
    A2A_REQUEST_ID: Final = "a2a_request_id"
    A2A_TASK_ID: Final = "a2a_task_id"
    A2A_CONTEXT_ID: Final = "a2a_context_id"
    A2A_ERROR_CODE: Final = "a2a_error_code"
    AGENT_AUTH: Final = "agent_auth"
    AGENT_CLAIMED: Final = "agent_claimed"
    PEER_UID: Final = "peer_uid"
    POLICY_SHA256: Final = "policy_sha256"
    CALL_CHAIN: Final = "call_chain"
    CALL_CHAIN_DEPTH: Final = "call_chain_depth"
    SERVED_BY: Final = "served_by"
    TRIED: Final = "tried"
    MODEL_REQUESTED: Final = "model_requested"
    MODEL_SENT: Final = "model_sent"
    MODEL_DRIFT: Final = "model_drift"
    DB_STATEMENT: Final = "db_statement"
    DB_SQL_SHA256: Final = "db_sql_sha256"
    DB_PARAMS_SHA256: Final = "db_params_sha256"
    DB_USER: Final = "db_user"
    DB_ROWS: Final = "db_rows"
    DB_SQLSTATE: Final = "db_sqlstate"
    DB_POOL_WAIT_MS: Final = "db_pool_wait_ms"
    DB_RETRIES: Final = "db_retries"
    AGENT_RATE_LIMIT_GROUP: Final = "agent_rate_limit_group"
    RATE_LIMIT_REFUSED: Final = "rate_limit_refused"
    SEQ: Final = "seq"
    PREV_HASH: Final = "prev_hash"
    HASH: Final = "hash"
    CHAIN_START: Final = "chain_start"


#: The first record of a chained start that continues the chain its audit file ended
#: with (``sink: file``): ``seq`` 1, ``prev_hash`` the hash of that file's last record,
#: and whose record that is: :data:`PREV_SIDECAR_ID` and :data:`PREV_SEQ`.
CHAIN_CONTINUED_EVENT: Final = "audit_chain_continued"
PREV_SIDECAR_ID: Final = "prev_sidecar_id"
PREV_SEQ: Final = "prev_seq"

#: The chain's own fields: set by the writer, never taken from a caller's record.
CHAIN_FIELDS: Final = (Fields.SEQ, Fields.PREV_HASH, Fields.HASH, Fields.CHAIN_START)


AUDIT_FIELDS: Final = tuple(AuditRecord.model_fields)


def canonical_text(record: Mapping[str, Any]) -> str:
    """The canonical serialization the chain hashes: ``record`` without ``hash``.

    JSON with keys sorted, no whitespace, ASCII only (non-ASCII as ``\\uXXXX``), floats
    as Python's shortest round-trip repr, other objects as ``str()``:
    ``json.dumps(..., sort_keys=True, separators=(",", ":"), ensure_ascii=True,
    default=str)``. A record parsed back from its JSON line gives the same text.
    """
    body = {k: v for k, v in record.items() if k != Fields.HASH}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)


def hash_text(canonical: str) -> str:
    """SHA-256 (hex, 64 chars) of a :func:`canonical_text` (ASCII)."""
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def record_hash(record: Mapping[str, Any]) -> str:
    """The chain ``hash`` a record should carry: :func:`hash_text` of its canonical text."""
    return hash_text(canonical_text(record))
