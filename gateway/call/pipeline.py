"""One call through the stages, in order, inside the envelope's deadline.

    intake -> call chain -> egress decision (an MCP target's tool rules too)
    -> models (allow, pin: :mod:`gateway.call.models`) -> the call's rate-limit group
    (the envelope's one defined, never another agent's own) -> stop switch and repeated-call
    breaker -> approval -> idempotency -> [the agent's own rate-limit group
    (:mod:`gateway.call.agentgroup`) -> send: outbound request -> secret -> budget reservation
    -> attempts, each: rate-limit group -> circuit breaker -> send -> retry decision
    (backoff, Retry-After: :mod:`gateway.call.retry`)
    -> usage -> budget settlement] -> answer -> record

The send stage is :mod:`gateway.call.send`; the record is one frozen
:class:`gateway.record.CallRecord`, from which the audit record, the metrics and the
call's span are written.

Every call, whatever happens, ends with exactly one :class:`ExternalCallResponse` and
exactly one audit record (written in a ``finally``). A bug inside the sidecar becomes an
UNKNOWN answer that points at the audit record, never a stack trace on the wire (unless
``server.debug`` is on).
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
import traceback
from collections.abc import Callable, Coroutine
from typing import Any

from gateway import telemetry
from gateway.agents.approvals import Approvals, MemoryApprovalStore
from gateway.agents.chain_memory import ChainMemory
from gateway.agents.controls import Controls
from gateway.agents.identity import Identity, policy_identity
from gateway.audit import AuditLog, get_logger
from gateway.audit.schema import Fields
from gateway.breaker import CircuitBreakers
from gateway.budgets import Budgets
from gateway.call import a2a, agentgroup, failover, mcp, send
from gateway.call import hooks as api_hooks
from gateway.call import models as model_rules
from gateway.call.chain import ChainKeys, chain_here, chain_stage
from gateway.call.hooks import CallHooks
from gateway.call.idempotent import Learned, Rendered, answer_status, once_per_key
from gateway.call.intake import (
    Intake,
    decode_json,
    parse_envelope_fast,
    parse_request,
    printable,
    refuse_lone_surrogates,
)
from gateway.call.keys import KeyPools
from gateway.call.metrics import observe
from gateway.call.outbound import Credentials
from gateway.call.proxy import ProxyRequest, proxy_intake
from gateway.call.record import CLAIMED, Arrival, ArrivalFields, CallContext
from gateway.call.relay import Relay
from gateway.cost import Pricing
from gateway.database.registry import Databases
from gateway.deadletters import DeadLetters
from gateway.envelope import IDEMPOTENT_METHODS, ExternalCallRequest, ExternalCallResponse
from gateway.errors import (
    AgentStopped,
    GatewayError,
    InternalError,
    InvalidPayload,
    OutcomeUnknown,
    ShuttingDown,
    error_response,
)
from gateway.idempotency.base import IdempotencyStore
from gateway.idempotency.keys import derive_key
from gateway.idempotency.scopes import IdempotencyStores
from gateway.metrics import Metrics
from gateway.policy import IdempotencySpec, PolicySet
from gateway.policy import egress as egress_rules
from gateway.policy.egress import Decision
from gateway.ratelimit import RateLimitGroups
from gateway.record import CallRecord, audit_record
from gateway.secrets import SecretResolvers
from gateway.upstream import Upstream

_log = get_logger("gateway.pipeline")


class Pipeline:
    """Runs calls against the current policy. Swap ``policy`` whole to reload."""

    def __init__(
        self,
        policy: PolicySet,
        *,
        resolvers: SecretResolvers,
        upstream: Upstream,
        audit: AuditLog,
        metrics: Metrics,
        groups: RateLimitGroups,
        breakers: CircuitBreakers,
        idempotency: IdempotencyStores | IdempotencyStore,
        rng: random.Random | None = None,
        tracer: telemetry.Telemetry = telemetry.NO_TELEMETRY,
        budgets: Budgets | None = None,
        controls: Controls | None = None,
        databases: Databases | None = None,
    ) -> None:
        self.groups = groups
        #: The engines of database targets (gateway.database); none without such targets.
        self.databases = databases
        #: The stop switch and the repeated-call breaker (gateway.agents.controls).
        self.controls = controls if controls is not None else Controls()
        #: Cost budgets (local unless built with a cluster) and the policy's prices.
        self.budgets = budgets if budgets is not None else Budgets(policy.policy.budgets)
        self.pricing = Pricing(policy.policy.prices)
        self.breakers = breakers
        #: The idempotency stores by scope (a single store serves every scope).
        self.idempotency = (
            idempotency
            if isinstance(idempotency, IdempotencyStores)
            else IdempotencyStores(idempotency)
        )
        self.policy = policy
        self.resolvers = resolvers
        self.upstream = upstream
        self.audit = audit
        self.metrics = metrics
        self.rng = rng or random.Random()  # noqa: S311 - jitter, not cryptography
        #: Traces of the calls (gateway.telemetry); the no-op unless tracing is on.
        self.tracer = tracer
        #: Set by the runtime when it cancels calls that outlived the drain time.
        self.aborting = False
        #: The chains that reached the agent (the inbound route), for its own calls.
        self.chains = ChainMemory()
        #: Each target's credential, per secret (rebuilt on reload, gone with the pipeline).
        self.credentials = Credentials()
        #: When each pooled key (credential.refs) may serve again (gateway.call.keys).
        self.keys = KeyPools()
        #: The JSON of the answer an idempotent call stored last, for the server to send.
        self.rendered = Rendered()
        #: The operator's desk (agents/approvals.py, deadletters/): replaced by the runtime's.
        self.approvals = Approvals(MemoryApprovalStore(), audit)
        self.dead_letters = DeadLetters(max_count=1000, max_bytes=16 << 20, audit=audit)
        #: How the chain stage resolves its signing keys (gateway.call.send.resolve).
        self.resolve = functools.partial(send.resolve, self)
        #: The chain's signing keys, kept while unchanged (gateway.call.chain.ChainKeys).
        self.chain_keys = ChainKeys(resolvers)

    def apply_policy(self, policy: PolicySet) -> None:
        """Swap in a new policy; calls already running keep the one they started with.
        The parts this pipeline was handed take the policy in themselves (the runtime's
        components: :meth:`gateway.server.runtime.Gateway.apply_policy`)."""
        self.policy = policy
        self.credentials = Credentials()  # the old targets' secrets are not kept

    def handle(
        self,
        body: bytes,
        *,
        refuse: GatewayError | None = None,
        relay: Relay | None = None,
        identity: Identity | None = None,
    ) -> Coroutine[Any, Any, tuple[int, ExternalCallResponse]]:
        """Run one call from its raw envelope bytes: await it for (HTTP status, answer).
        Its policy and start are taken now (a plain function handing back the stages'
        coroutine: no frame of its own to resume at each of the call's awaits).

        With ``refuse`` the call is answered with that error at once (still audited).
        ``identity``: who called (:func:`gateway.agents.identity.identify`); None: the
        policy's ``agent_id``.
        """
        policy = self.policy  # one policy for the whole call, even across a reload
        identity = identity or policy_identity(policy.policy.agent_id)
        ctx = CallContext(
            time.monotonic(), identity.agent_id, identity=identity, policy_sha256=policy.sha256
        )

        def intake() -> Intake | Arrival | ArrivalFields:
            fast = parse_envelope_fast(body) if refuse is None else None
            return Intake(fast) if fast is not None else self._intake(body, refuse, policy)

        return self._run(policy, ctx, intake, relay, api_hooks.ENVELOPE)

    def handle_proxy(
        self,
        http: ProxyRequest,
        *,
        ctx: CallContext,
        refuse: GatewayError | None = None,
        relay: Relay | None = None,
    ) -> Coroutine[Any, Any, tuple[int, ExternalCallResponse]]:
        """Run one call of a drop-in provider route (:mod:`gateway.call.proxy` builds its
        request from ``http``): the same stages as an envelope, its policy taken now, as
        :meth:`handle`. ``ctx`` is the caller's, so that it can write back the upstream's
        own answer (``ctx.attempt_log.answer``)."""
        policy = self.policy  # a partial, not a lambda: no frame of its own per call
        intake = functools.partial(proxy_intake, http, policy, refuse)
        return self._run(policy, ctx, intake, relay, api_hooks.DROP_IN)

    async def handle_mcp(
        self,
        http: mcp.McpRequest,
        *,
        ctx: CallContext,
        refuse: GatewayError | None = None,
        relay: Relay | None = None,
    ) -> tuple[int, ExternalCallResponse]:
        """Run one request of ``/mcp/{target}`` (:func:`gateway.call.mcp.mcp_intake`): the
        same stages; ``ctx`` is the caller's (the upstream's answer, ``ctx.mcp``)."""
        policy = self.policy
        return await self._run(
            policy, ctx, lambda: mcp.mcp_intake(http, policy, refuse), relay, api_hooks.ROUTE
        )

    async def handle_a2a(
        self,
        http: a2a.A2aRequest,
        *,
        ctx: CallContext,
        tasks: a2a.TaskClock,
        refuse: GatewayError | None = None,
        relay: Relay | None = None,
        card_key: str | None = None,
    ) -> tuple[int, ExternalCallResponse]:
        """Run one request of ``/a2a/{target}`` (:func:`gateway.call.a2a.a2a_intake`; its
        tasks' clocks ``tasks``, the card's public key ``card_key``): the same stages;
        ``ctx`` is the caller's (the upstream's answer, ``ctx.a2a``)."""
        policy = self.policy
        return await self._run(
            policy,
            ctx,
            lambda: a2a.a2a_intake(http, policy, tasks, refuse, card_key),
            relay,
            api_hooks.A2A,
        )

    async def _run(
        self,
        policy: PolicySet,
        ctx: CallContext,
        intake: Callable[[], Intake | Arrival | ArrivalFields],
        relay: Relay | None,
        hooks: CallHooks,
    ) -> tuple[int, ExternalCallResponse]:
        """The stages of one call, the same for every API: ``intake`` gives its request,
        ``hooks`` are its API's part (:class:`gateway.call.hooks.CallHooks`)."""
        if ctx.policy_sha256 is None:  # a context the API built
            ctx.began(policy.sha256)
        trace = self.tracer.begin(ctx)
        status, response = 500, None
        try:
            request = _took(ctx, intake())
            ctx.decided("denied")
            # Without a coroutine while its keys are kept (a decision is a tuple, never false)
            spec, memory, keys = policy.policy.chain, self.chains, self.chain_keys
            chained = ctx.chained(
                chain_here(spec, request, ctx, memory, keys)
                or await chain_stage(spec, request, ctx, self.resolve, memory, keys)
            )
            if chained.error is not None:
                raise chained.error
            decision = egress_rules.decide(policy, request)
            ctx.aimed(decision.target, decision.api_key_ref)
            request, relay, reading = hooks.checked(request, decision.target, ctx, relay)
            if reading is not None:
                ctx.read(reading)  # raises its refusal
            request, decision = _ruled(policy, request, decision, ctx)  # model, group
            # Stop switch and repeated-call breaker: before any I/O (AGENT_STOPPED...).
            controls, name = self.controls, decision.target.name
            shadow = controls.check_here(ctx.agent_id, name, request, ctx.mcp, ctx.a2a)
            if shadow is None:  # a tool cap, or counted by its canonical JSON, maybe in Redis
                shadow = await controls.check(ctx.agent_id, name, request, ctx.mcp, ctx.a2a)
            ctx.allowed(shadow, decision.shadow_rule)
            # The envelope's timeout, or the chain's deadline when that comes first.
            deadline = min(ctx.started + request.timeout, time.monotonic() + chained.remaining_s)
            with controls.stops.track(ctx.agent_id, decision.target.name):  # a stop cancels it
                if (held := decision.target.spec.approval) is not None:  # a person's yes first
                    name, agent = decision.target.name, ctx.agent_id
                    await self.approvals.check(
                        held, name, request, ctx.mcp, agent, deadline, ctx.a2a
                    )
                # Sent (its group is ctx.rate_limit_group, _call_group), once per
                # idempotency key when its target keeps them.
                if (keyed := self._keyed(request, decision, ctx)) is None:
                    sent = self._forward(policy, request, decision, ctx, deadline, relay)
                    status, response = 200, await sent
                else:
                    status, response = await self._idempotent(
                        policy, request, decision, ctx, deadline, keyed, relay
                    )
            response = hooks.answered(ctx, response)
        except GatewayError as exc:
            status = answer_status(exc)
            response = self._failure(_stopped_after_sending(exc, ctx), ctx)
        except asyncio.CancelledError:
            status, response, answered = self._interrupted(ctx)  # audited either way
            if not answered:
                raise
        except Exception as exc:  # noqa: BLE001 - a bug must still get an answer
            status, response = 500, self._crashed(exc, ctx, policy)
        finally:
            if response is not None:
                self.dead_letters.after(ctx, response)  # kept when it failed for good
                trace.end(self._write_audit(ctx, response, hooks), status, response)
        return status, response

    def _interrupted(self, ctx: CallContext) -> tuple[int, ExternalCallResponse, bool]:
        """A call cancelled in flight (the agent hung up, the shutdown): its status and
        answer for the record, and whether it is answered (True: our own shutdown
        cancelled it once its drain time was over, the task is uncancelled and answers
        instead of vanishing; False: the cancellation goes on)."""
        interrupted = _interrupted_error(ctx)
        response = self._failure(interrupted, ctx)
        task = asyncio.current_task()
        if not self.aborting or task is None:
            return interrupted.http_status, response, False
        task.uncancel()
        return interrupted.http_status, response, True

    def _crashed(self, exc: Exception, ctx: CallContext, policy: PolicySet) -> ExternalCallResponse:
        """The answer to a bug inside the sidecar (logged with its traceback): UNKNOWN,
        pointing at the audit record; with ``server.debug`` the stack trace too."""
        _log.exception("internal_error", trace_id=_trace(ctx), correlation_id=_corr(ctx))
        err = InternalError(
            "the sidecar failed unexpectedly; the audit log has the details under this "
            "call's trace_id and correlation_id",
            details={"exception": type(exc).__name__},
        )
        response = self._failure(err, ctx)
        if policy.policy.server.debug:
            assert response.error is not None
            response = response.model_copy(
                update={
                    "error": response.error.model_copy(
                        update={"stack_trace": traceback.format_exc()}
                    )
                }
            )
        return response

    @staticmethod
    def _intake(body: bytes, refuse: GatewayError | None, policy: PolicySet) -> Arrival:
        """The exact path: parse, keep the ids an invalid envelope claims, validate."""
        try:
            raw = decode_json(body, check_surrogates=False)
        except Exception as exc:  # noqa: BLE001 - the pipeline raises it (ctx.arrived)
            return Arrival(None, refusal=exc)
        claimed = None
        if isinstance(raw, dict):
            claimed = {k: printable(raw[k][:256]) for k in CLAIMED if isinstance(raw.get(k), str)}
        try:
            refuse_lone_surrogates(body, raw)
            if refuse is not None:
                raise refuse
            return Arrival(
                parse_request(raw, unknown_fields=policy.policy.envelope.unknown_fields),
                claimed=claimed,
            )
        except Exception as exc:  # noqa: BLE001 - the pipeline raises it (ctx.arrived)
            return Arrival(None, claimed=claimed, refusal=exc)

    # -- stages ---------------------------------------------------------------------------

    @staticmethod
    def _keyed(
        request: ExternalCallRequest, decision: Decision, ctx: CallContext
    ) -> IdempotencySpec | None:
        """The call's idempotency (its key into ``ctx``) when its target keeps keys for
        its method: it is then sent once per key (:meth:`_idempotent`); else None."""
        target = decision.target
        idempotency = target.spec.idempotency
        if idempotency is None or request.method not in idempotency.methods:
            return None
        key = request.idempotency_key or derive_key(
            request.trace_id,
            request.correlation_id,
            target.name,
            request.method,
            request.endpoint,
        )
        ctx.keyed(key)
        return idempotency

    def _forward(
        self,
        policy: PolicySet,
        request: ExternalCallRequest,
        decision: Decision,
        ctx: CallContext,
        deadline: float,
        relay: Relay | None,
    ) -> Coroutine[Any, Any, ExternalCallResponse]:
        """:func:`gateway.call.send.forward` (through :func:`gateway.call.failover.
        fail_over` for a target with ``fallbacks``) inside the calling agent's own
        rate-limit group (:func:`gateway.call.agentgroup.taken`): a call that is sent
        takes it once, an answer replayed by its idempotency key never. Hands back the
        coroutine to await: without an agent's group, the send's own (no frame here)."""
        sent = failover.fail_over if decision.target.spec.fallbacks else send.forward
        if agentgroup.group_of(policy, ctx.identity) is None:  # most calls: no agent's group
            return sent(self, policy, request, decision, ctx, deadline, relay)  # no frame here
        return self._paced(sent, policy, request, decision, ctx, deadline, relay)

    async def _paced(
        self,
        sent: Callable[..., Coroutine[Any, Any, ExternalCallResponse]],
        policy: PolicySet,
        request: ExternalCallRequest,
        decision: Decision,
        ctx: CallContext,
        deadline: float,
        relay: Relay | None,
    ) -> ExternalCallResponse:
        """``sent`` inside the calling agent's own group (:func:`gateway.call.agentgroup.
        taken`)."""
        async with agentgroup.taken(self, policy, request, ctx, deadline):  # the agent's pace
            return await sent(self, policy, request, decision, ctx, deadline, relay)

    async def _idempotent(
        self,
        policy: PolicySet,
        request: ExternalCallRequest,
        decision: Decision,
        ctx: CallContext,
        deadline: float,
        idempotency: IdempotencySpec,
        relay: Relay | None,
    ) -> tuple[int, ExternalCallResponse]:
        """One upstream call per idempotency key (:func:`gateway.call.idempotent.
        once_per_key`), in the store of the target's ``idempotency.scope``."""
        learned = Learned()
        try:
            return await once_per_key(
                self.idempotency.for_scope(idempotency.scope),
                request,
                decision.target.name,
                ctx,
                deadline=deadline,
                ttl_s=idempotency.ttl_s,
                forward=lambda: self._forward(policy, request, decision, ctx, deadline, relay),
                failure=lambda exc: self._failure(exc, ctx),
                relay=relay,
                rendered=self.rendered,
                learned=learned,
            )
        finally:  # its warnings after the send stage's: the order the call met them
            ctx.learned(learned.replayed, learned.warnings, learned.json_data)

    # -- answers and audit ----------------------------------------------------------------

    def _failure(self, exc: GatewayError, ctx: CallContext) -> ExternalCallResponse:
        request = ctx.request
        return error_response(
            exc,
            latency_ms=(time.monotonic() - ctx.started) * 1000,
            failed_agent=ctx.agent_id,
            # An envelope that failed validation still gets its ids back, when it had them.
            trace_id=request.trace_id if request else ctx.claimed.get("trace_id"),
            correlation_id=(
                request.correlation_id if request else ctx.claimed.get("correlation_id")
            ),
        )

    def _write_audit(
        self, ctx: CallContext, response: ExternalCallResponse, hooks: CallHooks
    ) -> CallRecord:
        """Freeze the call into its record; write its audit record(s) (the API's hooks
        may make one per JSON-RPC request) and metrics."""
        call = ctx.record()
        for record in hooks.records(ctx, audit_record(call, response)):
            self.audit.call(record)
            labels = hooks.labels(ctx, record)
            if labels is not None:
                self.metrics.observe_mcp(record[Fields.TARGET_SYSTEM], *labels)
        observe(self.metrics, call, response)
        return call


def _ruled(
    policy: PolicySet, request: ExternalCallRequest, decision: Decision, ctx: CallContext
) -> tuple[ExternalCallRequest, Decision]:
    """The policy's rules on an allowed call, before the stop switch: the models stage
    when a rule applies to it (:func:`_models`), then its rate-limit group into the
    record (:func:`_call_group`). Returns the request as it is to be sent and its
    decision; raises their refusals."""
    if model_rules.ruled(policy, decision, ctx.agent_id):  # else nothing to check
        request, decision = _models(policy, request, decision, ctx)  # allowed, pinned
    ctx.grouped(request, _call_group(policy, request, decision, ctx))
    return request, decision


def _models(
    policy: PolicySet, request: ExternalCallRequest, decision: Decision, ctx: CallContext
) -> tuple[ExternalCallRequest, Decision]:
    """The models stage (:func:`gateway.call.models.checked`): the request as it is to be
    sent (an alias pinned) and its decision; its choice and shadow denials into the
    record. Raises its refusal (``model_not_allowed``), nothing sent."""
    models = model_rules.checked(policy, request, decision, ctx.agent_id)
    if models.refusal is not None:
        ctx.chose(models.choice)
        raise models.refusal
    ctx.modelled(models.choice, model_rules.shadow_rules(models.choice))
    return models.request, models.decision


def _call_group(
    policy: PolicySet, request: ExternalCallRequest, decision: Decision, ctx: CallContext
) -> str | None:
    """The call's rate-limit group: the envelope's, else its target's (None: none).
    Raises InvalidPayload (``unknown_rate_limit_group``) for a group the policy does not
    define, PermissionDenied for another agent's own (:func:`gateway.call.agentgroup.
    named_refusal`). Decided before the stop switch and any approval: no person is asked
    for a call that would then be refused (its approval used up, nothing sent)."""
    named = request.rate_limit_group
    if named is None:
        return decision.target.spec.rate_limit_group
    if named not in policy.policy.rate_limit_groups:
        raise InvalidPayload(
            f"rate_limit_group {named!r} is not defined in the policy "
            f"(known: {', '.join(sorted(policy.policy.rate_limit_groups)) or 'none'})",
            details={"reason": "unknown_rate_limit_group", "group": named},
        )
    refused = agentgroup.named_refusal(policy, ctx.identity, named)  # another agent's pace
    if refused is not None:
        raise refused
    return named


def _took(ctx: CallContext, taken: Intake | Arrival | ArrivalFields) -> ExternalCallRequest:
    """The request an intake gave, taken into ``ctx`` with who is calling; raises the
    intake's refusal, or the identity's when the caller may not call its target."""
    if isinstance(taken, tuple):  # an API's Arrival, refused or not (not the fast path's)
        taken = ctx.arrived(taken)
    request = taken.request
    # A claimed agent_id is checked against who called, never taken for it.
    identity = (ctx.identity or policy_identity(ctx.agent_id)).with_claim(request.agent_id)
    ctx.took(request, egress_rules.loggable_ref(request.api_key_ref), identity)
    if taken.unknown_fields:
        _unknown_fields(ctx, request, taken.unknown_fields)
    identity.admit(request.target_system)
    return request


def _unknown_fields(
    ctx: CallContext, request: ExternalCallRequest, fields: tuple[str, ...]
) -> None:
    """Warn (in the answer and the log) of the envelope's fields this sidecar ignored."""
    ctx.warned(("unknown envelope fields ignored: " + ", ".join(fields),))
    _log.warning(
        "unknown_envelope_fields",
        fields=list(fields),
        trace_id=request.trace_id,
        correlation_id=request.correlation_id,
    )


def _resendable(ctx: CallContext) -> bool:
    """Whether the call's request may be sent twice: an idempotent method, or a key."""
    request = ctx.request
    return request is not None and (
        request.method in IDEMPOTENT_METHODS or ctx.idempotency_key is not None
    )


def _stopped_after_sending(exc: GatewayError, ctx: CallContext) -> GatewayError:
    """``exc``; an AGENT_STOPPED that cancelled the call after a request that may not be
    sent twice reached the upstream says so (``details.outcome: unknown``: the upstream
    may have acted; the call is then kept as a dead letter where the target keeps them)."""
    if isinstance(exc, AgentStopped) and ctx.attempt_log.sent and not _resendable(ctx):
        exc.details["outcome"] = "unknown"
    return exc


def _interrupted_error(ctx: CallContext) -> GatewayError:
    if ctx.attempt_log.attempts and not _resendable(ctx):
        return OutcomeUnknown(
            "the sidecar shut down while the request was with the upstream; it may or may "
            "not have been processed. Check the upstream before retrying.",
            details={"reason": "shutdown"},
        )
    return ShuttingDown(
        "the sidecar shut down before the call finished; it is safe to retry",
        details={"reason": "shutdown"},
        retry_after_s=1.0,
    )


def _trace(ctx: CallContext) -> str | None:
    return ctx.request.trace_id if ctx.request else None


def _corr(ctx: CallContext) -> str | None:
    return ctx.request.correlation_id if ctx.request else None
