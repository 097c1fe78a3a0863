"""One call's context while it runs, frozen into its record at the end (pure: no I/O).

:class:`CallContext` is what the pipeline knows of a call as it goes. The stages return
small frozen results (an intake's :class:`Arrival`, an API's :class:`Reading`, the chain
stage's decision, the send stage's body digest, price, usage and cost...) and the
context's own methods are the only code that writes it
(tests/test_call_state_has_one_writer.py): each takes one result, as soon as the stage
has it, so that a call refused half-way is recorded with what it had learned.
:meth:`CallContext.record` freezes it into the :class:`gateway.record.CallRecord` that
the audit record (:func:`gateway.record.audit_record`), the metrics
(:func:`gateway.call.metrics.observe`) and the call's span read. :func:`audit_record`
and :func:`refusal_record` are the audit record of a context and of an answer given
before the envelope was read.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from gateway.agents.chain import ChainDecision
from gateway.agents.identity import Identity
from gateway.call.attempts import AttemptLog
from gateway.call.intake import Intake
from gateway.call.outbound import BodyDigest
from gateway.database import DbLog, StatementCall
from gateway.envelope import ExternalCallRequest, ExternalCallResponse, ServedBy
from gateway.policy import CompiledTarget
from gateway.policy.modelrules import ModelChoice
from gateway.providers import TokenUsage
from gateway.providers.mcp import McpExchange
from gateway.record import (
    CLAIM_LIMIT,
    CLAIMED,
    Api,
    CallRecord,
    DatabaseFacts,
    ModelFacts,
    StreamFacts,
    refusal_record,
)
from gateway.record import audit_record as record_of_call

_new_record = tuple.__new__

__all__ = [
    "CLAIMED",
    "CLAIM_LIMIT",
    "Arrival",
    "ArrivalFields",
    "CallContext",
    "Reading",
    "audit_record",
    "refusal_record",
]


class Arrival(NamedTuple):
    """What an API's intake made of a request (:func:`gateway.call.proxy.proxy_intake`,
    :func:`gateway.call.mcp.mcp_intake`, :func:`gateway.call.a2a.a2a_intake`, an
    envelope's exact path), refused or not: taken by :meth:`CallContext.arrived`."""

    #: The validated request (None: refused, ``refusal`` says why).
    intake: Intake | None
    api: Api = "envelope"
    #: The ids and request line the request claims (None: none read).
    claimed: dict[str, str] | None = None
    #: The call chain headers it came with (None: none).
    chain_seen: dict[str, str] | None = None
    #: The agent's headers that go upstream beneath the policy's (None: none).
    passthrough_headers: dict[str, str] | None = None
    warnings: tuple[str, ...] = ()
    #: The error that refuses it (raised by :meth:`CallContext.arrived`).
    refusal: BaseException | None = None
    #: ``denied`` when the intake's own rules refused it (None: not decided).
    decision: str | None = None
    mcp: McpExchange | None = None
    #: An A2A request or card fetch (typed loosely: gateway.call.a2a imports this module).
    a2a: Any = None
    #: An A2A target's ``a2a.agent_id``; whether the call goes to this sidecar's agent.
    target_agent: str | None = None
    chain_inbound: bool = False


#: An :class:`Arrival`'s fields as a plain tuple, in the same order: what the drop-in
#: route's intake gives for a request it took (once per call: a named tuple costs some
#: 3,000 instructions more to build and read; callgrind, CPython 3.11).
ArrivalFields = tuple[
    Intake | None,
    Api,
    dict[str, str] | None,
    dict[str, str] | None,
    dict[str, str] | None,
    tuple[str, ...],
    BaseException | None,
    str | None,
    McpExchange | None,
    Any,
    str | None,
    bool,
]


class Reading(NamedTuple):
    """What an API's reading of an allowed request learned
    (:meth:`gateway.call.hooks.CallHooks.checked`: a database statement bound, an MCP
    target's rules applied), refused or not: taken by :meth:`CallContext.read`."""

    api: Api | None = None
    db_call: StatementCall | None = None
    db: DbLog | None = None
    passthrough_headers: dict[str, str] | None = None
    mcp: McpExchange | None = None
    #: ``denied`` when the API's rules refused it (None: not decided here).
    decision: str | None = None
    #: The error that refuses it (raised by :meth:`CallContext.read`).
    refusal: BaseException | None = None


@dataclass(slots=True)
class CallContext:
    """What one call learned on its way; becomes the audit record. Read by every stage,
    written only by its own methods below, each taking one stage's result (the module
    docstring); the objects it holds that have their own writer (the attempts' log, an
    MCP exchange's outcomes, a database call's log) are written there."""

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
    #: The upstream's 2xx body was JSON whose value reads like a non-JSON body's form or
    #: no body (:func:`gateway.call.bodies.looks_like_a_form`): a keyed call stores that
    #: it was JSON, and a replay of it learns so, to write it back as JSON.
    json_data: bool = False
    #: The API the call came in by: ``proxy`` for the drop-in provider routes, ``mcp``
    #: for ``/mcp/{target}``.
    api: Api = "envelope"
    #: A database target's statement (``api: database``), and what running it learned.
    db_call: StatementCall | None = None
    db: DbLog | None = None
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
    #: Who answered (the target and model of the serving attempt; None: none did), the
    #: attempts of a call with ``fallbacks``, every option's (gateway.call.failover.fail_over;
    #: None: a call without, whose attempts are its log's ``tried`` when it retried), and
    #: the attempts made on the options before the last.
    served_by: ServedBy | None = None
    tried: list[dict[str, Any]] | None = None
    prior_attempts: int = 0
    #: The models decision (:mod:`gateway.call.models`; None: no ``models:`` rule
    #: applied) and the model a whole answer named (a stream's: its judge's).
    model: ModelChoice | None = None
    answered_model: str | None = None
    #: The agent the call goes to, when its target is an agent (``a2a.agent_id``): the
    #: chain decision's target agent, set by the API's intake; and an A2A request
    #: (gateway.providers.a2a.A2aExchange) or card fetch (gateway.call.a2a.CardFetch), as
    #: read (typed loosely: gateway.call.a2a imports this module).
    target_agent: str | None = None
    a2a: Any = None
    #: A call to this sidecar's agent (the inbound route): its chain is admitted, not
    #: extended (gateway.call.chain).
    chain_inbound: bool = False
    #: The calling agent's own rate-limit group (``agents.NAME.rate_limit_group``: None,
    #: none, or the call's own group) and the seconds the call waited for it
    #: (gateway.call.agentgroup); the group that refused the call (CAPACITY_EXCEEDED
    #: from the sidecar's own limits: the agent's or the call's group), if one did.
    agent_rate_limit_group: str | None = None
    agent_rate_limit_wait_s: float = 0.0
    rate_limit_refused: str | None = None

    # -- the one writer: each stage's result, as the stage returns it -------------------

    def began(self, policy_sha256: str) -> None:
        """The call runs under the policy whose file has this SHA-256."""
        self.policy_sha256 = policy_sha256

    def arrived(self, arrival: Arrival | ArrivalFields) -> Intake:
        """An intake's result; returns its request. Raises its refusal."""
        (
            intake,
            api,
            claimed,
            seen,
            passed,
            warnings,
            refusal,
            decision,
            mcp,
            a2a,
            agent,
            inbound,
        ) = arrival
        self.api, self.chain_seen = api, seen
        if claimed is not None:
            self.claimed = claimed
        if passed is not None:
            self.passthrough_headers = passed
        if warnings:
            self.warnings.extend(warnings)
        if mcp is not None or a2a is not None:
            self.mcp, self.a2a = mcp, a2a
        if agent is not None or inbound:
            self.target_agent, self.chain_inbound = agent, inbound
        if decision is not None:
            self.decision = decision
        if refusal is not None or intake is None:
            raise refusal or AssertionError("an arrival without its request")
        return intake

    def took(
        self, request: ExternalCallRequest, api_key_ref: str | None, identity: Identity
    ) -> None:
        """The validated request, the secret reference it names (as it may be logged) and
        who calls (the claim checked against)."""
        self.request, self.api_key_ref, self.identity = request, api_key_ref, identity

    def warned(self, warnings: Iterable[str]) -> None:
        """Warnings for the answer and the record, in the order the call met them."""
        self.warnings.extend(warnings)

    def decided(self, decision: str) -> None:
        """The record's ``decision`` (``denied`` until the call is allowed)."""
        self.decision = decision

    def chained(self, decision: ChainDecision) -> ChainDecision:
        """The chain stage's decision, refused or not; returns it."""
        self.chain = decision
        return decision

    def aimed(self, target: CompiledTarget, api_key_ref: str | None) -> None:
        """The egress decision: the target and the secret reference that serve."""
        self.target, self.api_key_ref = target, api_key_ref

    def read(self, reading: Reading) -> None:
        """An API's reading of the allowed request. Raises its refusal."""
        api, db_call, db, passed, mcp, decision, refusal = reading
        if api is not None:
            self.api = api
        if db_call is not None:
            self.db_call = db_call
        if db is not None:
            self.db = db
        if passed is not None:
            self.passthrough_headers = passed
        if mcp is not None:
            self.mcp = mcp
        if decision is not None:
            self.decision = decision
        if refusal is not None:
            raise refusal

    def chose(self, model: ModelChoice | None) -> None:
        """The models decision (None: no ``models:`` rule applied)."""
        self.model = model

    def modelled(self, model: ModelChoice | None, shadow_denied: list[str]) -> None:
        """The models decision that let the call go (None: no ``models:`` rule applied)
        and the rules that would have refused its model in shadow mode."""
        self.model = model
        if shadow_denied:
            self.shadow_denied += shadow_denied

    def allowed(self, shadow_denied: list[str], endpoint_rule: str | None) -> None:
        """The call is allowed: what the controls and the endpoint rules would have refused
        in shadow mode."""
        if shadow_denied:
            self.shadow_denied += shadow_denied
        self.decision = "allowed"
        if endpoint_rule is not None:
            self.shadow_denied.append(f"endpoint:{endpoint_rule}")

    def grouped(self, request: ExternalCallRequest, rate_limit_group: str | None) -> None:
        """The request as the models stage lets it go (an alias pinned) and the rate-limit
        group it is counted in (None: none)."""
        self.request, self.rate_limit_group = request, rate_limit_group

    def keyed(self, idempotency_key: str) -> None:
        """The call's idempotency key (its target keeps them)."""
        self.idempotency_key = idempotency_key

    def pacing(self, agent_rate_limit_group: str) -> None:
        """The calling agent's own rate-limit group holds the call
        (:mod:`gateway.call.agentgroup`)."""
        self.agent_rate_limit_group = agent_rate_limit_group

    def paced(self, waited_s: float, shadow_denied: Iterable[str]) -> None:
        """The seconds the call waited in the agent's own group; the groups that would
        have refused it in shadow mode."""
        self.agent_rate_limit_wait_s = waited_s
        self.shadow_denied.extend(f"rate_limit_group:{g}" for g in shadow_denied)

    def group_refused(self, rate_limit_group: str) -> None:
        """The rate-limit group that refused the call (CAPACITY_EXCEEDED)."""
        self.rate_limit_refused = rate_limit_group

    def learned(self, replayed: bool, warnings: Iterable[str], json_data: bool = False) -> None:
        """What the idempotency stage learned: the answer is a replay (its data a JSON
        body's value that reads like a form: :attr:`json_data`); its warnings."""
        if replayed:
            self.replayed = True
        if json_data:
            self.json_data = True
        if warnings:
            self.warnings.extend(warnings)

    # -- the send stage (gateway.call.send) --------------------------------------------

    def failing_over(self) -> None:
        """The call has ``fallbacks``: its options' attempts are kept (``tried``)."""
        self.tried = []

    def option(self, served_by: ServedBy | None, log: AttemptLog | None = None) -> None:
        """The option sent now (None: none served), with its own attempts' log."""
        self.served_by = served_by
        if log is not None:
            self.attempt_log = log

    def option_tried(self, entries: Iterable[dict[str, Any]]) -> None:
        """An option's entries of the record's ``tried``."""
        assert self.tried is not None
        self.tried.extend(entries)

    def fell_back(
        self, attempts_before: int, log: AttemptLog | None, api_key_ref: str | None = None,
        rate_limit_group: str | None = None,
    ) -> None:  # fmt: skip
        """The attempts made on options before the last (added); with ``log``, the failed
        target's attempts' log, whose answer and error are the call's; else the next
        option's secret reference and rate-limit group."""
        self.prior_attempts += attempts_before
        if log is not None:
            self.attempt_log = log
        else:
            self.api_key_ref, self.rate_limit_group = api_key_ref, rate_limit_group

    def key(self, api_key_ref: str) -> None:
        """The key of a pool (its reference name) that serves the call."""
        self.api_key_ref = api_key_ref

    def bound(self, call: StatementCall) -> None:
        """A database target's statement, as its record keeps it."""
        self.db_call = call

    def sent_out(self, digest: BodyDigest, traceparent: str) -> None:
        """The request as it goes out: its size and digest, its ``traceparent``."""
        self.request_bytes, self.request_sha256 = digest.size, digest.sha256
        self.traceparent = traceparent

    def attempting(self, log: AttemptLog, cost_model: str | None, cost_source: str | None) -> None:
        """The log the attempts keep (written by :mod:`gateway.call.attempts`), the model
        priced and where its price came from (None: none)."""
        self.attempt_log = log
        self.cost_model, self.cost_source = cost_model, cost_source

    def over_budget(self) -> None:
        """A budget refused the call: denied, nothing sent."""
        self.decision, self.cost_reason = "denied", "not_sent"

    def booked(self, budgets: list[str]) -> None:
        """The budgets the call was booked in."""
        self.budgets = budgets

    def shadowed(self, rules: Iterable[str], *, once: bool = False) -> None:
        """Rules that would have refused the call in shadow mode; ``once``: a rule
        already recorded is not added again."""
        if not once:
            self.shadow_denied.extend(rules)
            return
        for rule in rules:
            if rule not in self.shadow_denied:
                self.shadow_denied.append(rule)

    def cost_failed(self, cost_reason: str | None) -> None:
        """Why a failed call has no cost (:func:`gateway.call.spend.settle_failed`)."""
        self.cost_reason = cost_reason

    def settled(
        self, usage: TokenUsage | None, cost_usd: float | None, cost_reason: str | None,
        stream_body: bytes | None, json_data: bool = False,
    ) -> None:  # fmt: skip
        """The upstream's 2xx answer: its usage, its cost (None: unknown, and why) and,
        for the idempotency store, a stream's bytes (None: none kept)."""
        self.usage, self.cost_usd, self.cost_reason = usage, cost_usd, cost_reason
        if stream_body is not None:
            self.stream_body = stream_body
        if json_data:
            self.json_data = True

    def answered(self, model: str | None) -> None:
        """The model a whole answer named (None: none)."""
        self.answered_model = model

    # -- reading ----------------------------------------------------------------------

    def a2a_ids(self) -> tuple[str | None, str | None]:
        """The A2A task and context ids the call concerns (None when not an A2A call)."""
        return (getattr(self.a2a, "task_id", None), getattr(self.a2a, "context_id", None))

    def record(self) -> CallRecord:
        """What the call learned, frozen: this context with its attempts' log."""
        log = self.attempt_log
        relayed = log.relayed
        stream = (
            None
            if relayed is None
            else StreamFacts(
                relayed.judge.events, relayed.first_byte_s, relayed.judge.response_model()
            )
        )
        shadow = self.shadow_denied
        if log.shadow_denied:
            shadow = [*shadow, *(f"rate_limit_group:{g}" for g in log.shadow_denied)]
        # tuple.__new__: the named tuple without its Python-level __new__ (once per call)
        return _new_record(
            CallRecord,
            (
                self.started,
                self.agent_id,
                self.api,
                self.request,
                self.target,
                self.claimed,
                self.decision,
                self.replayed,
                self.api_key_ref,
                self.rate_limit_group,
                self.idempotency_key,
                self.traceparent,
                self.request_bytes,
                self.request_sha256,
                self.usage,
                self.cost_usd,
                self.cost_reason,
                self.cost_model,
                self.cost_source,
                self.budgets,
                [*self.warnings, *log.warnings],
                shadow,
                log.attempts + self.prior_attempts,
                log.upstream_latency_s,
                log.response_bytes,
                log.rate_limit_wait_s + self.agent_rate_limit_wait_s,
                stream,
                self.mcp,
                self.identity,
                self.policy_sha256,
                self.chain,
                self.served_by,
                self.tried if self.tried is not None else log.tried,
                self._models(),
                _database(self.db_call, self.db),
                self.agent_rate_limit_group,
                self.rate_limit_refused,
            ),
        )

    def _models(self) -> ModelFacts | None:
        """The models the call asked for, sent and got (None without a models rule)."""
        choice = self.model
        if choice is None:
            return None
        relayed = self.attempt_log.relayed
        answered = relayed.judge.model if relayed is not None else self.answered_model
        return ModelFacts(choice.requested, choice.sent, answered)


def _database(call: StatementCall | None, log: DbLog | None) -> DatabaseFacts | None:
    if call is None:
        return None
    log = log or DbLog()
    return DatabaseFacts(
        call.name,
        call.sql_sha256,
        call.params_sha256,
        log.user,
        log.rows,
        log.sqlstate,
        log.pool_wait_s,
        tuple(log.retries),
    )


def audit_record(ctx: CallContext, response: ExternalCallResponse) -> dict[str, Any]:
    """The audit record of the call ``ctx`` describes, ended with ``response``
    (:func:`gateway.record.audit_record` of ``ctx.record()``)."""
    return record_of_call(ctx.record(), response)
