"""The send stage of a call: from an allowed envelope to the upstream's 2xx answer.

In order (:func:`forward`): the outbound request (:mod:`gateway.call.outbound`; its size,
digest and ``traceparent`` into the record), the rate-limit group's token estimate, the
secret (:func:`resolve`, inside the deadline), the cost reservation
(:mod:`gateway.call.spend`: refused here, nothing goes out), the attempts
(:class:`gateway.call.attempts.Attempts`; a database target's attempt runs its statement
instead of an HTTP request: :func:`_statement`), then the answer's usage settles the cost and
the group's estimate (a failure releases what it may). The pipeline's context is the
only thing written: the stages it calls return their results.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from gateway import telemetry
from gateway.agents import chain
from gateway.agents.repeats import call_names
from gateway.call import models, spend
from gateway.call.attempts import Attempts, deadline_error
from gateway.call.bodies import is_stream_form, parse_body
from gateway.call.outbound import Draft, with_credential
from gateway.call.outbound import build as build_outbound
from gateway.call.record import CallContext
from gateway.call.relay import Relay
from gateway.envelope import ExternalCallRequest, ExternalCallResponse, ModelNames
from gateway.errors import CapacityExceeded, GatewayError, InternalError
from gateway.policy import CompiledTarget, PolicySet
from gateway.policy.egress import Decision
from gateway.policy.refs import SecretRef
from gateway.providers import estimate_tokens, extract_usage, response_model
from gateway.secrets import ResolvedSecret
from gateway.upstream import Credential, UpstreamResponse

if TYPE_CHECKING:
    from gateway.call.pipeline import Pipeline


async def forward(
    pipe: Pipeline,
    policy: PolicySet,
    request: ExternalCallRequest,
    decision: Decision,
    ctx: CallContext,
    deadline: float,
    relay: Relay | None = None,
) -> ExternalCallResponse:
    """Send the call: its request, its secret, its reservations, its attempts; answer
    with the upstream's 2xx answer. Raises the GatewayError that ended the attempts."""
    target = decision.target
    gate = _model_gate(ctx, target, request)
    draft = _outbound(policy, request, target, ctx)
    group = pipe.groups.get(ctx.rate_limit_group) if ctx.rate_limit_group else None
    reserved = 0
    if group is not None and group.spec.tokens_per_minute:
        reserved = estimate_tokens(request.parameters)
    resolved = await resolve(pipe, decision.ref, ctx, deadline)
    attempts = Attempts(
        upstream=pipe.upstream,
        target=target,
        request=request,
        outbound=with_credential(draft, target, resolved, pipe.credentials),
        deadline=deadline,
        has_idempotency_key=_keyed(ctx),
        rng=pipe.rng,
        relay=relay,
        started=ctx.started,
        max_response_bytes=policy.policy.server.max_response_bytes,
        group=group,
        tokens_reserved=reserved,
        breaker=pipe.breakers.get(target.name),
        refresh_credential=(
            refresher(pipe, decision, ctx, deadline)
            if resolved is not None and resolved.from_cache
            else None
        ),
        model_gate=gate,
        watch_model=ctx.model is not None,
    )
    attempts.send = _statement(pipe, policy, target.name, ctx)
    ctx.attempt_log = attempts.log
    # Before any upstream contact: refused here, nothing goes out (BUDGET_EXCEEDED).
    cost = spend.price(
        pipe.budgets,
        pipe.pricing,
        request,
        target,
        group=ctx.rate_limit_group,
        agent_id=ctx.agent_id,
        tools=call_names(request, ctx.mcp) if pipe.budgets else (),
    )
    rates = cost.price.rates  # the record: the model priced, where its price came from
    ctx.cost_model, ctx.cost_source = cost.price.model, rates.source if rates else None
    if cost.applying:  # else no budget applies: nothing to reserve
        await _reserve(pipe, cost, request, ctx)
    attempts.before_resend = lambda: _rebook(pipe, cost, ctx)
    try:
        answer = await attempts.run()
    except BaseException as exc:
        _failed(pipe, attempts, cost, ctx, exc)
        raise
    finally:
        if group is not None:
            pipe.metrics.observe_ratelimit_wait(group.name, attempts.log.rate_limit_wait_s)
    return _answered(pipe, answer, attempts, cost, ctx)


def _model_gate(
    ctx: CallContext, target: CompiledTarget, request: ExternalCallRequest
) -> Callable[[str], GatewayError | None] | None:
    """Under ``models:`` rules, the model sent is the one ``request`` names (drift is
    judged against it: :func:`gateway.call.models.as_sent`); under ``on_drift: refuse``
    the drift check a relayed stream is held for until its model is judged (under
    ``record`` the stream is only read)."""
    if ctx.model is None:
        return None
    choice = ctx.model = models.as_sent(ctx.model, target.spec.usage, request)
    return (
        functools.partial(models.drift, choice, target=target.name) if choice.refuse_drift else None
    )


def _keyed(ctx: CallContext) -> bool:
    """Whether a request the upstream may have acted on may be sent again (with retry's
    other rules): it carries an idempotency key. A database never sees the key (the
    sidecar's store replays by it, but a statement sent again runs again): there, only
    a statement marked ``idempotent``."""
    if ctx.db_call is not None:
        return ctx.db_call.spec.idempotent
    return ctx.idempotency_key is not None


def _statement(
    pipe: Pipeline, policy: PolicySet, target: str, ctx: CallContext
) -> Callable[[float], Awaitable[UpstreamResponse]] | None:
    """A database target's "send" (:meth:`gateway.database.registry.Databases.run`), or
    None for an HTTP target. With ``audit.payloads: none`` the parameters' hash is not
    kept either."""
    call, log, databases = ctx.db_call, ctx.db, pipe.databases
    if call is None or log is None:
        return None
    if databases is None:
        raise InternalError("a database target without its engines", details={"target": target})
    if policy.policy.audit.payloads != "summary":
        call = ctx.db_call = replace(call, params_sha256=None)
    return lambda timeout_s: databases.run(target, call, timeout_s=timeout_s, log=log)


def _outbound(
    policy: PolicySet, request: ExternalCallRequest, target: CompiledTarget, ctx: CallContext
) -> Draft:
    """The request the upstream gets, less its credential, with the call chain's headers
    (:func:`gateway.agents.chain.with_headers`); the record gets its size, digest and
    ``traceparent``."""
    draft, digest = build_outbound(
        request,
        target,
        idempotency_key=ctx.idempotency_key,
        digest=policy.policy.audit.payloads == "summary",  # "none": no hash either
    )
    if ctx.passthrough_headers:  # a drop-in call: the SDK's headers, beneath the policy's
        draft.headers = {**ctx.passthrough_headers, **draft.headers}
    if ctx.chain is not None:  # the call chain it goes out with (gateway.agents.chain)
        draft.headers = chain.with_headers(draft.headers, ctx.chain)
    ctx.request_bytes, ctx.request_sha256 = digest.size, digest.sha256
    ctx.traceparent = draft.headers["traceparent"]
    return draft


async def _reserve(
    pipe: Pipeline, cost: spend.Spend, request: ExternalCallRequest, ctx: CallContext
) -> None:
    """Reserve the call against the budgets that apply; a refusal is decision
    ``denied``, nothing sent (:func:`gateway.call.spend.reserve` raises)."""
    try:
        await spend.reserve(pipe.budgets, cost, request)
    finally:
        if cost.refused:
            ctx.decision, ctx.cost_reason = "denied", "not_sent"
        if cost.warnings or cost.shadow_denied:
            _noted(ctx, cost, again=False)
    ctx.budgets = cost.budgets


async def _rebook(pipe: Pipeline, cost: spend.Spend, ctx: CallContext) -> None:
    """Before resending an attempt the upstream may have acted on: reserve again."""
    await spend.rebook(pipe.budgets, cost)
    if cost.warnings or cost.shadow_denied:
        _noted(ctx, cost, again=True)


def _failed(
    pipe: Pipeline, attempts: Attempts, cost: spend.Spend, ctx: CallContext, exc: BaseException
) -> None:
    """After the attempts failed with ``exc``: release what the reservations may (the
    budgets', the group's token estimate) and count a refusal by the group."""
    log = attempts.log
    ctx.cost_reason = spend.settle_failed(pipe.budgets, cost, sent=log.sent, billed=log.billed)
    group = attempts.group
    if group is not None:
        if isinstance(exc, CapacityExceeded) and exc.details.get("source") != "upstream":
            pipe.metrics.observe_ratelimit_rejection(group.name)
        if log.admitted:
            group.reconcile(attempts.tokens_reserved, 0)  # no answer, no usage: refund it


def _answered(
    pipe: Pipeline,
    answer: UpstreamResponse,
    attempts: Attempts,
    cost: spend.Spend,
    ctx: CallContext,
) -> ExternalCallResponse:
    """The envelope of the upstream's 2xx ``answer``; its usage settles the call's
    cost and the rate-limit group's token estimate."""
    relayed, target, request = attempts.log.relayed, attempts.target, attempts.request
    if relayed is not None:
        data, ctx.usage = None, relayed.judge.usage()  # the agent has had the events
        if relayed.kept is not None:
            ctx.stream_body = bytes(relayed.kept)
    else:
        data, _ = parse_body(answer.content_type, answer.body, answer.status)
        ctx.usage = extract_usage(target.spec.usage, data)
        if ctx.idempotency_key is not None and is_stream_form(data):
            ctx.stream_body = answer.body
    ctx.cost_usd, ctx.cost_reason = spend.settle(pipe.budgets, cost, ctx.usage)
    group = attempts.group
    if group is not None and ctx.usage is not None:
        # Unknown usage keeps the reservation: the upstream answered, so tokens were
        # spent, and a refund would let the group overspend (design.md).
        group.reconcile(attempts.tokens_reserved, ctx.usage.total)
    choice = ctx.model
    if choice is not None and relayed is None:  # a relayed stream was judged as it came
        ctx.answered_model = response_model(target.spec.usage, data)
        refused = models.drift(choice, ctx.answered_model, target.name)
        if refused is not None:
            raise refused  # spent and settled: only the answer is withheld
    return ExternalCallResponse(
        success=True,
        status_code=answer.status,
        data=data,
        latency_ms=round((time.monotonic() - ctx.started) * 1000, 3),
        tokens_used=ctx.usage.total if ctx.usage else None,
        trace_id=request.trace_id,
        correlation_id=request.correlation_id,
        model=ModelNames(requested=choice.requested, sent=choice.sent) if choice else None,
    )


def refresher(
    pipe: Pipeline, decision: Decision, ctx: CallContext, deadline: float
) -> Callable[[], Awaitable[Credential | None]]:
    """What resolves the target's secret again, past its cache (after an upstream 401)."""

    async def refresh() -> Credential | None:
        assert decision.ref is not None
        pipe.resolvers.invalidate(decision.ref)
        resolved = await resolve(pipe, decision.ref, ctx, deadline)
        return pipe.credentials.of(decision.target, resolved)

    return refresh


async def resolve(
    pipe: Pipeline, ref: SecretRef | None, ctx: CallContext, deadline: float
) -> ResolvedSecret | None:
    """The secret ``ref`` names (None without one), within the deadline (else AGENT_TIMEOUT
    ``reason: deadline``); its warnings into the record, a Vault lookup into metrics."""
    if ref is None:
        return None
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise deadline_error("resolving the secret")
    with telemetry.current().span(telemetry.CREDENTIAL_RESOLVE, ref.scheme):
        if pipe.resolvers.is_local(ref.scheme):
            resolved = await pipe.resolvers.resolve(ref)  # a file or the environment
        else:
            try:
                async with asyncio.timeout(remaining):
                    resolved = await pipe.resolvers.resolve(ref)
            except TimeoutError:
                raise deadline_error("resolving the secret") from None
    ctx.warnings.extend(resolved.warnings)
    if ref.scheme == "vault":  # the only cached scheme
        pipe.metrics.observe_secret_cache(
            "stale" if resolved.warnings else "hit" if resolved.from_cache else "miss"
        )
    return resolved


def _noted(ctx: CallContext, cost: spend.Spend, *, again: bool) -> None:
    """The cost stage's new warnings and shadow denials into the record; ``again`` (a
    resend's booking) adds a shadow denial only once."""
    warnings, shadow = cost.take_notes()
    ctx.warnings.extend(warnings)
    if not again:
        ctx.shadow_denied.extend(shadow)
        return
    for rule in shadow:
        if rule not in ctx.shadow_denied:
            ctx.shadow_denied.append(rule)
