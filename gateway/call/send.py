"""The send stage of a call: from an allowed envelope to the upstream's 2xx answer.

In order (:func:`forward`): the outbound request (:mod:`gateway.call.outbound`; its size,
digest and ``traceparent`` into the record), the rate-limit group's token estimate, the
secret (:func:`resolve`, inside the deadline), the cost reservation
(:mod:`gateway.call.spend`: refused here, nothing goes out), the attempts
(:class:`gateway.call.attempts.Attempts`; a database target's attempt runs its statement
instead of an HTTP request: :func:`_statement`), then the answer's usage settles the cost and
the group's estimate (a failure releases what it may). The stages it calls return their
results; the call's context takes each through its own methods
(:class:`gateway.call.record.CallContext`) as soon as it is known, so that a send that
fails half-way is recorded with what it learned.
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
from gateway.call.bodies import is_stream_form, looks_like_a_form, parse_body
from gateway.call.outbound import Draft, with_credential
from gateway.call.outbound import build as build_outbound
from gateway.call.record import CallContext
from gateway.call.relay import Relay
from gateway.envelope import ExternalCallRequest, ExternalCallResponse, ModelNames
from gateway.errors import CapacityExceeded, GatewayError, InternalError, QuotaExhausted
from gateway.policy import CompiledTarget, PolicySet
from gateway.policy import egress as egress_rules
from gateway.policy.egress import Decision
from gateway.policy.refs import SecretRef
from gateway.providers import (
    DIALECTS,
    estimate_tokens,
    extract_usage,
    response_model,
)
from gateway.secrets import ResolvedSecret
from gateway.upstream import Credential, UpstreamResponse

if TYPE_CHECKING:
    from gateway.call.pipeline import Pipeline
    from gateway.ratelimit.local import RateLimitGroup


def _attempts_group(
    pipe: Pipeline, ctx: CallContext, request: ExternalCallRequest
) -> tuple[RateLimitGroup | None, int]:
    """The rate-limit group each attempt takes (the call's), and the tokens it reserves
    there (its estimate when the group counts tokens, else 0)."""
    # The agent's own group, when this option's group too, is held for the whole call
    # already (gateway.call.agentgroup.taken): an attempt does not take it a second time.
    name = ctx.rate_limit_group
    group = pipe.groups.get(name) if name and name != ctx.agent_rate_limit_group else None
    if group is not None and group.spec.tokens_per_minute:
        return group, estimate_tokens(request.parameters)
    return group, 0


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
    with the upstream's 2xx answer. Raises the GatewayError that ended the attempts. A
    target with ``fallbacks`` is sent through :func:`gateway.call.failover.fail_over`,
    which sends each option here. A model call of a provider dialect takes its model's
    circuit breaker (one failing model must not refuse the target's others)."""
    target = decision.target
    request, decision, rewrite, pool = _prepared(pipe, policy, request, decision, ctx, relay)
    gate = _model_gate(ctx, target, request)
    draft = _outbound(policy, request, target, ctx)
    group, reserved = _attempts_group(pipe, ctx, request)
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
        rewrite=rewrite,
        started=ctx.started,
        max_response_bytes=policy.policy.server.max_response_bytes,
        group=group,
        tokens_reserved=reserved,
        refresh_credential=(
            refresher(pipe, decision, ctx, deadline)
            if resolved is not None and resolved.from_cache
            else None
        ),
        model_gate=gate,
        watch_model=ctx.model is not None,
        key_ref=ctx.api_key_ref,
    )
    _wire(pipe, policy, attempts, pool, ctx, deadline)
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
    ctx.attempting(attempts.log, cost.price.model, rates.source if rates else None)
    attempts.breaker = pipe.breakers.get(target.name, cost.price.model)  # a model call's
    if cost.applying:  # else no budget applies: nothing to reserve, nor to book again
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


def _prepared(
    pipe: Pipeline,
    policy: PolicySet,
    request: ExternalCallRequest,
    decision: Decision,
    ctx: CallContext,
    relay: Relay | None,
) -> tuple[ExternalCallRequest, Decision, Callable[[bytes], bytes] | None, list[str] | None]:
    """The request as sent (a relayed stream asking for its usage: :func:`_asking_usage`,
    with what removes it from the agent's events), its decision (a key pool's first key
    not resting: :func:`_pooled`) and the pool (None: none); all as they are for a call
    neither relayed nor pooled."""
    target, rewrite = decision.target, None
    if relay is None and not target.key_pool:  # the request goes as it is
        return request, decision, None, None
    if relay is not None and request.parameters:
        request, rewrite = _asking_usage(request, target)
    pool = _pool(target, request) if target.key_pool else None
    if pool is not None:
        decision = _pooled(pipe, policy, request, target, pool, ctx)
    return request, decision, rewrite, pool


def _wire(
    pipe: Pipeline,
    policy: PolicySet,
    attempts: Attempts,
    pool: list[str] | None,
    ctx: CallContext,
    deadline: float,
) -> None:
    """Give ``attempts`` a database target's send (:func:`_statement`) and a key pool's
    rotation (:func:`next_key`)."""
    target, request = attempts.target, attempts.request
    attempts.send = _statement(pipe, policy, target.name, ctx)
    if ctx.tried is not None:  # a call that may fail over: every attempt recorded
        attempts.log.tried = []
    if pool is not None:
        attempts.next_key = next_key(pipe, policy, request, target, pool, ctx, deadline)


def _asking_usage(
    request: ExternalCallRequest, target: CompiledTarget
) -> tuple[ExternalCallRequest, Callable[[bytes], bytes] | None]:
    """A relayed stream that does not ask for its usage asks for it: the books need it
    (:func:`gateway.providers.asking_usage`); with what removes it from the events the
    agent gets. Else ``request`` as it is, and None."""
    usage = target.spec.usage  # providers.asking_usage's steps: one frame less per call
    dialect = DIALECTS.get(usage) if usage is not None else None
    if dialect is None:
        return request, None
    parameters = dialect.asking_usage(request.endpoint, request.parameters)
    if parameters is None:
        return request, None
    return request.model_copy(update={"parameters": parameters}), dialect.unasked_usage_removed


def _model_gate(
    ctx: CallContext, target: CompiledTarget, request: ExternalCallRequest
) -> Callable[[str], GatewayError | None] | None:
    """Under ``models:`` rules, the model sent is the one ``request`` names (drift is
    judged against it: :func:`gateway.call.models.as_sent`); under ``on_drift: refuse``
    the drift check a relayed stream is held for until its model is judged (under
    ``record`` the stream is only read)."""
    if ctx.model is None:
        return None
    choice = models.as_sent(ctx.model, target.spec.usage, request)
    ctx.chose(choice)
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
        call = replace(call, params_sha256=None)
        ctx.bound(call)
    return lambda timeout_s: databases.run(target, call, timeout_s=timeout_s, log=log)


def _outbound(
    policy: PolicySet, request: ExternalCallRequest, target: CompiledTarget, ctx: CallContext
) -> Draft:
    """The request the upstream gets, less its credential, with the call chain's headers
    (:func:`gateway.agents.chain.with_headers`), or none of them for a target with
    ``call_chain.propagate: false``; the record gets its size, digest and ``traceparent``."""
    draft, digest = build_outbound(
        request,
        target,
        idempotency_key=ctx.idempotency_key,
        digest=policy.policy.audit.payloads == "summary",  # "none": no hash either
    )
    if ctx.passthrough_headers:  # a drop-in call: the SDK's headers, beneath the policy's
        draft.headers = {**ctx.passthrough_headers, **draft.headers}
    if not target.propagate_chain:  # call_chain.propagate: false, no chain header at all
        draft.headers = chain.without_headers(draft.headers)
    elif ctx.chain is not None:  # the call chain it goes out with (gateway.agents.chain)
        draft.headers = chain.with_headers(draft.headers, ctx.chain)
    ctx.sent_out(digest, draft.headers["traceparent"])
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
            ctx.over_budget()
        if cost.warnings or cost.shadow_denied:
            _noted(ctx, cost, again=False)
    ctx.booked(cost.budgets)


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
    ctx.cost_failed(spend.settle_failed(pipe.budgets, cost, sent=log.sent, billed=log.billed))
    group = attempts.group
    if group is not None:
        if isinstance(exc, CapacityExceeded) and exc.details.get("source") != "upstream":
            pipe.metrics.observe_ratelimit_rejection(group.name)
            if exc.details.get("group") == group.name:  # not a connection pool's
                ctx.group_refused(group.name)
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
    kept, json_data = None, False  # a stream's bytes, a JSON body's kind: for the store
    if relayed is not None:
        data, usage = None, relayed.judge.usage()  # the agent has had the events
        if relayed.kept is not None:
            kept = bytes(relayed.kept)
    elif _body_unread(ctx, target):
        data, usage = None, None  # written back as the upstream's bytes; nothing reads it
    else:
        data, is_json = parse_body(answer.content_type, answer.body, answer.status)
        usage = extract_usage(target.spec.usage, data)
        if ctx.idempotency_key is not None:
            if is_stream_form(data):
                kept = answer.body
            json_data = is_json and looks_like_a_form(data)
    usd, reason = spend.settle(pipe.budgets, cost, usage)
    ctx.settled(usage, usd, reason, kept, json_data)
    group = attempts.group
    if group is not None and usage is not None:
        # Unknown usage keeps the reservation: the upstream answered, so tokens were
        # spent, and a refund would let the group overspend (design.md).
        group.reconcile(attempts.tokens_reserved, usage.total)
    choice = ctx.model
    if choice is not None and relayed is None:  # a relayed stream was judged as it came
        named = response_model(target.spec.usage, data)
        ctx.answered(named)
        refused = models.drift(choice, named, target.name)
        if refused is not None:
            raise refused  # spent and settled: only the answer is withheld
    return ExternalCallResponse(
        success=True,
        status_code=answer.status,
        data=data,
        latency_ms=round((time.monotonic() - ctx.started) * 1000, 3),
        tokens_used=usage.total if usage else None,
        trace_id=request.trace_id,
        correlation_id=request.correlation_id,
        model=ModelNames(requested=choice.requested, sent=choice.sent) if choice else None,
        # The option failover.fail_over sends now (a target with fallbacks), else None: named
        # here, not by a model_copy of the answer afterwards (docs/performance.md).
        served_by=ctx.served_by,
    )


def _body_unread(ctx: CallContext, target: CompiledTarget) -> bool:
    """True when nothing reads the parsed body of a 2xx answer, so it is not parsed (a
    JSON parse of every answer, as costly as the drop-in route's whole intake): a drop-in
    call (``api: proxy``) is answered with the upstream's own bytes
    (``ctx.attempt_log.answer``), and its envelope's ``data`` is read only for the usage
    (a target with a provider ``usage`` dialect: usage, prices, the model answered for
    tracing), a ``models:`` rule's check of the model answered, or an answer stored
    under an idempotency key (replayed from its ``data``)."""
    return (
        ctx.api == "proxy"
        and ctx.idempotency_key is None
        and ctx.model is None
        and target.spec.usage not in DIALECTS
    )


def _pool(target: CompiledTarget, request: ExternalCallRequest) -> list[str] | None:
    """The target's key pool (``credential.refs``) when the call names no key of its
    own, else None."""
    if not target.key_pool or request.api_key_ref is not None:
        return None
    return list(target.key_pool)


def _pooled(
    pipe: Pipeline,
    policy: PolicySet,
    request: ExternalCallRequest,
    target: CompiledTarget,
    pool: list[str],
    ctx: CallContext,
) -> Decision:
    """The decision for the pool's first key not resting; raises the upstream's error
    when every key rests (QUOTA_EXHAUSTED when every one is spent, else
    CAPACITY_EXCEEDED), with the time until the first serves again."""
    now = time.monotonic()
    ref = pipe.keys.pick(target.name, pool, now)
    if ref is None:
        until = pipe.keys.until(target.name, pool)
        wait = max((until or now) - now, 0.0)
        details = {"target": target.name, "source": "upstream", "reason": "every_key_resting"}
        if pipe.keys.spent(target.name, pool):
            raise QuotaExhausted(
                f"every key of target {target.name!r} is out of quota or credit",
                details=details,
                retry_after_s=wait,
            )
        raise CapacityExceeded(
            f"every key of target {target.name!r} is rate limited; the first serves again "
            f"in {wait:.3g} s",
            details=details,
            retry_after_s=wait,
        )
    ctx.key(ref)
    return egress_rules.decide(policy, request.model_copy(update={"api_key_ref": ref}))


def next_key(
    pipe: Pipeline,
    policy: PolicySet,
    request: ExternalCallRequest,
    target: CompiledTarget,
    pool: list[str],
    ctx: CallContext,
    deadline: float,
) -> Callable[[float | None, bool], Awaitable[tuple[Credential, str] | None]]:
    """What rests the call's key after a 429 or quota refusal (for the wait asked, else
    :data:`gateway.call.keys.COOL_DOWN_S`) and gives the pool's next key, its credential
    and reference name (None: every key rests); the record names the key that serves
    (its reference)."""

    async def rotate(wait_s: float | None, spent: bool) -> tuple[Credential, str] | None:
        now = time.monotonic()
        assert ctx.api_key_ref is not None
        pipe.keys.cool(target.name, ctx.api_key_ref, wait_s, now, spent=spent)
        ref = pipe.keys.pick(target.name, pool, now)
        if ref is None:
            return None
        ctx.warned((f"key {ctx.api_key_ref} rests; key {ref} serves",))
        decision = egress_rules.decide(policy, request.model_copy(update={"api_key_ref": ref}))
        resolved = await resolve(pipe, decision.ref, ctx, deadline)
        ctx.key(ref)
        credential = pipe.credentials.of(target, resolved)
        return None if credential is None else (credential, ref)

    return rotate


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
    if resolved.warnings:
        ctx.warned(resolved.warnings)
    if ref.scheme == "vault":  # the only cached scheme
        pipe.metrics.observe_secret_cache(
            "stale" if resolved.warnings else "hit" if resolved.from_cache else "miss"
        )
    return resolved


def _noted(ctx: CallContext, cost: spend.Spend, *, again: bool) -> None:
    """The cost stage's new warnings and shadow denials into the record; ``again`` (a
    resend's booking) adds a shadow denial only once."""
    warnings, shadow = cost.take_notes()
    ctx.warned(warnings)
    ctx.shadowed(shadow, once=again)
