"""A finished call counted in the metrics (pure: no I/O of its own).

:func:`observe` reads the call's frozen record (:class:`gateway.record.CallRecord`, made
by :meth:`gateway.call.record.CallContext.record`) and its answer, and counts them in
the sidecar's metrics: calls, tokens, cost, retries, shadow denials, budget and chain
refusals, database statements, model drift, and the GenAI client metrics
(:func:`gateway.telemetry.genai.outcome_of`). Labels are policy names and fixed enums only.
"""

from __future__ import annotations

from gateway.envelope import ErrorCode, ExternalCallResponse
from gateway.metrics import Metrics, Outcome
from gateway.record import CallRecord, decision_of
from gateway.telemetry.genai import outcome_of, token_counts


def observe(metrics: Metrics, call: CallRecord, response: ExternalCallResponse) -> None:
    """Count the call in ``metrics`` (labels: policy names and fixed enums only), and a
    model call in the GenAI client metrics (:func:`gateway.telemetry.genai.outcome_of`)."""
    claimed = call.request.target_system if call.request else call.claimed.get("target_system")
    target = claimed or "_none"  # names outside the policy are counted as "_unknown"
    outcome: Outcome = "replay" if call.replayed else "success" if response.success else "error"
    metrics.observe_call(
        target,
        outcome,
        response.error.code if response.error else None,
        response.latency_ms / 1000,
        call.upstream_latency_s,
    )
    usage = call.usage
    if usage is not None:
        metrics.observe_tokens(target, usage.input, usage.output, usage.cached)
    if call.cost_usd is not None:
        metrics.observe_cost(target, call.cost_model, call.cost_usd)
    metrics.observe_agent_call(call.agent_id, decision_of(call))  # established, never claimed
    for rule in call.shadow_denied:
        kind, _, name = rule.partition(":")
        metrics.observe_shadow_denial(kind, name)
    if response.error is not None and response.error.code is ErrorCode.BUDGET_EXCEEDED:
        metrics.observe_budget_rejection(str(response.error.details.get("budget", "")))
    models = call.models
    if models is not None and models.drifted:
        metrics.observe_model_drift(target, models.sent, models.answered)
    if response.error is not None and response.error.code is ErrorCode.CALL_CHAIN_REFUSED:
        metrics.observe_chain_refusal(str(response.error.details.get("reason", "")))
    if call.database is not None and call.database.statement is not None:  # a policy name
        code = response.error.code.value if response.error else "success"
        metrics.observe_statement(target, call.database.statement, code)
    for _ in range(call.attempts - 1):  # none for 0 or 1 attempt
        metrics.observe_retry(target)
    genai = outcome_of(call, response) if not call.replayed else None  # a replay: no operation
    if genai is not None:
        model, used = genai.call, genai.usage
        tokens = token_counts(model, used) if used is not None else (None, None)
        stream = call.stream
        metrics.observe_genai(
            model.operation,
            model.provider,
            model.request_model,
            genai.response_model,
            duration_s=response.latency_ms / 1000,
            error_type=response.error.code.value if response.error else None,
            input_tokens=tokens[0],
            output_tokens=tokens[1],
            first_chunk_s=stream.first_byte_s if stream is not None else None,
        )
