"""Which idempotency store a target uses: by its ``idempotency.scope``."""

from __future__ import annotations

from gateway.idempotency.base import IdempotencyStore
from gateway.policy import Scope

__all__ = ["IdempotencyStores"]


class IdempotencyStores:
    """The stores by scope: ``local`` (this process's memory) and ``cluster`` (Redis).

    Without a cluster store (no ``redis:`` section, or a pipeline built for tests) a
    target with ``scope: cluster`` uses the local store. Owns both: :meth:`aclose`
    closes them.
    """

    def __init__(self, local: IdempotencyStore, cluster: IdempotencyStore | None = None) -> None:
        self.local = local
        self.cluster = cluster

    def for_scope(self, scope: Scope) -> IdempotencyStore:
        if scope == "cluster" and self.cluster is not None:
            return self.cluster
        return self.local

    async def aclose(self) -> None:
        """Close both stores (their waiters wake with None). Idempotent."""
        if self.cluster is not None:
            await self.cluster.aclose()
        await self.local.aclose()
