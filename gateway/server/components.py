"""The parts the policy drives, each built from the policy and rebuilt on reload.

A component (:class:`~gateway.server.parts.Component`, with the :class:`Parts` it builds
onto, in :mod:`gateway.server.parts`) builds its part at start (:meth:`Component.build`,
which hands every resource it opens to the runtime's ``AsyncExitStack``: one owner,
closed in reverse order, also when a later part fails to start) and takes in a new
policy on reload (:meth:`Component.apply`). Each says which policy keys it reads
(:class:`~gateway.server.parts.Keys`).

:data:`COMPONENTS` is the one list, in start order. From it come the start (each built
in turn), the reload (each applied in turn), and which keys a reload applies at once or
needs a restart for (:func:`~gateway.server.parts.hot_keys`,
:func:`~gateway.server.parts.restart_needed`): a new part is one class added to the
list, and cannot be left out of any of the three.

Parts built, in order: the listeners' settings (read by ``server.app`` at start), the
audit log, the outbound client, the price data, the secret resolvers, the Redis client
and cluster limits, the idempotency stores, telemetry, the rate-limit groups, the
circuit breakers, the budgets, the operator's controls (stop switch, repeated-call
breaker, tool caps), the database targets' engines, the pipeline, the agents who may
call, the operator's desk (approvals, dead letters), and the metrics' policy labels. A
component that must read something before it can take in a policy (the agents' tokens)
has an ``async prepare(policy, parts)``, which a reload awaits for every component
before any applies the policy.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from contextlib import AsyncExitStack
from typing import Any, ClassVar, Final

from gateway import audit, cost, telemetry
from gateway.agents.approvals import Approvals, ApprovalStore, MemoryApprovalStore
from gateway.agents.caps import CallCaps
from gateway.agents.controls import Controls, StopSwitch
from gateway.agents.identity import Agents, build_agents
from gateway.agents.registry import resolve_agents
from gateway.agents.repeats import RepeatedCalls
from gateway.breaker import BreakerState, CircuitBreakers, breaker_specs
from gateway.budgets import Budgets
from gateway.call.pipeline import Pipeline
from gateway.cost import Pricing
from gateway.database.registry import Databases, engine_class
from gateway.deadletters import DeadLetters
from gateway.idempotency.memory import MemoryIdempotencyStore
from gateway.idempotency.scopes import IdempotencyStores
from gateway.policy import PolicySet
from gateway.ratelimit import RateLimitGroups
from gateway.secrets.factory import build_secret_resolvers, secrets_ready, start_secret_resolvers
from gateway.server.parts import Component, Keys, Parts
from gateway.upstream import Upstream


class Listeners:
    """The listeners and the policy file watcher (``server.app.serve``: host, ports,
    ``max_request_bytes``, ``reload_interval_s``) read the server section at start; the
    drain reads ``drain_s`` and ``shutdown`` at SIGTERM, from the policy then in force;
    the body reader (``api.http``) ``max_inflight_request_bytes`` at each request.
    Built and closed by ``serve``, not here: this entry says what they read."""

    keys: ClassVar = Keys(
        hot=("server.drain_s", "server.shutdown", "server.max_inflight_request_bytes"),
        restart=("server",),
    )

    async def build(self, policy: PolicySet, parts: Parts, stack: AsyncExitStack) -> None:
        return None

    def apply(self, policy: PolicySet, parts: Parts) -> None:
        return None


class AuditSink:
    """The operational log's stream and the audit log."""

    keys: ClassVar = Keys(start_only=("audit",))

    async def build(self, policy: PolicySet, parts: Parts, stack: AsyncExitStack) -> None:
        audit.configure_logging(parts.log_stream)
        spec = policy.policy
        parts.audit = audit.AuditLog(spec.audit, parts.log_stream, agent_id=spec.agent_id)
        stack.push_async_callback(parts.audit.aclose)

    def apply(self, policy: PolicySet, parts: Parts) -> None:
        return None


class Outbound:
    """The one outbound client: egress rules and the answer size bound apply at once."""

    keys: ClassVar = Keys(hot=("egress", "server.max_response_bytes"))

    async def build(self, policy: PolicySet, parts: Parts, stack: AsyncExitStack) -> None:
        spec = policy.policy
        parts.upstream = Upstream(
            spec.egress,
            max_response_bytes=spec.server.max_response_bytes,
            resolver=parts.dns_resolver,
            on_pool_wait=parts.metrics.observe_pool_wait,
        )
        await parts.upstream.start()
        stack.push_async_callback(parts.upstream.aclose)

    def apply(self, policy: PolicySet, parts: Parts) -> None:
        parts.upstream.egress = policy.policy.egress
        parts.upstream.max_response_bytes = policy.policy.server.max_response_bytes


class Prices:
    """The policy's prices (the pipeline's :class:`Pricing`) over genai-prices' data."""

    keys: ClassVar = Keys(hot=("prices",))

    async def build(self, policy: PolicySet, parts: Parts, stack: AsyncExitStack) -> None:
        # The price table, off the event loop: loaded at the first priced call it would
        # hold every call in flight (a file read; the first time on a host without the
        # image's table, a child process reading genai-prices, ~0.5 s). The pipeline
        # builds the first Pricing. A policy that never prices a call (no usage dialect,
        # no budget) never loads it.
        if _prices_calls(policy):
            await asyncio.to_thread(cost.preload)

    async def prepare(self, policy: PolicySet, parts: Parts) -> None:
        """A reload that turns pricing on loads the price table before it is applied,
        off the event loop (a no-op once loaded)."""
        if _prices_calls(policy):
            await asyncio.to_thread(cost.preload)

    def apply(self, policy: PolicySet, parts: Parts) -> None:
        parts.pipeline.pricing = Pricing(policy.policy.prices)


def _prices_calls(policy: PolicySet) -> bool:
    """True when a call may need a model's price: a target reads usage, or a budget
    counts spend."""
    spec = policy.policy
    return bool(spec.budgets) or any(t.usage != "none" for t in spec.targets.values())


class Secrets:
    """The secret resolvers (the Vault login and token renewer with ``secrets.vault``)."""

    keys: ClassVar = Keys(restart=("secrets",))

    async def build(self, policy: PolicySet, parts: Parts, stack: AsyncExitStack) -> None:
        parts.resolvers = build_secret_resolvers(policy.policy)
        stack.push_async_callback(parts.resolvers.aclose)
        await start_secret_resolvers(parts.resolvers)

    def apply(self, policy: PolicySet, parts: Parts) -> None:
        return None


class Redis:
    """With a ``redis:`` section, the Redis client and the cluster-scope limits' owner.

    Built whenever configured (it connects lazily, at the first cluster-scope group or
    target), so that a reload turning on cluster scope works."""

    keys: ClassVar = Keys(restart=("redis",))

    async def build(self, policy: PolicySet, parts: Parts, stack: AsyncExitStack) -> None:
        parts.redis = parts.cluster_limits = None
        if policy.policy.redis is None:
            return
        from gateway.ratelimit.cluster import ClusterLimits
        from gateway.stores.redis import RedisClient

        parts.redis = RedisClient(policy.policy.redis)
        stack.push_async_callback(parts.redis.aclose)
        parts.cluster_limits = ClusterLimits(
            parts.redis, on_fallback=parts.metrics.observe_redis_fallback
        )
        stack.push_async_callback(parts.cluster_limits.aclose)

    def apply(self, policy: PolicySet, parts: Parts) -> None:
        return None


class Idempotency:
    """The idempotency stores: this process's memory (bounded by the server section) and,
    with Redis, the cluster store. A target's scope is read per call."""

    keys: ClassVar = Keys()

    async def build(self, policy: PolicySet, parts: Parts, stack: AsyncExitStack) -> None:
        server = policy.policy.server
        local = MemoryIdempotencyStore(
            max_entries=server.idempotency_max_entries, max_bytes=server.idempotency_max_bytes
        )
        cluster = None
        if parts.redis is not None:
            from gateway.idempotency.redis import RedisIdempotencyStore

            cluster = RedisIdempotencyStore(parts.redis)
        parts.idempotency = IdempotencyStores(local, cluster)
        stack.push_async_callback(parts.idempotency.aclose)

    def apply(self, policy: PolicySet, parts: Parts) -> None:
        return None


class Tracing:
    """OpenTelemetry spans (the no-op unless tracing is on); settings read at start."""

    keys: ClassVar = Keys(start_only=("telemetry",))

    async def build(self, policy: PolicySet, parts: Parts, stack: AsyncExitStack) -> None:
        parts.tracer = telemetry.start(policy.policy.telemetry, os.environ)
        stack.push_async_callback(parts.tracer.aclose)

    def apply(self, policy: PolicySet, parts: Parts) -> None:
        return None


class Groups:
    """The rate-limit groups: on reload unchanged groups keep their state."""

    keys: ClassVar = Keys(hot=("rate_limit_groups",))

    async def build(self, policy: PolicySet, parts: Parts, stack: AsyncExitStack) -> None:
        cluster = parts.cluster_limits
        parts.groups = RateLimitGroups(
            policy.policy.rate_limit_groups, cluster=cluster.group if cluster else None
        )

    def apply(self, policy: PolicySet, parts: Parts) -> None:
        parts.groups.update(policy.policy.rate_limit_groups)


class Breakers:
    """One circuit breaker per target that has one; a change of state is a metric and an
    audit event."""

    keys: ClassVar = Keys(hot=("targets",))

    async def build(self, policy: PolicySet, parts: Parts, stack: AsyncExitStack) -> None:
        parts.breakers = CircuitBreakers(breaker_specs(policy.policy.targets))
        metrics, log = parts.metrics, parts.audit

        def on_change(target: str, old: BreakerState, new: BreakerState) -> None:
            metrics.observe_breaker_transition(target, new)
            log.event("breaker_state_change", target_system=target, old_state=old, new_state=new)

        parts.breakers.on_state_change(on_change)

    def apply(self, policy: PolicySet, parts: Parts) -> None:
        parts.breakers.update(breaker_specs(policy.policy.targets))


class CostBudgets:
    """Cost budgets: local, or shared through Redis (``scope: cluster``) with a ``redis:``
    section. A budget keeps its spend across a reload."""

    keys: ClassVar = Keys(hot=("budgets",))

    async def build(self, policy: PolicySet, parts: Parts, stack: AsyncExitStack) -> None:
        cluster = None
        if parts.cluster_limits is not None:
            from gateway.budgets.cluster import ClusterBudgets

            cluster = ClusterBudgets(parts.cluster_limits)
        journal = None
        if path := os.environ.get("GATEWAY_BUDGET_JOURNAL"):  # the chart sets it
            from gateway.budgets.journal import BudgetJournal

            journal = BudgetJournal(path)
            stack.callback(journal.close)
        parts.budgets = Budgets(policy.policy.budgets, cluster=cluster, journal=journal)

    def apply(self, policy: PolicySet, parts: Parts) -> None:
        parts.budgets.update(policy.policy.budgets)


class AgentControls:
    """The stop switch (its shared state watched in Redis with ``stop_switch.scope:
    cluster``), the repeated-call breaker and the tool caps (budgets' ``max_calls``); the
    operator token is read per request."""

    keys: ClassVar = Keys(
        hot=(
            "controls.repeated_calls",
            "controls.repeat_exempt",
            "controls.operator_token_ref",
            "budgets",
        ),
        restart=("controls",),
    )

    async def build(self, policy: PolicySet, parts: Parts, stack: AsyncExitStack) -> None:
        spec, metrics = policy.policy.controls, parts.metrics

        def on_change(stops: Any) -> None:
            counts: dict[str, int] = {}
            for stop in stops.values():
                counts[stop.scope] = counts.get(stop.scope, 0) + 1
            metrics.set_agent_stops(counts)

        stops = StopSwitch(spec.stop_switch, redis=parts.redis, on_change=on_change)
        stack.push_async_callback(stops.aclose)
        await stops.start()
        repeats = RepeatedCalls(spec.repeated_calls, spec.repeat_exempt, redis=parts.redis)
        cluster = parts.budgets.cluster  # tool caps count on the budgets' ledger
        parts.controls = Controls(stops, repeats, CallCaps(policy.policy.budgets, cluster=cluster))

    def apply(self, policy: PolicySet, parts: Parts) -> None:
        spec = policy.policy.controls
        parts.controls.repeats.update(spec.repeated_calls, spec.repeat_exempt)
        parts.controls.caps.update(policy.policy.budgets)


class DatabaseTargets:
    """The engines of the database targets (:mod:`gateway.database.registry`): their
    pools opened and statements prepared at start, the leases revoked at close; a
    reload gives a changed ``database:`` section a new engine."""

    keys: ClassVar = Keys(hot=("targets",))

    async def build(self, policy: PolicySet, parts: Parts, stack: AsyncExitStack) -> None:
        parts.databases = Databases(parts.resolvers)
        stack.push_async_callback(parts.databases.aclose)
        parts.databases.apply(policy)
        await parts.databases.start()

    async def prepare(self, policy: PolicySet, parts: Parts) -> None:
        """Refuse a reload that adds a database target without the engine installed
        (ValueError), before any component takes the policy in."""
        if any(t.spec.database is not None for t in policy.targets.values()):
            engine_class()

    def apply(self, policy: PolicySet, parts: Parts) -> None:
        parts.databases.apply(policy)


class Calls:
    """The pipeline, handed the parts above; each call reads the policy it started with
    (targets, envelope rules, ``agent_id``, ``server.debug``, ``chain``...)."""

    keys: ClassVar = Keys(
        hot=("agent_id", "envelope", "targets", "server.debug", "chain", "inbound")
    )

    async def build(self, policy: PolicySet, parts: Parts, stack: AsyncExitStack) -> None:
        parts.pipeline = Pipeline(
            policy,
            resolvers=parts.resolvers,
            upstream=parts.upstream,
            audit=parts.audit,
            metrics=parts.metrics,
            groups=parts.groups,
            breakers=parts.breakers,
            idempotency=parts.idempotency,
            tracer=parts.tracer,
            budgets=parts.budgets,
            controls=parts.controls,
            databases=parts.databases,
        )

    def apply(self, policy: PolicySet, parts: Parts) -> None:
        parts.pipeline.apply_policy(policy)


class AgentIdentities:
    """Who may call (:mod:`gateway.agents.identity`): the policy's ``agents:`` with each
    token read through the secret resolvers, so a ``vault://`` token works too. Reading
    the tokens is I/O: a reload does it in :meth:`prepare`, before any component takes
    the policy in (a token unreadable or empty refuses the reload)."""

    keys: ClassVar = Keys(hot=("agents",))

    def __init__(self) -> None:
        self._ready: tuple[PolicySet, Agents] | None = None

    async def build(self, policy: PolicySet, parts: Parts, stack: AsyncExitStack) -> None:
        parts.agents = await resolve_agents(policy, parts.resolvers)

    async def prepare(self, policy: PolicySet, parts: Parts) -> None:
        """Read ``policy``'s agent tokens for :meth:`apply`. Raises SecretError or
        ValueError (an empty token)."""
        self._ready = (policy, await resolve_agents(policy, parts.resolvers))

    def apply(self, policy: PolicySet, parts: Parts) -> None:
        ready, self._ready = self._ready, None
        if ready is not None and ready[0] is policy:
            parts.agents = ready[1]
            return
        # Not prepared (Gateway.apply_policy called directly): no token was read, so an
        # agent known only by its token is recognised by none: refused, never a default.
        entries = ((n, a.uid, None, a.targets) for n, a in policy.policy.agents.items())
        parts.agents = build_agents(policy.policy.agent_id, entries)


class Desk:
    """The operator's desk, handed to the pipeline: approvals (this process's memory, or
    Redis with ``approvals.scope: cluster``) and dead letters (bounds hot on reload);
    ``operators`` are read by the ops routes on each request (gateway.server.desk)."""

    keys: ClassVar = Keys(hot=("operators", "dead_letters"), restart=("approvals",))

    async def build(self, policy: PolicySet, parts: Parts, stack: AsyncExitStack) -> None:
        store: ApprovalStore = MemoryApprovalStore()
        if policy.policy.approvals.scope == "cluster" and parts.redis is not None:
            from gateway.agents.approvals_redis import RedisApprovalStore

            store = RedisApprovalStore(parts.redis)
        approvals = Approvals(store, parts.audit, on_change=parts.metrics.observe_approval)
        stack.push_async_callback(approvals.aclose)
        bounds = policy.policy.dead_letters
        letters = DeadLetters(
            max_count=bounds.max_count,
            max_bytes=bounds.max_bytes,
            audit=parts.audit,
            on_kept=parts.metrics.observe_dead_letter,
            on_dropped=parts.metrics.observe_dead_letters_dropped,
        )
        parts.pipeline.approvals, parts.pipeline.dead_letters = approvals, letters

    def apply(self, policy: PolicySet, parts: Parts) -> None:
        bounds = policy.policy.dead_letters
        parts.pipeline.dead_letters.update(bounds.max_count, bounds.max_bytes)


class MetricLabels:
    """The metrics' known targets, groups, model names and ``policy_info``, and the
    audit and secret health they read at each scrape."""

    keys: ClassVar = Keys(hot=("telemetry.models", "agents"))

    async def build(self, policy: PolicySet, parts: Parts, stack: AsyncExitStack) -> None:
        self.apply(policy, parts)
        log, resolvers, budgets = parts.audit, parts.resolvers, parts.budgets
        parts.metrics.watch(
            audit_failures=lambda: log.write_failures,
            secrets_ready=lambda: secrets_ready(resolvers),
            budgets=budgets.levels,
            audit_shipping=lambda: log.shipping,
        )

    def apply(self, policy: PolicySet, parts: Parts) -> None:
        parts.metrics.set_known(
            policy.targets, policy.policy.rate_limit_groups, **policy_labels(policy)
        )


#: The one list, in start order (reload applies them in the same order). Classes: each
#: start builds fresh components (several sidecars may share a process).
COMPONENTS: Final[tuple[type[Component], ...]] = (
    Listeners,
    AuditSink,
    Outbound,
    Prices,
    Secrets,
    Redis,
    Idempotency,
    Tracing,
    Groups,
    Breakers,
    CostBudgets,
    AgentControls,
    DatabaseTargets,
    Calls,
    AgentIdentities,
    Desk,
    MetricLabels,
)


def policy_labels(policy: PolicySet) -> dict[str, Any]:
    """The metrics' model names, ``policy_info`` and agent names of ``policy`` (the digest
    is of its content, not its file: comments and key order do not change it)."""
    digest = hashlib.sha256(policy.policy.model_dump_json().encode()).hexdigest()[:16]
    return {
        "models": policy.policy.telemetry.models,
        "agent_id": policy.policy.agent_id,
        "digest": digest,
        "agents": tuple(policy.policy.agents),
    }
