"""One call's context and its audit record (pure: no I/O, no structlog).

:class:`CallContext` collects what a call learned on its way through the pipeline;
:func:`audit_record` turns it into the canonical audit record (field names:
:class:`gateway.audit.schema.Fields`), :func:`refusal_record` gives the record of an
answer the server gave before the envelope was read, and :func:`observe` counts a call
in metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final, Literal

from gateway.agents.chain import ChainDecision
from gateway.agents.identity import Identity
from gateway.audit.schema import Fields as F
from gateway.call.attempts import AttemptLog
from gateway.envelope import ErrorCode, ExternalCallRequest, ExternalCallResponse
from gateway.metrics import Metrics, Outcome
from gateway.policy import CompiledTarget
from gateway.policy.egress import origin_label
from gateway.providers import TokenUsage
from gateway.providers.mcp import McpExchange
from gateway.telemetry.genai import outcome_of, token_counts

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
    #: The bytes of a streamed answer, kept for the idempotency store (keyed calls only):
    #: a replay re-sends them as a stream, or answers their assembled form.
    stream_body: bytes | None = None
    #: The API the call came in by: ``proxy`` for the drop-in provider routes, ``mcp``
    #: for ``/mcp/{target}``.
    api: Literal["envelope", "proxy", "mcp", "a2a"] = "envelope"
    #: Drop-in routes: the request headers an SDK sent that go upstream beneath the
    #: policy's own (:mod:`gateway.call.proxy`); empty for envelopes.
    passthrough_headers: dict[str, str] = field(default_factory=dict)
    #: Cost (:mod:`gateway.call.spend`): USD from the usage (None: unknown, and why), the
    #: model priced, where its price came from, and the budgets the call was booked in.
    cost_usd: float | None = None
    cost_reason: str | None = None
    cost_model: str | None = None
    cost_source: str | None = None
    budgets: list[str] = field(default_factory=list)
    #: Shadow-mode rules that would have refused the call (``kind:name``).
    shadow_denied: list[str] = field(default_factory=list)
    #: An exchange with an MCP target: its JSON-RPC messages and their outcomes.
    mcp: McpExchange | None = None
    #: Who called, as the sidecar established it (gateway.agents.identity); the SHA-256
    #: of the policy file the call ran under.
    identity: Identity | None = None
    policy_sha256: str | None = None
    #: The call chain headers the request came with (drop-in and MCP routes; None: none
    #: or an envelope, whose ``call_chain`` says), and what the chain stage decided.
    chain_seen: dict[str, str] | None = None
    chain: ChainDecision | None = None
    #: The agent the call goes to, when its target is an agent (``a2a.agent_id``): the
    #: chain decision's target agent; and an A2A request (or card fetch), as read.
    target_agent: str | None = None
    a2a: Any = None
    #: A call to this sidecar's agent (the inbound route): its chain is admitted, not
    #: extended (gateway.call.chain).
    chain_inbound: bool = False

    def a2a_ids(self) -> tuple[str | None, str | None]:
        """The A2A task and context ids the call concerns (None when not an A2A call)."""
        return (getattr(self.a2a, "task_id", None), getattr(self.a2a, "context_id", None))


def audit_record(ctx: CallContext, response: ExternalCallResponse) -> dict[str, Any]:
    """The audit record of a call that ended with ``response`` (schema v1)."""
    log = ctx.attempt_log
    request, target, usage, error = ctx.request, ctx.target, ctx.usage, response.error
    trace_id: str | None
    correlation_id: str | None
    target_system: str | None
    endpoint: str | None
    method: str | None
    if request is not None:
        agent_id, trace_id, correlation_id = ctx.agent_id, request.trace_id, request.correlation_id
        target_system, endpoint, method = request.target_system, request.endpoint, request.method
    else:  # an envelope that failed validation: the ids it claimed, if any
        claimed = ctx.claimed
        agent_id = ctx.agent_id  # a claimed agent_id is never who called
        trace_id, correlation_id = claimed.get(F.TRACE_ID), claimed.get(F.CORRELATION_ID)
        target_system, endpoint = claimed.get(F.TARGET_SYSTEM), claimed.get(F.ENDPOINT)
        method = claimed.get(F.METHOD)
    warnings = [*ctx.warnings, *log.warnings]
    relayed = log.relayed
    if error is not None and error.code is ErrorCode.EGRESS_DENIED:
        warnings.append(f"egress denied: {error.message}")  # the destination, for auditors
    shadow = _shadow_denied(ctx)
    decision = "replayed" if ctx.replayed else ctx.decision
    if shadow and decision == "allowed":
        decision = "shadow_denied"
    return {
        F.AGENT_ID: agent_id,
        F.TRACE_ID: trace_id,
        F.CORRELATION_ID: correlation_id,
        F.TARGET_SYSTEM: target_system,
        F.ENDPOINT: endpoint,
        F.METHOD: method,
        F.UPSTREAM: origin_label(target.base_url) if target else None,
        F.DECISION: decision,
        F.SUCCESS: response.success,
        F.STATUS_CODE: response.status_code,
        F.ERROR_CODE: error.code.value if error else None,
        F.RETRYABLE: error.retryable if error else None,
        F.ATTEMPTS: log.attempts,
        F.LATENCY_MS: response.latency_ms,
        F.UPSTREAM_LATENCY_MS: (
            round(log.upstream_latency_s * 1000, 3) if log.upstream_latency_s is not None else None
        ),
        F.TOKENS_USED: usage.total if usage else None,
        F.TOKENS_INPUT: usage.input if usage else None,
        F.TOKENS_OUTPUT: usage.output if usage else None,
        F.TOKENS_CACHED: usage.cached if usage else None,
        F.REQUEST_BYTES: ctx.request_bytes,
        F.REQUEST_SHA256: ctx.request_sha256,
        F.RESPONSE_BYTES: log.response_bytes,
        F.API_KEY_REF: ctx.api_key_ref,
        F.RATE_LIMIT_GROUP: ctx.rate_limit_group,
        F.RATE_LIMIT_WAIT_MS: round(log.rate_limit_wait_s * 1000, 3),
        F.IDEMPOTENCY_KEY: ctx.idempotency_key,
        F.REPLAYED: ctx.replayed,
        F.WARNINGS: warnings,
        F.METADATA: request.metadata if request else {},
        F.TRACEPARENT: ctx.traceparent,
        # Set by refusal_record only: the pipeline's calls came in as POST /v1/calls.
        F.HTTP_METHOD: None,
        F.HTTP_PATH: None,
        F.HTTP_STATUS: None,
        F.STREAM: relayed is not None,
        F.STREAM_EVENTS: relayed.judge.events if relayed is not None else None,
        F.TIME_TO_FIRST_BYTE_MS: (
            round(relayed.first_byte_s * 1000, 3)
            if relayed is not None and relayed.first_byte_s is not None
            else None
        ),
        F.TOKENS_REASONING: usage.reasoning if usage else None,
        F.API: ctx.api,
        F.COST_USD: round(ctx.cost_usd, 9) if ctx.cost_usd is not None else None,
        F.COST_REASON: "replayed" if ctx.replayed else ctx.cost_reason,
        F.COST_MODEL: ctx.cost_model,
        F.COST_SOURCE: ctx.cost_source,
        F.BUDGETS: ctx.budgets,
        F.SHADOW_DENIED: shadow,
        # Set per JSON-RPC request by gateway.call.mcp.audit_records.
        F.MCP_METHOD: None,
        F.MCP_TOOL: None,
        F.MCP_REQUEST_ID: None,
        F.MCP_IS_ERROR: None,
        F.MCP_ERROR_CODE: None,
        # Set per JSON-RPC request by gateway.call.a2a.audit_records.
        F.A2A_METHOD: None,
        F.A2A_REQUEST_ID: None,
        F.A2A_TASK_ID: None,
        F.A2A_CONTEXT_ID: None,
        F.A2A_ERROR_CODE: None,
        F.CALL_CHAIN: list(ctx.chain.agents) if ctx.chain and ctx.chain.agents else None,
        F.CALL_CHAIN_DEPTH: ctx.chain.depth if ctx.chain and ctx.chain.agents else None,
        **_caller(ctx, agent_id),
    }


def _caller(ctx: CallContext, agent_id: str) -> dict[str, Any]:
    """Who called (:class:`gateway.agents.identity.Identity`) and under which policy."""
    identity = ctx.identity
    claim = ctx.claimed.get(F.AGENT_ID) if ctx.request is None else None
    claimed = identity.claimed if identity is not None else None
    return {
        F.AGENT_AUTH: identity.agent_auth if identity is not None else None,
        F.AGENT_CLAIMED: claimed or (claim if claim is not None and claim != agent_id else None),
        F.PEER_UID: identity.peer_uid if identity is not None else None,
        F.POLICY_SHA256: ctx.policy_sha256,
    }


def _shadow_denied(ctx: CallContext) -> list[str]:
    """The shadow-mode rules that would have refused the call (``kind:name``)."""
    groups = ctx.attempt_log.shadow_denied
    if not groups:
        return [*ctx.shadow_denied]
    return [*ctx.shadow_denied, *(f"rate_limit_group:{g}" for g in groups)]


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
    ctx = CallContext(
        started=0.0,
        agent_id=identity.agent_id if identity is not None else agent_id,
        claimed=claimed,
        identity=identity,
        policy_sha256=policy_sha256,
    )
    record = audit_record(ctx, response)
    record[F.HTTP_METHOD] = http_method[:CLAIM_LIMIT]
    record[F.HTTP_PATH] = http_path[:CLAIM_LIMIT]
    record[F.HTTP_STATUS] = http_status
    return record


def observe(metrics: Metrics, ctx: CallContext, response: ExternalCallResponse) -> None:
    """Count the call in ``metrics`` (labels: policy names and fixed enums only), and a
    model call in the GenAI client metrics (:func:`gateway.telemetry.genai.outcome_of`)."""
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
    if ctx.cost_usd is not None:
        metrics.observe_cost(target, ctx.cost_model, ctx.cost_usd)
    for rule in _shadow_denied(ctx):
        kind, _, name = rule.partition(":")
        metrics.observe_shadow_denial(kind, name)
    if response.error is not None and response.error.code is ErrorCode.BUDGET_EXCEEDED:
        metrics.observe_budget_rejection(str(response.error.details.get("budget", "")))
    if response.error is not None and response.error.code is ErrorCode.CALL_CHAIN_REFUSED:
        metrics.observe_chain_refusal(str(response.error.details.get("reason", "")))
    for _ in range(ctx.attempt_log.attempts - 1):  # none for 0 or 1 attempt
        metrics.observe_retry(target)
    genai = outcome_of(ctx, response) if not ctx.replayed else None  # a replay: no operation
    if genai is not None:
        call, usage = genai.call, genai.usage
        tokens = token_counts(call, usage) if usage is not None else (None, None)
        relayed = ctx.attempt_log.relayed
        metrics.observe_genai(
            call.operation,
            call.provider,
            call.request_model,
            genai.response_model,
            duration_s=response.latency_ms / 1000,
            error_type=response.error.code.value if response.error else None,
            input_tokens=tokens[0],
            output_tokens=tokens[1],
            first_chunk_s=relayed.first_byte_s if relayed is not None else None,
        )
