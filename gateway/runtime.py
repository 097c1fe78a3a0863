"""The sidecar's resources and their lifecycle, independent of HTTP routing.

:class:`Gateway` owns the outbound client, the secret resolvers, the audit log and the
pipeline, and knows whether the sidecar is ready and whether it is draining. Resources
are created in :meth:`Gateway.start` and closed in reverse order by :meth:`Gateway.aclose`
(idempotent).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import IO

from aiohttp.abc import AbstractResolver

from gateway import audit
from gateway.envelope import ExternalCallResponse
from gateway.errors import ShuttingDown
from gateway.metrics import Metrics
from gateway.pipeline import Pipeline
from gateway.policy import PolicySet
from gateway.secrets import SecretResolvers
from gateway.secrets.env import EnvResolver
from gateway.secrets.file import FileResolver
from gateway.upstream import Upstream

_log = audit.get_logger("gateway.runtime")


def build_resolvers(policy: PolicySet) -> SecretResolvers:
    """Resolvers for every scheme the policy can use."""
    return SecretResolvers({"env": EnvResolver(), "file": FileResolver()})


class Gateway:
    """Everything a running sidecar holds. One per process (tests may run several)."""

    def __init__(
        self,
        policy: PolicySet,
        *,
        resolver: AbstractResolver | None = None,
        log_stream: IO[str] | None = None,
    ) -> None:
        self.policy = policy
        self._dns_resolver = resolver
        self._log_stream = log_stream
        self.pipeline: Pipeline | None = None
        self.metrics = Metrics()
        self.draining = False
        self._tasks: set[asyncio.Task[tuple[int, ExternalCallResponse]]] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    async def start(self) -> None:
        audit.configure(self._log_stream)
        server = self.policy.policy.server
        upstream = Upstream(
            self.policy.policy.egress,
            max_response_bytes=server.max_response_bytes,
            resolver=self._dns_resolver,
        )
        await upstream.start()
        resolvers = build_resolvers(self.policy)
        self.pipeline = Pipeline(
            self.policy,
            resolvers=resolvers,
            upstream=upstream,
            audit=audit.AuditLog(self.policy.policy.agent_id),
            metrics=self.metrics,
        )
        self.metrics.set_known(self.policy.targets, self.policy.policy.rate_limit_groups)
        _log.info(
            "sidecar_started",
            policy=self.policy.source,
            targets=sorted(self.policy.targets),
            agent_id=self.policy.policy.agent_id,
        )

    async def aclose(self) -> None:
        pipeline, self.pipeline = self.pipeline, None
        if pipeline is None:
            return
        await pipeline.resolvers.aclose()
        await pipeline.upstream.aclose()

    def ready(self) -> tuple[bool, dict[str, object]]:
        """Readiness and why: policy loaded, not draining."""
        checks: dict[str, object] = {
            "policy_loaded": self.pipeline is not None,
            "draining": self.draining,
        }
        return self.pipeline is not None and not self.draining, checks

    async def call(self, body: bytes) -> tuple[int, ExternalCallResponse]:
        """Run one call (see :meth:`Pipeline.handle`), tracked as in flight.

        Raises :class:`ShuttingDown` once draining has begun.
        """
        if self.pipeline is None or self.draining:
            raise ShuttingDown(
                "the sidecar is shutting down and accepts no new calls; retry shortly "
                "(another replica, or this one after its restart)",
                retry_after_s=1.0,
            )
        task = asyncio.create_task(self._tracked(self.pipeline, body), name="egress-call")
        self._tasks.add(task)
        self._idle.clear()
        try:
            # Shielded: an agent hanging up must not cancel the call half-way.
            return await asyncio.shield(task)
        finally:
            if task.done():
                self._forget(task)
            else:
                task.add_done_callback(self._forget)

    async def _tracked(self, pipeline: Pipeline, body: bytes) -> tuple[int, ExternalCallResponse]:
        with self.metrics.track_inflight():
            return await pipeline.handle(body)

    def _forget(self, task: asyncio.Task[tuple[int, ExternalCallResponse]]) -> None:
        self._tasks.discard(task)
        if not self._tasks:
            self._idle.set()

    @property
    def inflight(self) -> int:
        return len(self._tasks)

    async def drain(self, timeout_s: float) -> int:
        """Stop taking calls, wait up to ``timeout_s`` for those in flight, then cancel the
        rest (they answer SHUTTING_DOWN, or OUTCOME_UNKNOWN if a non-idempotent request
        was already with the upstream). Returns how many were cancelled."""
        self.draining = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        left = list(self._tasks)
        if left and self.pipeline is not None:
            self.pipeline.aborting = True
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)
        return len(left)
