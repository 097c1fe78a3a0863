"""The sidecar's resources and their lifecycle, independent of HTTP routing.

:class:`Gateway` owns what the components of :mod:`gateway.server.components` build
from the policy (the outbound client, the secret resolvers, the audit log, the pipeline
...), and knows whether the sidecar is ready and whether it is draining. The components
are built in list order in :meth:`Gateway.start`, take in a new policy in
:meth:`Gateway.reload`, and their resources are closed in reverse order by
:meth:`Gateway.aclose` (idempotent).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import IO, TYPE_CHECKING, Any

from gateway import audit
from gateway.agents.identity import Agents, Identity
from gateway.audit.schema import POLICY_RELOAD_EVENT, POLICY_START_EVENT, Fields
from gateway.call.a2a import A2aRequest, CardFetch, TaskClock
from gateway.call.mcp import McpRequest
from gateway.call.pipeline import Pipeline
from gateway.call.proxy import ProxyRequest
from gateway.call.record import CallContext, refusal_record
from gateway.call.relay import Relay
from gateway.envelope import ExternalCallResponse
from gateway.errors import GatewayError, PermissionDenied, ShuttingDown, error_response
from gateway.metrics import Metrics
from gateway.policy import PolicyError, PolicySet, load_policy
from gateway.policy.refs import parse_ref
from gateway.secrets.factory import secrets_ready
from gateway.server.components import COMPONENTS, policy_labels
from gateway.server.parts import Component, Parts, restart_needed
from gateway.server.reload import applied_fields, refused_fields
from gateway.upstream import Resolver

if TYPE_CHECKING:
    from gateway.ratelimit.cluster import ClusterLimits
    from gateway.stores.redis import RedisClient

_log = audit.get_logger("gateway.runtime")


def _server_hot_only(old: PolicySet, new: PolicySet) -> bool:
    """True if only the server keys that apply without a restart changed."""
    return "server" not in restart_needed(old, new, COMPONENTS)


def _refusal() -> ShuttingDown:
    return ShuttingDown(
        "the sidecar is shutting down and accepts no new calls; retry shortly "
        "(another replica, or this one after its restart)",
        retry_after_s=1.0,
    )


class Gateway:
    """Everything a running sidecar holds. One per process (tests may run several)."""

    def __init__(
        self,
        policy: PolicySet,
        *,
        resolver: Resolver | None = None,
        log_stream: IO[str] | None = None,
        components: Sequence[type[Component]] = COMPONENTS,
    ) -> None:
        """``components``: the parts to build, in order (default: the sidecar's list)."""
        self.policy = policy
        self._component_types = tuple(components)
        #: The components built by start() and what they built (None until then).
        self._components: list[Component] = []
        self._parts: Parts | None = None
        self._dns_resolver = resolver
        self._log_stream = log_stream
        self.pipeline: Pipeline | None = None
        self.audit: audit.AuditLog | None = None
        #: What start() opened, closed by aclose() in reverse order.
        self._resources: contextlib.AsyncExitStack | None = None
        #: The Redis client and the cluster-scope groups' owner, with a ``redis:`` section.
        self.redis: RedisClient | None = None
        self.cluster_limits: ClusterLimits | None = None
        self.metrics = Metrics()
        #: Set at SIGTERM (:meth:`begin_drain`): readiness is false from then on.
        self.draining = False
        #: While draining: new calls are still served (``server.shutdown.accept_new_calls``).
        self._admitting = False
        #: Calls admitted after draining began (logged when the drain ends).
        self.served_while_draining = 0
        #: time.monotonic() of the last change in the calls in flight (or of SIGTERM).
        self._last_activity = 0.0
        self._tasks: set[asyncio.Task[Any]] = set()
        # The in-flight gauge is read from the calls' set when scraped, not kept by an
        # increment and a decrement per call (each takes the metric's lock).
        self.metrics.inflight.set_function(self._tasks.__len__)
        self._idle = asyncio.Event()
        self._idle.set()
        #: When each A2A task was first seen (a2a.task_ttl_s), and the agents' cards
        #: checked (target -> monotonic expiry), so that a verified card is not fetched
        #: per request; both bounded, and gone with this runtime.
        self.a2a_tasks = TaskClock()
        self._cards: dict[str, float] = {}

    async def start(self) -> None:
        """Build every component of the list (:mod:`gateway.server.components`), in
        order: the log and audit sinks, the outbound client, the secret resolvers (Vault
        login and token renewer), the Redis client and cluster limits (with a ``redis:``
        section), the idempotency stores, telemetry, the groups, breakers and budgets;
        then the pipeline.

        A start that fails part-way closes what it had opened, in reverse order, and
        re-raises (ValueError for an unusable ``secrets.vault`` section, for example).
        """
        built: list[Component] = [make() for make in self._component_types]
        parts = Parts(self.metrics, dns_resolver=self._dns_resolver, log_stream=self._log_stream)
        async with contextlib.AsyncExitStack() as stack:
            for component in built:
                await component.build(self.policy, parts, stack)
            self._resources = stack.pop_all()
        self._components, self._parts = built, parts
        self.audit, self.redis, self.cluster_limits = parts.audit, parts.redis, parts.cluster_limits
        self.pipeline = parts.pipeline
        self.audit.event(
            POLICY_START_EVENT,
            policy=self.policy.source,
            policy_sha256=self.policy.sha256,
            targets=sorted(self.policy.targets),
            agents=sorted(self.policy.policy.agents),
        )
        _log.info(
            "sidecar_started",
            policy=self.policy.source,
            policy_sha256=self.policy.sha256[:16],  # for a person; records carry it whole
            targets=sorted(self.policy.targets),
            agent_id=self.policy.policy.agent_id,
        )

    def apply_policy(self, policy: PolicySet) -> None:
        """Swap ``policy`` in whole (what a reload does once the file parses): every
        component takes it in, in list order, synchronously, so that no call starts under
        half of it; calls already running keep the one they started with."""
        self.policy = policy
        if self._parts is not None:
            for component in self._components:
                component.apply(policy, self._parts)

    async def reload(self, path: str | None = None) -> bool:
        """Load the policy file again and swap it in whole. False (old policy kept) if invalid.

        Calls in flight finish under the policy they started with. The keys a component
        reads at start only (listener settings ``server.host``, ``port``, ``ops_*``,
        ``max_request_bytes``; ``secrets``; ``redis``) need a restart; a reload that
        changes them says so in the log (:func:`~gateway.server.parts.restart_needed`).
        What a component must read before it can take the policy in (the agents' tokens:
        ``prepare``) is read first; a failure there refuses the reload too. Applied or
        refused, the reload is an audit record of its own (``policy_reload``).
        """
        source = path or self.policy.source
        try:
            new = await asyncio.to_thread(load_policy, source)
            await self._prepare(new)
        except PolicyError as exc:
            return await self._reload_refused(source, exc.problems)
        except (GatewayError, ValueError) as exc:  # an agent token unreadable or empty
            return await self._reload_refused(source, [f"{source}: agents: {exc}"])
        old = self.policy
        needed = restart_needed(old, new, self._component_types)
        self.apply_policy(new)
        if self._parts is None:  # not started: the labels are set at start
            self.metrics.set_known(new.targets, new.policy.rate_limit_groups, **policy_labels(new))
        self.metrics.observe_policy_reload(ok=True)
        if self.audit is not None:
            self.audit.event(POLICY_RELOAD_EVENT, **applied_fields(old, new, needed))
        return True

    async def _prepare(self, policy: PolicySet) -> None:
        """Let each component that has a ``prepare`` read what it needs for ``policy``."""
        if self._parts is None:
            return
        for component in self._components:
            prepare = getattr(component, "prepare", None)
            if prepare is not None:
                await prepare(policy, self._parts)

    async def _reload_refused(self, source: str, problems: list[str]) -> bool:
        self.metrics.observe_policy_reload(ok=False)
        _log.error(
            "policy_reload_refused",
            policy=source,
            problems=problems,
            note="the previous policy stays in force",
        )
        if self.audit is not None:
            fields = await asyncio.to_thread(refused_fields, source, problems, self.policy)
            self.audit.event(POLICY_RELOAD_EVENT, **fields)
        return False

    @property
    def agents(self) -> Agents:
        """Who may call (the policy's ``agents:``, tokens read): before start, none."""
        parts = self._parts
        return parts.agents if parts is not None else Agents(self.policy.policy.agent_id)

    def rendered_answer(self, response: ExternalCallResponse) -> bytes | None:
        """The JSON bytes the pipeline stored for ``response``'s idempotency key, if it
        is the answer just stored (taken once), else None: the answer is then written
        with the same bytes, not serialised a second time."""
        pipeline = self.pipeline
        return pipeline.rendered.take(response) if pipeline is not None else None

    async def aclose(self) -> None:
        """Close every resource :meth:`start` opened, in reverse order; a part that fails
        to close does not keep the others open (its error is raised after). Idempotent."""
        resources, self._resources = self._resources, None
        self.pipeline, self._parts, self._components = None, None, []
        if resources is not None:
            await resources.aclose()

    def ready(self) -> tuple[bool, dict[str, object]]:
        """Readiness and why: policy loaded, not draining. ``checks["secrets"]`` (the
        secret store usable: a valid Vault token when Vault is configured) and
        ``checks["redis"]`` (with a ``redis:`` section: the last Redis operation's
        outcome, "unused", "ok" or "unavailable") are reported, never gating: every
        sidecar shares the one Vault and the one Redis, so gating on them would take
        every agent pod out of its Services at once in an outage, and calls answer for an
        outage themselves (cached secrets still serve; SECRET_NOT_FOUND or a retryable
        DEPENDENCY_FAILED otherwise; fail-open groups fall back, the others refuse,
        retryable). The ``egress_gateway_secrets_ready`` metric and its alert say it."""
        pipeline = self.pipeline
        checks: dict[str, object] = {
            "policy_loaded": pipeline is not None,
            "draining": self.draining,
            "secrets": pipeline is not None and secrets_ready(pipeline.resolvers),
        }
        if self.redis is not None:
            checks["redis"] = self.redis.state
        return pipeline is not None and not self.draining, checks

    async def call(
        self, body: bytes, *, relay: Relay | None = None, identity: Identity | None = None
    ) -> tuple[int, ExternalCallResponse]:
        """Run one call (see :meth:`Pipeline.handle`) in the current task, tracked as in
        flight so that :meth:`drain` can wait for it and, past the drain time, cancel it.

        The server runs each call in its request handler's task, which aiohttp does not
        cancel when the agent hangs up (``handler_cancellation`` off), so a call the
        agent gave up on still finishes, is audited and settles its idempotency key.
        Once draining has begun a call is answered SHUTTING_DOWN (audited), unless
        :meth:`begin_drain` was told to accept new calls and the drain has not ended.
        Raises :class:`ShuttingDown` before :meth:`start` or after :meth:`aclose`.
        With ``relay``, a 2xx event stream is relayed to it as it arrives. ``identity``:
        who called (:func:`gateway.agents.identity.identify`); its refusal, if any, is
        the answer (audited).
        """
        # _tracked's steps written out: one coroutine frame less around every call (each
        # frame is resumed at each of the call's awaits), for the most frequent route.
        pipeline = self.pipeline
        if pipeline is None:
            raise _refusal()
        refuse = identity.refusal if identity is not None else None
        if not self._admit():
            return await pipeline.handle(
                body, refuse=refuse or _refusal(), relay=None, identity=identity
            )
        task = self._enter()
        try:
            return await pipeline.handle(body, refuse=refuse, relay=relay, identity=identity)
        finally:
            self._forget(task)

    async def proxy(
        self,
        http: ProxyRequest,
        *,
        ctx: CallContext,
        refuse: GatewayError | None = None,
        relay: Relay | None = None,
    ) -> tuple[int, ExternalCallResponse]:
        """Run one drop-in provider call (:meth:`Pipeline.handle_proxy`), tracked and
        refused while draining exactly as :meth:`call`."""
        pipeline = self.pipeline  # _tracked's steps written out, as in call()
        if pipeline is None:
            raise _refusal()
        if not self._admit():
            return await pipeline.handle_proxy(http, ctx=ctx, refuse=refuse or _refusal())
        task = self._enter()
        try:
            return await pipeline.handle_proxy(http, ctx=ctx, refuse=refuse, relay=relay)
        finally:
            self._forget(task)

    async def mcp(
        self,
        http: McpRequest,
        *,
        ctx: CallContext,
        refuse: GatewayError | None = None,
        relay: Relay | None = None,
    ) -> tuple[int, ExternalCallResponse]:
        """Run one request of ``/mcp/{target}`` (:meth:`Pipeline.handle_mcp`), tracked and
        refused while draining exactly as :meth:`call`."""
        return await self._tracked(
            lambda pipeline, refuse, relay: pipeline.handle_mcp(
                http, ctx=ctx, refuse=refuse, relay=relay
            ),
            refuse,
            relay,
        )

    async def a2a(
        self,
        http: A2aRequest,
        *,
        ctx: CallContext,
        refuse: GatewayError | None = None,
        relay: Relay | None = None,
    ) -> tuple[int, ExternalCallResponse]:
        """Run one request of ``/a2a/{target}`` (:meth:`Pipeline.handle_a2a`), tracked and
        refused while draining exactly as :meth:`call`. Under ``a2a.card.verify`` the
        card's public key is resolved first, and a JSON-RPC request waits for a verified
        card: fetched (its own call, audited) when none was checked within
        ``a2a.card.ttl_s``; a card that fails refuses the request (nothing forwarded)."""
        target = self.policy.targets.get(http.target)
        spec = target.spec.a2a if target is not None else None
        key = None
        if refuse is None and spec is not None and spec.card.verify and not http.inbound:
            key, refuse = spec.card.public_key, None
            if key is None:
                key, refuse = await self._card_key(spec.card.public_key_ref)
            if refuse is None and not http.card and not self._card_fresh(http.target):
                refuse = await self._fetch_card(http, key)

        async def run(
            pipeline: Pipeline, refuse: GatewayError | None, relay: Relay | None
        ) -> tuple[int, ExternalCallResponse]:
            return await pipeline.handle_a2a(
                http, ctx=ctx, tasks=self.a2a_tasks, refuse=refuse, relay=relay, card_key=key
            )

        status, response = await self._tracked(run, refuse, relay)
        if isinstance(ctx.a2a, CardFetch) and ctx.a2a.card is not None and spec is not None:
            self._card_checked(http.target, spec.card.ttl_s)
        return status, response

    async def _card_key(self, ref: str | None) -> tuple[str | None, GatewayError | None]:
        """The card's public key (a secret reference, resolved as any), or the error."""
        pipeline = self.pipeline
        if pipeline is None or ref is None:
            return None, None
        try:
            resolved = await pipeline.resolvers.resolve(parse_ref(ref))
        except GatewayError as exc:
            return None, exc
        return resolved.secret.reveal(), None

    def _card_fresh(self, target: str) -> bool:
        return self._cards.get(target, 0.0) > time.monotonic()

    def _card_checked(self, target: str, ttl_s: float) -> None:
        if len(self._cards) >= len(self.policy.targets) + 1:
            self._cards.clear()  # targets renamed by reloads: bounded by the policy's
        self._cards[target] = time.monotonic() + ttl_s

    async def _fetch_card(self, http: A2aRequest, key: str | None) -> GatewayError | None:
        """Fetch and check the card of ``http``'s target (its own call and audit record):
        None when it passed, else the error that refuses ``http``."""
        pipeline = self.pipeline
        if pipeline is None:
            return None
        fetch = A2aRequest("GET", http.target, "/.well-known/agent-card.json", http.headers, b"")
        ctx = CallContext(time.monotonic(), self.policy.policy.agent_id)
        _, response = await self._tracked(
            lambda p, r, _: p.handle_a2a(fetch, ctx=ctx, tasks=self.a2a_tasks, refuse=r,
                                         card_key=key),
            None,
            None,
        )  # fmt: skip
        if response.error is None and isinstance(ctx.a2a, CardFetch) and ctx.a2a.card:
            spec = self.policy.targets[http.target].spec.a2a
            self._card_checked(http.target, spec.card.ttl_s if spec else 0.0)
            return None
        error = response.error
        message = error.message if error is not None else "the card could not be read"
        details = dict(error.details) if error is not None else {"reason": "card_invalid"}
        return PermissionDenied(f"the agent's card was refused: {message}", details=details)

    async def _tracked(
        self,
        run: Callable[
            [Pipeline, GatewayError | None, Relay | None],
            Awaitable[tuple[int, ExternalCallResponse]],
        ],
        refuse: GatewayError | None,
        relay: Relay | None,
    ) -> tuple[int, ExternalCallResponse]:
        """Run one call of any route through the pipeline: refused (and audited by it)
        while draining, else tracked until it ends, so that a drain waits for it."""
        pipeline = self.pipeline
        if pipeline is None:
            raise _refusal()
        if not self._admit():
            return await run(pipeline, refuse or _refusal(), None)
        task = self._enter()
        try:
            return await run(pipeline, refuse, relay)
        finally:
            self._forget(task)

    def refused_early(
        self,
        exc: GatewayError,
        *,
        started: float,
        http_method: str,
        http_path: str,
        api: str = "envelope",
        audited: bool = True,
        identity: Identity | None = None,
        ids: tuple[str, str] | None = None,
    ) -> ExternalCallResponse:
        """The answer to a request refused before the pipeline (which audits its own
        answers): ``exc`` as an ExternalCallResponse, and with ``audited`` its one audit
        record (:func:`gateway.call.record.refusal_record`, ``api`` the route's,
        ``identity`` who called when established); ``ids`` (trace_id, correlation_id),
        when given, are the answer's and the record's."""
        trace_id, correlation_id = ids if ids is not None else (None, None)
        response = error_response(
            exc,
            latency_ms=(time.monotonic() - started) * 1000,
            trace_id=trace_id,
            correlation_id=correlation_id,
        )
        if audited and self.audit is not None:
            record = refusal_record(
                self.policy.policy.agent_id,
                response,
                http_method=http_method,
                http_path=http_path,
                http_status=exc.http_status,
                identity=identity,
                policy_sha256=self.policy.sha256,
            )
            record[Fields.API] = api
            self.audit.call(record)
        return response

    def _admit(self) -> bool:
        """False when a new call is to be refused because the sidecar is draining."""
        if self.draining:
            if not self._admitting:
                return False
            self.served_while_draining += 1
        return True

    def _enter(self) -> asyncio.Task[Any]:
        task = asyncio.current_task()
        if task is None:  # pragma: no cover - always called from a task
            raise RuntimeError("Gateway.call must run in an asyncio task")
        self._tasks.add(task)
        self._idle.clear()
        self._last_activity = time.monotonic()
        return task

    def _forget(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not self._tasks:
            self._last_activity = time.monotonic()
            self._idle.set()

    @property
    def inflight(self) -> int:
        return len(self._tasks)

    def begin_drain(self, *, accept_new_calls: bool = False) -> None:
        """Start draining now (synchronous, so that a signal handler can call it):
        readiness turns false at once; new calls are served with ``accept_new_calls``,
        refused with SHUTTING_DOWN otherwise. Only the first call has an effect."""
        if self.draining:
            return
        self.draining = True
        self._admitting = accept_new_calls
        self._last_activity = time.monotonic()

    async def drain(
        self, timeout_s: float, *, accept_new_calls: bool = False, quiet_s: float = 0.0
    ) -> int:
        """Drain (see :meth:`begin_drain`, unless it was called already) and return once
        nothing is in flight, or after ``timeout_s`` seconds, whichever comes first; then
        cancel the calls still running (they answer SHUTTING_DOWN, or OUTCOME_UNKNOWN if
        a non-idempotent request was already with the upstream; each is audited).

        When new calls are accepted, "nothing in flight" must also have lasted
        ``quiet_s`` seconds since the last call ended (or since draining began), so
        that an agent stopping at the same moment can still send its last calls. Once
        this returns every new call is refused. Returns how many calls were cancelled.
        """
        self.begin_drain(accept_new_calls=accept_new_calls)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
                while self._admitting:
                    # The quiet period restarts whenever a call starts or the last ends.
                    quiet_left = self._last_activity + quiet_s - time.monotonic()
                    if quiet_left <= 0 and self._idle.is_set():
                        break
                    if quiet_left > 0:
                        await asyncio.sleep(quiet_left)
                    await self._idle.wait()
        self._admitting = False  # the listeners close next: refuse what still arrives
        left = list(self._tasks)
        if left and self.pipeline is not None:
            self.pipeline.aborting = True
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)
        return len(left)
