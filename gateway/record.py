"""One call's record: what every stage learned, frozen at the call's end (pure).

The pipeline's stages each return what they learned; at the end of a call they are
frozen into one :class:`CallRecord`, which feeds the audit record (:func:`audit_record`,
field names: :class:`gateway.audit.schema.Fields`), the metrics
(:func:`gateway.call.metrics.observe`) and the call's span
(:meth:`gateway.telemetry.CallTrace.end`). It lives below them all, so that telemetry,
audit and metrics read a call without importing the pipeline (:mod:`gateway.call`).

:class:`LiveCall` is what a call's trace may read while the call runs (its start, its
envelope and target once known); :func:`refusal_record` is the record of an answer the
server gave before the envelope was read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal, NamedTuple, Protocol

from gateway.agents.chain import ChainDecision
from gateway.agents.identity import Identity
from gateway.audit.schema import Fields as F
from gateway.envelope import ErrorCode, ExternalCallRequest, ExternalCallResponse, ServedBy
from gateway.policy import CompiledTarget
from gateway.policy.egress import origin_label
from gateway.providers import TokenUsage
from gateway.providers.mcp import McpExchange

#: Envelope fields copied into the audit record (under the same names), even from an
#: envelope that failed validation (as strings, cut to CLAIM_LIMIT characters).
CLAIMED: Final = (
    F.TRACE_ID,
    F.CORRELATION_ID,
    F.TARGET_SYSTEM,
    F.ENDPOINT,
    F.METHOD,
    F.AGENT_ID,
)
CLAIM_LIMIT: Final = 256

Api = Literal["envelope", "proxy", "mcp", "database", "a2a"]


class DatabaseFacts(NamedTuple):
    """A database target's statement (:mod:`gateway.database`): its name, the SHA-256
    (hex) of its SQL and of its parameters (None with ``audit.payloads: none``), the
    database user, the rows answered, the SQLSTATE of an error, the seconds waited for a
    pooled connection, the SQLSTATEs of transactions retried; None: not reached."""

    statement: str | None
    sql_sha256: str | None
    params_sha256: str | None
    user: str | None
    rows: int | None
    sqlstate: str | None
    pool_wait_s: float | None
    retries: tuple[str, ...]


_NO_DATABASE: Final = DatabaseFacts(None, None, None, None, None, None, None, ())


class LiveCall(Protocol):
    """A call while it runs, as its trace reads it: ``started`` (``time.monotonic()``
    seconds), the envelope and the target (None until the call has them)."""

    @property
    def started(self) -> float: ...

    @property
    def request(self) -> ExternalCallRequest | None: ...

    @property
    def target(self) -> CompiledTarget | None: ...


class StreamFacts(NamedTuple):
    """An answer relayed as a stream: its events, the seconds from the call's start to
    its first byte (None: nothing relayed), the model its events name (None: none)."""

    events: int
    first_byte_s: float | None
    response_model: str | None


class ModelFacts(NamedTuple):
    """The models of a call under ``models:`` rules: the one ``requested``, the one
    ``sent`` (after the pins) and the one the answer named (``answered``; None: none,
    or no answer)."""

    requested: str
    sent: str
    answered: str | None

    @property
    def drifted(self) -> bool:
        """The answer named another model than the one sent."""
        return self.answered is not None and self.answered != self.sent


class CallRecord(NamedTuple):
    """What one call learned, frozen at its end (built by
    :meth:`gateway.call.record.CallContext.record`; a named tuple: built at a tenth of
    a frozen dataclass's cost, once per call). Durations are seconds, sizes bytes,
    costs USD; None is unknown or not applicable. ``warnings`` and ``shadow_denied``
    (``kind:name``) gather every stage's; ``decision`` is the egress decision
    (``invalid``, ``denied``, ``allowed``), ``replayed`` an idempotent replay."""

    started: float
    agent_id: str
    api: Api
    request: ExternalCallRequest | None
    target: CompiledTarget | None
    #: Identifiers read from an envelope that failed validation.
    claimed: Mapping[str, str]
    decision: str
    replayed: bool
    api_key_ref: str | None
    rate_limit_group: str | None
    idempotency_key: str | None
    traceparent: str | None
    request_bytes: int
    request_sha256: str | None
    usage: TokenUsage | None
    cost_usd: float | None
    cost_reason: str | None
    cost_model: str | None
    cost_source: str | None
    budgets: list[str]
    warnings: list[str]
    shadow_denied: list[str]
    attempts: int
    upstream_latency_s: float | None
    response_bytes: int | None
    rate_limit_wait_s: float
    stream: StreamFacts | None
    #: An exchange with an MCP target: its JSON-RPC messages and their outcomes.
    mcp: McpExchange | None
    #: Who called, as the sidecar established it (gateway.agents.identity); the SHA-256
    #: of the policy file the call ran under.
    identity: Identity | None
    policy_sha256: str | None
    #: What the call chain stage decided (:mod:`gateway.call.chain`; None: not reached).
    chain: ChainDecision | None
    #: Who answered (target and model; None: no upstream answered well) and every
    #: attempt (:func:`gateway.call.attempts.tried_entry`) of a target with
    #: ``fallbacks`` (gateway.call.failover.fail_over), or of a call that was retried.
    served_by: ServedBy | None = None
    tried: list[dict[str, Any]] | None = None
    #: The models asked for, sent and answered (None: no ``models:`` rule applied).
    models: ModelFacts | None = None
    #: A database target's statement (None for other calls).
    database: DatabaseFacts | None = None
    #: The calling agent's own rate-limit group (``agents.NAME.rate_limit_group``) the
    #: call took from, and the group that refused the call, the agent's or the call's
    #: (None: none did).
    agent_rate_limit_group: str | None = None
    rate_limit_refused: str | None = None


def decision_of(call: CallRecord) -> str:
    """The decision the audit record and the span give a call: ``replayed`` for an
    idempotent replay; ``shadow_denied`` when allowed but a ``mode: shadow`` rule would
    have refused it; else the egress decision (``invalid``, ``denied``, ``allowed``)."""
    decision = "replayed" if call.replayed else call.decision
    if call.shadow_denied and decision == "allowed":
        return "shadow_denied"
    return decision


#: Fields set per JSON-RPC request by gateway.call.mcp.audit_records and
#: gateway.call.a2a.audit_records: None in a call's own record.
_PER_JSONRPC_REQUEST: dict[str, Any] = {
    F.MCP_METHOD: None,
    F.MCP_TOOL: None,
    F.MCP_REQUEST_ID: None,
    F.MCP_IS_ERROR: None,
    F.MCP_ERROR_CODE: None,
    F.A2A_METHOD: None,
    F.A2A_REQUEST_ID: None,
    F.A2A_TASK_ID: None,
    F.A2A_CONTEXT_ID: None,
    F.A2A_ERROR_CODE: None,
}


def audit_record(call: CallRecord, response: ExternalCallResponse) -> dict[str, Any]:
    """The audit record of a call that ended with ``response`` (schema v1)."""
    # A copy of the blank record (every field, in the line's order, at its value for a
    # call that used no control), then only the fields a call sets: the dict is cloned in
    # one C call and keeps its order, where a literal of every field cost a lookup of each
    # name on Fields (not specialised by CPython 3.11) and the merge of six dicts
    # (docs/performance.md, "the audit record and metrics"). Field names are literals
    # here, as attribute lookups are what cost; the length check catches a misspelt one.
    record = _BLANK.copy()
    target, error = call.target, response.error
    record["agent_id"] = call.agent_id  # a claimed agent_id is never who called
    _write_request(record, call)
    if target is not None:
        record["upstream"] = origin_label(target.base_url)
    record["decision"] = decision_of(call)
    success = response.success
    record["success"] = success
    record["status_code"] = response.status_code
    warnings = call.warnings  # built for this record (CallContext.record)
    if error is not None:
        record["error_code"] = error.code.value
        record["retryable"] = error.retryable
        if error.code is ErrorCode.EGRESS_DENIED:
            warnings = [*warnings, f"egress denied: {error.message}"]  # the destination
    record["attempts"] = call.attempts
    record["latency_ms"] = response.latency_ms
    latency = call.upstream_latency_s
    if latency is not None:
        record["upstream_latency_ms"] = round(latency * 1000, 3)
    record["request_bytes"] = call.request_bytes
    record["request_sha256"] = call.request_sha256
    record["response_bytes"] = call.response_bytes
    record["api_key_ref"] = call.api_key_ref
    record["rate_limit_group"] = call.rate_limit_group
    record["rate_limit_wait_ms"] = round(call.rate_limit_wait_s * 1000, 3)
    record["agent_rate_limit_group"] = call.agent_rate_limit_group
    record["rate_limit_refused"] = call.rate_limit_refused
    record["idempotency_key"] = call.idempotency_key
    record["replayed"] = call.replayed
    record["warnings"] = warnings
    record["traceparent"] = call.traceparent
    record["api"] = call.api
    _write_spend(record, call)
    record["shadow_denied"] = [*call.shadow_denied]  # its own (the record's may be the context's)
    _write_agent(record, call)
    record["policy_sha256"] = call.policy_sha256
    served_by = call.served_by
    if served_by is not None and success:
        record["served_by"] = {"target": served_by.target, "model": served_by.model}
    record["tried"] = call.tried
    if call.models is not None:
        record.update(_models(call.models))
    if call.database is not None:
        record.update(_database(call.database))
    assert len(record) == len(_BLANK), set(record) - set(_BLANK)  # a misspelt field name
    return record


def _write_spend(record: dict[str, Any], call: CallRecord) -> None:
    """What the call spent: its tokens, its stream's events and first byte, its cost
    (``replayed`` when an idempotent replay cost nothing) and the budgets it was booked to."""
    usage = call.usage
    if usage is not None:
        record["tokens_used"] = usage.total
        record["tokens_input"] = usage.input
        record["tokens_output"] = usage.output
        record["tokens_cached"] = usage.cached
        record["tokens_reasoning"] = usage.reasoning
    stream = call.stream
    if stream is not None:
        record["stream"] = True
        record["stream_events"] = stream.events
        if stream.first_byte_s is not None:
            record["time_to_first_byte_ms"] = round(stream.first_byte_s * 1000, 3)
    if call.cost_usd is not None:
        record["cost_usd"] = round(call.cost_usd, 9)
    record["cost_reason"] = "replayed" if call.replayed else call.cost_reason
    record["cost_model"] = call.cost_model
    record["cost_source"] = call.cost_source
    record["budgets"] = [*call.budgets]


def _write_request(record: dict[str, Any], call: CallRecord) -> None:
    """The call's request fields: the validated request's, else what a refused one claimed
    (the ids and target it named, never trusted for anything else)."""
    request = call.request
    if request is not None:
        record["trace_id"] = request.trace_id
        record["correlation_id"] = request.correlation_id
        record["target_system"] = request.target_system
        record["endpoint"] = request.endpoint
        record["method"] = request.method
        record["metadata"] = request.metadata
        return
    claimed = call.claimed
    if claimed:
        record["trace_id"] = claimed.get("trace_id")
        record["correlation_id"] = claimed.get("correlation_id")
        record["target_system"] = claimed.get("target_system")
        record["endpoint"] = claimed.get("endpoint")
        record["method"] = claimed.get("method")
    record["metadata"] = {}


def _write_agent(record: dict[str, Any], call: CallRecord) -> None:
    """Who called, as the sidecar established it: the call chain, how the agent was known
    (``agent_auth``, ``peer_uid``) and an ``agent_id`` it claimed that is not who it is."""
    chain = call.chain
    if chain is not None and chain.agents:
        record["call_chain"] = list(chain.agents)
        record["call_chain_depth"] = len(chain.agents)
    identity = call.identity
    claimed_id = None
    if identity is not None:
        record["agent_auth"] = identity.agent_auth
        record["peer_uid"] = identity.peer_uid
        claimed_id = identity.claimed
    if not claimed_id:
        claim = call.claimed.get("agent_id") if call.request is None else None
        claimed_id = claim if claim is not None and claim != call.agent_id else None
    record["agent_claimed"] = claimed_id


def _database(facts: DatabaseFacts | None) -> dict[str, Any]:
    """A database target's statement: never a parameter's value, never a password."""
    db = facts or _NO_DATABASE
    wait = db.pool_wait_s
    return {
        F.DB_STATEMENT: db.statement,
        F.DB_SQL_SHA256: db.sql_sha256,
        F.DB_PARAMS_SHA256: db.params_sha256,
        F.DB_USER: db.user,
        F.DB_ROWS: db.rows,
        F.DB_SQLSTATE: db.sqlstate,
        F.DB_POOL_WAIT_MS: round(wait * 1000, 3) if wait is not None else None,
        F.DB_RETRIES: list(db.retries) or None,
    }


def _models(models: ModelFacts | None) -> dict[str, Any]:
    """The model asked for, the one sent, and ``{sent, answered}`` when they differ."""
    if models is None:
        return {F.MODEL_REQUESTED: None, F.MODEL_SENT: None, F.MODEL_DRIFT: None}
    drift = {"sent": models.sent, "answered": models.answered} if models.drifted else None
    return {F.MODEL_REQUESTED: models.requested, F.MODEL_SENT: models.sent, F.MODEL_DRIFT: drift}


#: The fields of a call without a models rule, and of a call that is no statement (all
#: None; copied into each record by ``**``, never changed).
_NO_MODELS_FIELDS: Final = _models(None)
_NO_DATABASE_FIELDS: Final = _database(None)

#: Every field of a call's record, in the order of its line, at its value for a call
#: that used no control and reached nothing (:func:`audit_record` copies it).
_BLANK: Final[dict[str, Any]] = {
    F.AGENT_ID: None,
    F.TRACE_ID: None,
    F.CORRELATION_ID: None,
    F.TARGET_SYSTEM: None,
    F.ENDPOINT: None,
    F.METHOD: None,
    F.UPSTREAM: None,
    F.DECISION: None,
    F.SUCCESS: None,
    F.STATUS_CODE: None,
    F.ERROR_CODE: None,
    F.RETRYABLE: None,
    F.ATTEMPTS: None,
    F.LATENCY_MS: None,
    F.UPSTREAM_LATENCY_MS: None,
    F.TOKENS_USED: None,
    F.TOKENS_INPUT: None,
    F.TOKENS_OUTPUT: None,
    F.TOKENS_CACHED: None,
    F.REQUEST_BYTES: None,
    F.REQUEST_SHA256: None,
    F.RESPONSE_BYTES: None,
    F.API_KEY_REF: None,
    F.RATE_LIMIT_GROUP: None,
    F.RATE_LIMIT_WAIT_MS: None,
    F.AGENT_RATE_LIMIT_GROUP: None,
    F.RATE_LIMIT_REFUSED: None,
    F.IDEMPOTENCY_KEY: None,
    F.REPLAYED: None,
    F.WARNINGS: None,
    F.METADATA: None,
    F.TRACEPARENT: None,
    # Set by refusal_record only: the pipeline's calls came in as POST /v1/calls.
    F.HTTP_METHOD: None,
    F.HTTP_PATH: None,
    F.HTTP_STATUS: None,
    F.STREAM: False,
    F.STREAM_EVENTS: None,
    F.TIME_TO_FIRST_BYTE_MS: None,
    F.TOKENS_REASONING: None,
    F.API: None,
    F.COST_USD: None,
    F.COST_REASON: None,
    F.COST_MODEL: None,
    F.COST_SOURCE: None,
    F.BUDGETS: None,
    F.SHADOW_DENIED: None,
    **_PER_JSONRPC_REQUEST,
    F.CALL_CHAIN: None,
    F.CALL_CHAIN_DEPTH: None,
    F.AGENT_AUTH: None,
    F.AGENT_CLAIMED: None,
    F.PEER_UID: None,
    F.POLICY_SHA256: None,
    F.SERVED_BY: None,
    F.TRIED: None,
    **_NO_MODELS_FIELDS,
    **_NO_DATABASE_FIELDS,
}


def refused(
    agent_id: str,
    claimed: Mapping[str, str],
    identity: Identity | None = None,
    policy_sha256: str | None = None,
) -> CallRecord:
    """The record of a call that never started (nothing learned but its agent, the ids
    ``claimed`` for it, who called and the policy's SHA-256 when known)."""
    return CallRecord(
        0.0, agent_id, "envelope", None, None, claimed, "invalid", False, None, None, None,
        None, 0, None, None, None, None, None, None, [], [], [], 0, None, None, 0.0, None,
        None, identity, policy_sha256, None,
    )  # fmt: skip


def refusal_record(
    agent_id: str,
    response: ExternalCallResponse,
    *,
    http_method: str,
    http_path: str,
    http_status: int,
    identity: Identity | None = None,
    policy_sha256: str | None = None,
) -> dict[str, Any]:
    """The audit record of an answer given before the envelope was read (an unknown
    route, a method not allowed, a body too large or unreadable): decision ``invalid``,
    the answer's error code, the sidecar's own request line (``http_path`` without its
    query, both cut to 256 characters) and ``http_status``, and the answer's ids when it
    has them; nothing of the body. ``identity``, when established, is who called (its
    ``agent_id`` wins)."""
    ids = {F.TRACE_ID: response.trace_id, F.CORRELATION_ID: response.correlation_id}
    claimed = {k: v for k, v in ids.items() if v is not None}
    who = identity.agent_id if identity is not None else agent_id
    record = audit_record(refused(who, claimed, identity, policy_sha256), response)
    record[F.HTTP_METHOD] = http_method[:CLAIM_LIMIT]
    record[F.HTTP_PATH] = http_path[:CLAIM_LIMIT]
    record[F.HTTP_STATUS] = http_status
    return record
