"""The chains that reached this sidecar's agent, remembered for the work they started
(design.md, "Agents calling agents"): an agent cannot reset its depth by leaving the
chain out of its own calls.

The inbound route (``/a2a/in/...``) remembers each admitted chain under the W3C trace
id of the request and the A2A task and context ids; a call of the agent that carries no
chain is given the one remembered for its trace (:func:`gateway.call.chain.chain_stage`),
and a request for a remembered task or context the one remembered for it. An entry
expires with the chain's deadline (recalled :data:`GRACE_MS` longer, so that stale work
is refused rather than started afresh); at most :data:`MAX_ENTRIES` are kept (the oldest go
first), so memory is bounded whatever callers send.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Final

from gateway.agents.chain import ChainDecision

MAX_ENTRIES: Final = 10_000
#: How long past its deadline a chain is still recalled (so that stale work in its trace
#: is refused ``ttl_expired``, not given a fresh chain), milliseconds.
GRACE_MS: Final = 60_000


class ChainMemory:
    """Chains by key (``("trace", id)``, ``("task", id)``, ``("context", id)``): each the
    chain's headers (:meth:`ChainDecision.headers`) and its deadline (Unix ms)."""

    def __init__(self, limit: int = MAX_ENTRIES) -> None:
        self._entries: OrderedDict[tuple[str, str], tuple[dict[str, str], int]] = OrderedDict()
        self._limit = limit

    def __len__(self) -> int:
        return len(self._entries)

    def remember(self, keys: Iterable[tuple[str, str | None]], decision: ChainDecision) -> None:
        """Keep ``decision``'s chain under each key whose id is not None (none for a
        call that carried no chain)."""
        headers = decision.headers()
        if not headers or decision.deadline_ms is None:
            return
        for kind, ident in keys:
            if ident:
                key = (kind, ident[:256])
                self._entries.pop(key, None)
                self._entries[key] = (headers, decision.deadline_ms)
        while len(self._entries) > self._limit:
            self._entries.popitem(last=False)

    def recall(
        self, keys: Iterable[tuple[str, str | None]], now_ms: int | None = None
    ) -> dict[str, str] | None:
        """The chain headers remembered under the first of ``keys`` that has one."""
        now = int(time.time() * 1000) if now_ms is None else now_ms
        for kind, ident in keys:
            if not ident:
                continue
            entry = self._entries.get((kind, ident[:256]))
            if entry is None:
                continue
            if entry[1] + GRACE_MS <= now:
                del self._entries[(kind, ident[:256])]
                continue
            return dict(entry[0])
        return None
