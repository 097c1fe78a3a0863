"""Prometheus metrics for ``GET /metrics`` (prometheus-client: here and in
:mod:`gateway.metrics.series`, which declares the series).

Every metric lives in a :class:`Metrics` object's own ``CollectorRegistry``, not the
process-global one, so tests and several app instances never share counters. A policy
reload keeps the same object (counters survive) and only calls :meth:`Metrics.set_known`.

Label values come only from policy names (targets, rate-limit groups, agents) and fixed
enums, never from payloads or secrets. A target or group name the current policy does not
know (an envelope can name anything) is counted under ``_unknown``, so an agent cannot
grow the series count; policy names cannot start with ``_``, so the bucket never
collides. The ``agent`` label is the agent the sidecar established (its ``agents:``
names and its ``agent_id``), never an id a call claims; a caller recognised as no agent
is ``_unknown``.

Series (all prefixed ``egress_gateway_``; units in the names, seconds for time):

=====================================  =========  ======================================
name                                   type       labels
=====================================  =========  ======================================
calls_total                            counter    target, outcome, code
agent_calls_total                      counter    agent (established, never claimed),
                                                  decision (allowed|denied|invalid|
                                                  replayed|shadow_denied)
call_duration_seconds                  histogram  target
upstream_duration_seconds              histogram  target
tokens_total                           counter    target, kind (input|output|cached)
retries_total                          counter    target
failovers_total                        counter    from, to (targets), reason (a
                                                  gateway.call.retry.FailoverReason)
ratelimit_wait_seconds                 histogram  group
ratelimit_rejections_total             counter    group
upstream_pool_wait_seconds             histogram  target (only calls that found all busy)
upstream_pool_rejections_total         counter    target
redis_fallbacks_total                  counter    group
breaker_state                          gauge      target (0 closed, 1 half-open, 2 open)
breaker_transitions_total              counter    target, to
secret_cache_total                     counter    result (hit|miss|stale)
policy_reloads_total                   counter    result (ok|error)
inflight_calls                         gauge      (none)
audit_write_failures_total             counter    (none)
secrets_ready                          gauge      (none): 1 usable, 0 Vault without a token
build_info                             gauge      version, python (always 1)
policy_info                            gauge      agent_id, digest (always 1)
mcp_requests_total                     counter    target, method, tool, outcome
database_statements_total              counter    target, statement, outcome (success or
                                                  the error code)
budget_spent_usd                       gauge      budget, scope (local budgets: this
                                                  sidecar's spend in the current window)
budget_limit_usd                       gauge      budget, scope (every budget's limit)
audit_shipping_dropped_total           counter    (none; with audit.otlp) spool overflow
audit_shipping_pending_bytes           gauge      (none; with audit.otlp) not yet shipped
call_chain_refusals_total              counter    reason (circular_call_detected|max_depth_
                                                  exceeded|ttl_expired|invalid_chain)
agent_stops                            gauge      scope (agent|target|all): stops in force
agent_stop_changes_total               counter    action (stop|resume), scope
model_drift_total                      counter    target, sent, answered (models bounded as
                                                  the gen_ai model labels)
dead_letters_total                     counter    target
dead_letters_dropped_total             counter    (none)
approvals_total                        counter    event (approval_requested|approval_
                                                  decided|approval_used)
=====================================  =========  ======================================

The OpenTelemetry GenAI client metrics (semantic conventions 1.44.0, "Development"; see
:mod:`gateway.telemetry.genai`), named as the OpenTelemetry-to-Prometheus translation
names them (dots to underscores, the unit ``s`` as ``_seconds``, ``{token}`` dropped),
so dashboards made for other GenAI gateways work here too; one observation per model
call (replays are not operations), for targets with a ``usage`` dialect and a model
endpoint:

===================================================  =========  ========================
name                                                 type       labels
===================================================  =========  ========================
gen_ai_client_token_usage                            histogram  operation, provider,
                                                                request and response
                                                                model, token_type
gen_ai_client_operation_duration_seconds             histogram  the same less token
                                                                type, plus error_type
gen_ai_client_operation_time_to_first_chunk_seconds  histogram  operation, provider,
                                                                request model (streams)
===================================================  =========  ========================

(label names ``gen_ai_operation_name``, ``gen_ai_provider_name``, ``gen_ai_request_model``,
``gen_ai_response_model``, ``gen_ai_token_type``, ``error_type``). Model labels are
bounded: a model the policy's ``telemetry.models`` lists (an exact name, or a
``prefix*`` whose first :data:`MAX_PREFIXED_MODELS` matches are kept) is its own value,
any other ``_other``; no model at all is ``_none``. The standard ``process_*`` and
``python_*`` collectors are registered too; ``_created`` series are not exported (they
double the series count and no dashboard reads them).

Naming follows the Prometheus guide (https://prometheus.io/docs/practices/naming/):
base units, ``_total`` for counters, ``_seconds`` for durations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Final, Literal

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.exposition import choose_encoder

from gateway.envelope import ErrorCode
from gateway.metrics.series import BudgetLevel, Series, Watched

if TYPE_CHECKING:
    from gateway.breaker import BreakerState

disable_created_metrics()  # type: ignore[no-untyped-call]  # process-wide; this module owns it

#: Label value for a target or group the current policy does not define.
UNKNOWN_LABEL: Final = "_unknown"
#: ``code`` label of a successful call (every failure carries an ErrorCode).
OK_CODE: Final = "OK"

#: Model label of a model the policy's ``telemetry.models`` does not name, and of none.
OTHER_MODEL: Final = "_other"
NO_MODEL: Final = "_none"
#: Distinct models a ``prefix*`` entry may add as label values (the rest are ``_other``).
MAX_PREFIXED_MODELS: Final = 50

Outcome = Literal["success", "error", "replay"]
CacheResult = Literal["hit", "miss", "stale"]
ReloadResult = Literal["ok", "error"]

_OUTCOMES: Final = frozenset({"success", "error", "replay"})
_DECISIONS: Final = frozenset({"allowed", "denied", "invalid", "replayed", "shadow_denied"})
_CACHE_RESULTS: Final = frozenset({"hit", "miss", "stale"})
_CODES: Final = frozenset(c.value for c in ErrorCode) | {OK_CODE}
#: Named label values a call's series are looked up by before mapping (models, targets).
_MAX_NAMED: Final = 1024
_TOKEN_KINDS: Final = ("", "input", "output", "cached")  # by index in a bound list
#: Gauge encoding of the circuit breaker states.
#: The gauge's value and the ``to`` label for each state of :mod:`gateway.breaker`
#: (``half_open`` is spelt ``half-open`` in the exposition, as it always was).
BREAKER_STATE_VALUES: Final[dict[str, int]] = {"closed": 0, "half_open": 1, "open": 2}
_BREAKER_STATE_LABELS: Final[dict[str, str]] = {
    "closed": "closed",
    "half_open": "half-open",
    "open": "open",
}


class Metrics(Series):
    """The sidecar's metrics, held in a private registry.

    Create one per process (or per test), call :meth:`set_known` with the policy's target
    and group names at start-up and after every reload, record with the ``observe_*``
    methods, and serve :meth:`render` on ``GET /metrics``. No method raises on an
    unexpected label value: it is bucketed, because metrics must never fail a call.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._targets: frozenset[str] = frozenset()
        self._groups: frozenset[str] = frozenset()
        self._agents: frozenset[str] = frozenset()
        self._models: frozenset[str] = frozenset()
        self._model_prefixes: tuple[str, ...] = ()
        self._prefixed_seen: set[str] = set()
        self._children: dict[tuple[Counter | Histogram, tuple[str, ...]], Any] = {}
        #: Per-call series bound once per label values (a call's observations are then
        #: one dict lookup each): by target name, and by the GenAI label values.
        self._per_target: dict[str, tuple[str, Any, Any, dict[Any, Any]]] = {}
        self._per_model: dict[tuple[str, ...], list[Any]] = {}
        #: The same by the values a call names (models before bounding), so a call's
        #: GenAI observations skip the label mapping; bounded (:data:`_MAX_NAMED`), and
        #: cleared when the policy's models change. Token counters by policy target,
        #: the wait histogram by policy group, the cost counter by target and model.
        self._per_named: dict[tuple[str, str, str | None, str | None, str], list[Any]] = {}
        self._tokens_by_target: dict[str, list[Any]] = {}
        self._wait_by_group: dict[str, Any] = {}
        self._cost_by_named: dict[tuple[str, str | None], Any] = {}
        Series.__init__(self, self.registry)
        r = self.registry
        self._watched = Watched()
        r.register(self._watched)
        # Label values known in advance start at 0, so that rate() and alerts see a series
        # before the first event (Prometheus "avoid missing metrics").
        for result in sorted(_CACHE_RESULTS):
            self._child(self.secret_cache, result)
        for ok in ("ok", "error"):
            self._child(self.policy_reloads, ok)
        self.set_agent_stops({})
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)

    # --- label hygiene --------------------------------------------------------------------

    def set_known(
        self,
        targets: Iterable[str],
        groups: Iterable[str],
        *,
        models: Sequence[str] = (),
        agent_id: str | None = None,
        digest: str | None = None,
        agents: Iterable[str] = (),
    ) -> None:
        """Set the target, rate-limit group and model names of the policy now in force
        (``models``: the policy's ``telemetry.models``, exact names or ``prefix*``), and
        with ``agent_id`` and ``digest`` the ``policy_info`` gauge; the ``agent`` label's
        values are ``agents`` (the policy's ``agents:`` names) and ``agent_id``.

        Call at start-up and after each successful reload. Targets new to the policy get a
        ``breaker_state`` of 0 (closed); the breaker series of removed targets are dropped
        so a dashboard does not show a stale open breaker forever. Counters are kept.
        """
        self._models = frozenset(m for m in models if not m.endswith("*"))
        self._model_prefixes = tuple(m[:-1] for m in models if m.endswith("*"))
        if agent_id is not None:
            self.policy_info.info({"agent_id": agent_id, "digest": digest or ""})
        self._agents = frozenset(agents) | ({agent_id} if agent_id is not None else set())
        targets = frozenset(targets)
        for gone in self._targets - targets:
            self.breaker_state.remove(gone)
        for new in targets - self._targets:
            self.breaker_state.labels(new).set(BREAKER_STATE_VALUES["closed"])
        self._targets = targets
        # A name's label (itself, _unknown or _other) may have changed.
        self._per_target.clear()
        self._per_named.clear()
        self._tokens_by_target.clear()
        self._wait_by_group.clear()
        self._cost_by_named.clear()
        self._groups = frozenset(groups)
        for target in targets:
            self._child(self.retries, target)
            self._child(self.pool_rejections, target)
        for group in self._groups:
            self._child(self.ratelimit_rejections, group)
            self._child(self.ratelimit_wait, group)
            self._child(self.redis_fallbacks, group)

    def _child(self, metric: Counter | Histogram, *values: str) -> Any:
        """``metric.labels(*values)``, remembered: prometheus-client validates the values
        and takes a lock on every ``labels()``. Label values are policy names and fixed
        enums, so this holds at most what the registry itself holds."""
        key = (metric, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def _target(self, name: str) -> str:
        return name if name in self._targets else UNKNOWN_LABEL

    def _group(self, name: str) -> str:
        return name if name in self._groups else UNKNOWN_LABEL

    def _model(self, name: str | None) -> str:
        """A model's label value: named by the policy, else ``_other`` (``_none``: none)."""
        if name is None:
            return NO_MODEL
        if name in self._models or name in self._prefixed_seen:
            return name
        if name.startswith(self._model_prefixes) and len(self._prefixed_seen) < (
            MAX_PREFIXED_MODELS
        ):
            self._prefixed_seen.add(name)
            return name
        return OTHER_MODEL

    # --- recording ------------------------------------------------------------------------

    def observe_call(
        self,
        target: str,
        outcome: Outcome,
        code: ErrorCode | None,
        latency_s: float,
        upstream_latency_s: float | None = None,
    ) -> None:
        """Record one answered call.

        ``code`` is the answer's error code, None on success (labelled ``OK``);
        ``latency_s`` the wall time inside the sidecar; ``upstream_latency_s`` the time
        spent on upstream attempts, None when nothing was sent (refused, replayed).
        """
        bound = self._per_target.get(target)
        if bound is None:
            label = self._target(target)
            bound = (
                label,
                self._child(self.call_duration, label),
                self._child(self.upstream_duration, label),
                {},
            )
            if label == target:  # policy names only: an agent's claimed name is not kept
                self._per_target[target] = bound
        label, duration, upstream, calls = bound
        counter = calls.get((outcome, code))
        if counter is None:
            code_label = OK_CODE if code is None else str(code)
            counter = calls[outcome, code] = self._child(
                self.calls,
                label,
                outcome if outcome in _OUTCOMES else UNKNOWN_LABEL,
                code_label if code_label in _CODES else UNKNOWN_LABEL,
            )
        counter.inc()
        duration.observe(max(latency_s, 0.0))
        if upstream_latency_s is not None:
            upstream.observe(max(upstream_latency_s, 0.0))

    def observe_agent_call(self, agent: str, decision: str) -> None:
        """Count one answered call of ``agent`` (the established agent id: a name the
        policy does not give, such as a caller recognised as no agent, is ``_unknown``)
        with its ``decision`` (the audit record's)."""
        self._child(
            self.agent_calls,
            agent if agent in self._agents else UNKNOWN_LABEL,
            decision if decision in _DECISIONS else UNKNOWN_LABEL,
        ).inc()

    def observe_tokens(
        self,
        target: str,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        cached_tokens: int | None = None,
    ) -> None:
        """Add the token counts of one upstream response (None or <= 0: that kind untouched)."""
        bound = self._tokens_by_target.get(target)
        if bound is None:
            bound = [self._target(target), None, None, None]  # the label, then a child a kind
            if bound[0] == target:  # policy names only, as in observe_call
                self._tokens_by_target[target] = bound
        for i, count in ((1, input_tokens), (2, output_tokens), (3, cached_tokens)):
            if count is not None and count > 0:
                child = bound[i]
                if child is None:  # bound on first use: no series before its first count
                    child = bound[i] = self._child(self.tokens, bound[0], _TOKEN_KINDS[i])
                child.inc(count)

    def observe_genai(
        self,
        operation: str,
        provider: str,
        request_model: str | None,
        response_model: str | None,
        *,
        duration_s: float,
        error_type: str | None = None,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        first_chunk_s: float | None = None,
    ) -> None:
        """Record one model call (the GenAI client metrics): its duration in seconds,
        ``error_type`` (the answer's error code) when it failed, its token counts (input
        with cached tokens, as the conventions count them; None: unknown, not recorded)
        and, for a relayed stream, the seconds to its first chunk. ``operation`` and
        ``provider`` come from the dialect (fixed values); the models are bounded."""
        named = (operation, provider, request_model, response_model, error_type or "")
        bound = self._per_named.get(named)
        if bound is None:
            bound = self._bind_genai(named)
        bound[0].observe(max(duration_s, 0.0))
        for i, count in ((1, input_tokens), (2, output_tokens)):
            if count is not None and count >= 0:
                child = bound[i]
                if child is None:  # bound on first use: no series before its first count
                    child = bound[i] = self._child(self.token_usage, *bound[3], _TOKEN_KINDS[i])
                child.observe(count)
        if first_chunk_s is not None:
            self._child(self.first_chunk, *bound[3][:3]).observe(max(first_chunk_s, 0.0))

    def _bind_genai(self, named: tuple[str, str, str | None, str | None, str]) -> list[Any]:
        """The bound series of one call's GenAI label values: ``[operation duration,
        input tokens, output tokens, the label values]`` (token histograms None until
        their first count, so no series appears before it)."""
        operation, provider, request_model, response_model, error_type = named
        key = (operation, provider, self._model(request_model), self._model(response_model))
        labels = (*key, error_type)
        bound = self._per_model.get(labels)  # label values only: bounded like the registry
        if bound is None:
            bound = self._per_model[labels] = [
                self._child(self.operation_duration, *labels), None, None, key,
            ]  # fmt: skip
        if len(self._per_named) >= _MAX_NAMED:
            self._per_named.clear()
        self._per_named[named] = bound
        return bound

    def observe_cost(self, target: str, model: str | None, usd: float) -> None:
        """Add one call's cost in USD (model labels as for the gen_ai metrics)."""
        named = (target, model)
        child = self._cost_by_named.get(named)
        if child is None:
            child = self._child(self.cost, self._target(target), self._model(model))
            if len(self._cost_by_named) >= _MAX_NAMED:
                self._cost_by_named.clear()
            self._cost_by_named[named] = child
        child.inc(max(usd, 0.0))

    def observe_model_drift(self, target: str, sent: str, answered: str | None) -> None:
        """Count one answer that named model ``answered``, not the ``sent`` one (models
        bounded as for the gen_ai metrics; the target a policy name)."""
        self._child(
            self.model_drift, self._target(target), self._model(sent), self._model(answered)
        ).inc()

    def observe_budget_rejection(self, budget: str) -> None:
        """Count one call a budget refused (the budget's policy name)."""
        self._child(self.budget_rejections, budget).inc()

    def observe_chain_refusal(self, reason: str) -> None:
        """Count one call refused for its call chain (``details.reason``: one of four)."""
        self._child(self.chain_refusals, reason).inc()

    def set_agent_stops(self, counts: dict[str, int]) -> None:
        """The stop switches in force, by scope (``agent``, ``target``, ``all``)."""
        for scope in ("agent", "target", "all"):
            self.agent_stops.labels(scope).set(counts.get(scope, 0))

    def observe_agent_stop_change(self, action: str, scope: str) -> None:
        """Count one ``stop`` or ``resume`` an operator asked for, by its scope."""
        self._child(self.agent_stop_changes, action, scope).inc()

    def observe_dead_letter(self, target: str) -> None:
        """Count one call kept as a dead letter (its target's policy name)."""
        self._child(self.dead_letters, self._target(target)).inc()

    def observe_dead_letters_dropped(self, count: int = 1) -> None:
        """Count dead letters dropped to stay within the bounds."""
        self.dead_letters_dropped.inc(count)

    def observe_approval(self, event: str) -> None:
        """Count one approval event (``approval_requested``, ``_decided``, ``_used``)."""
        self._child(self.approvals, event).inc()

    def observe_shadow_denial(self, kind: str, rule: str) -> None:
        """Count one "would deny" of a shadow rule: kind ``endpoint`` (its path pattern),
        ``rate_limit_group`` or ``budget`` (their policy names)."""
        self._child(self.shadow_denials, kind, rule).inc()

    def observe_mcp(self, target: str | None, method: str, tool: str, outcome: str) -> None:
        """Count one JSON-RPC request to an MCP target; ``method``, ``tool`` and ``outcome``
        are bounded by the caller (:func:`gateway.call.mcp.metric_labels`)."""
        self._child(self.mcp_requests, self._target(target or "_none"), method, tool, outcome).inc()

    def observe_statement(self, target: str, statement: str, outcome: str) -> None:
        """Count one named statement of a database target; ``statement`` is a policy
        name (the call was bound to it), ``outcome`` ``success`` or an error code."""
        self._child(self.database_statements, self._target(target), statement, outcome).inc()

    def observe_retry(self, target: str) -> None:
        """Count one retry (an upstream attempt after the first)."""
        self._child(self.retries, self._target(target)).inc()

    def observe_failover(self, source: str, to: str, reason: str) -> None:
        """Count a call moved from target ``source`` to its fallback ``to`` for ``reason``
        (policy names and a fixed enum)."""
        self._child(self.failovers, self._target(source), self._target(to), reason).inc()

    def observe_ratelimit_wait(self, group: str, wait_s: float) -> None:
        """Record the time a call waited for its rate-limit group, in seconds."""
        child = self._wait_by_group.get(group)
        if child is None:
            child = self._child(self.ratelimit_wait, self._group(group))
            if group in self._groups:  # policy names only
                self._wait_by_group[group] = child
        child.observe(max(wait_s, 0.0))

    def observe_ratelimit_rejection(self, group: str) -> None:
        """Count one call the rate-limit group refused (CAPACITY_EXCEEDED)."""
        self._child(self.ratelimit_rejections, self._group(group)).inc()

    def observe_pool_wait(self, target: str, wait_s: float, admitted: bool) -> None:
        """Record a wait for one of ``target``'s connections (all were busy), in seconds;
        a wait that was not ``admitted`` ended in CAPACITY_EXCEEDED and is counted too."""
        name = self._target(target)
        self._child(self.pool_wait, name).observe(max(wait_s, 0.0))
        if not admitted:
            self._child(self.pool_rejections, name).inc()

    def observe_redis_fallback(self, group: str) -> None:
        """Count one call a cluster-scope group admitted with its local limiter (fail-open)
        because Redis was unavailable."""
        self._child(self.redis_fallbacks, self._group(group)).inc()

    def observe_breaker_transition(self, target: str, to: BreakerState) -> None:
        """Record a circuit breaker state change (``to`` as :mod:`gateway.breaker` names
        it): sets the gauge, counts the transition."""
        value = BREAKER_STATE_VALUES.get(to)
        if value is None:
            return
        target = self._target(target)
        self.breaker_state.labels(target).set(value)
        self._child(self.breaker_transitions, target, _BREAKER_STATE_LABELS[to]).inc()

    def observe_secret_cache(self, result: CacheResult) -> None:
        """Count one secret cache lookup: ``hit``, ``miss`` or ``stale``."""
        self._child(self.secret_cache, result if result in _CACHE_RESULTS else UNKNOWN_LABEL).inc()

    def observe_policy_reload(self, ok: bool) -> None:
        """Count one policy reload attempt (``ok`` False: refused, the old policy stays)."""
        result: ReloadResult = "ok" if ok else "error"
        self._child(self.policy_reloads, result).inc()

    def watch(
        self,
        *,
        audit_failures: Callable[[], int],
        secrets_ready: Callable[[], bool],
        budgets: Callable[[], Iterable[BudgetLevel]] = tuple,
        audit_shipping: Callable[[], tuple[int, int] | None] = lambda: None,
    ) -> None:
        """Read, at each scrape, the audit sink's write failures so far, whether the
        secret store is usable (``/readyz``'s ``secrets`` check), each budget's (name,
        scope, spent USD or None when not known here, limit USD), and with ``audit.otlp``
        the spool's (lines dropped, bytes not yet shipped)."""
        self._watched.audit_failures = audit_failures
        self._watched.secrets_ready = secrets_ready
        self._watched.budgets = budgets
        self._watched.audit_shipping = audit_shipping

    # --- exposition -----------------------------------------------------------------------

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The exposition for ``GET /metrics``: ``(body, content_type)``.

        ``accept`` is the request's Accept header: OpenMetrics when the scraper asks for
        it, else the Prometheus text format 0.0.4 (negotiation as in prometheus-client).
        """
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type
