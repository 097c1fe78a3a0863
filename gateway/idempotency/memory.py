"""The in-memory idempotency store (one process; ``idempotency.scope: local``).

Bounds (checkable with :attr:`MemoryIdempotencyStore.entries` and ``.size_bytes``): at most
``max_entries`` keys and at most ``max_bytes`` bytes, counting each entry's key,
fingerprint and stored answer. When a new entry or a completed answer would exceed a
bound, completed entries are evicted least recently used first (a replay counts as a
use). Entries in flight are never evicted: if they alone fill ``max_entries``,
``begin`` raises :class:`CapacityExceeded`. An answer larger than ``max_bytes`` is
handed to the waiters but not stored.

Expiry: a completed entry lives ``ttl_s`` after completion (policy
``targets.<name>.idempotency.ttl_s``); an entry in flight lives ``lease_s`` after
``begin``, so a lost owner blocks its key for at most its lease. Evicted or expired
keys behave as new: the next call with that key goes upstream again.

Concurrency: the methods do not await between reading and writing the table, so on one
event loop each is atomic; concurrent ``begin`` calls on a fresh key yield exactly one
:class:`Proceed`.

Memory: besides the bytes counted above, an entry costs about 600 bytes of bookkeeping
(its slots, the two tables, one expiry item). Expiry items hold the key and the expiry
time, not the entry: an item left behind by an eviction keeps no answer alive while it
waits for the heap's next rebuild.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final, TypeAlias

from gateway.errors import CapacityExceeded
from gateway.idempotency.base import Conflict, InFlight, Outcome, Proceed, Replay
from gateway.policy.models import DEFAULT_IDEMPOTENCY_MAX_BYTES, DEFAULT_IDEMPOTENCY_MAX_ENTRIES

__all__ = ["DEFAULT_MAX_BYTES", "DEFAULT_MAX_ENTRIES", "MemoryIdempotencyStore"]

#: The policy's defaults (``server.idempotency_max_entries`` / ``_max_bytes``).
DEFAULT_MAX_ENTRIES: Final = DEFAULT_IDEMPOTENCY_MAX_ENTRIES
DEFAULT_MAX_BYTES: Final = DEFAULT_IDEMPOTENCY_MAX_BYTES


@dataclass(eq=False, slots=True)
class _Entry:
    fingerprint: str
    token: str | None  # the owner's while in flight; None once completed
    expires_at: float
    answer: bytes = b""  # meaningful once token is None
    # Created by the first waiter only: most entries are never waited on, and 10,000
    # idle Events (each with a deque) would double what the cyclic GC walks.
    waiters: asyncio.Event | None = None


#: (expires_at, key): live while the key's entry still expires at that instant.
_Expiry: TypeAlias = tuple[float, str]


def _size(key: str, entry: _Entry) -> int:
    """What an entry counts against ``max_bytes``: key (UTF-8), fingerprint, answer."""
    key_bytes = len(key) if key.isascii() else len(key.encode())
    return key_bytes + len(entry.fingerprint) + len(entry.answer)


class MemoryIdempotencyStore:
    """Implements :class:`gateway.idempotency.base.IdempotencyStore` in process memory."""

    def __init__(
        self, *, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("max_entries and max_bytes must be >= 1")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: dict[str, _Entry] = {}
        # Completed entries only, least recently used first: eviction pops the front in
        # O(1) instead of walking past the entries in flight.
        self._done: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0
        self._expiry: list[_Expiry] = []  # a heap; stale items skipped
        self._tokens = itertools.count(1)

    @property
    def entries(self) -> int:
        return len(self._entries)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    async def begin(self, key: str, fingerprint: str, *, lease_s: float) -> Outcome:
        self._expire()
        entry = self._entries.get(key)
        if entry is not None:
            if entry.fingerprint != fingerprint:
                return Conflict()
            if entry.token is None:
                self._done.move_to_end(key)
                return Replay(entry.answer)
            return InFlight()
        entry = _Entry(fingerprint, None, time.monotonic() + lease_s)
        self._evict(extra_entries=1, extra_bytes=_size(key, entry))
        if len(self._entries) >= self.max_entries:
            raise CapacityExceeded(
                f"the idempotency store holds {len(self._entries)} calls in flight, its "
                "limit; retry when some have finished",
                details={"reason": "idempotency_store_full"},
            )
        # The owner's token only has to differ from every other owner's in this process
        # (it never leaves it): a counter, not a random value from a system call.
        entry.token = token = f"m{next(self._tokens)}"
        self._insert(key, entry)
        return Proceed(token)

    async def complete(self, key: str, token: str, answer: bytes, *, ttl_s: float) -> bool:
        self._expire()
        entry = self._entries.get(key)
        if entry is None or entry.token != token:
            return False
        self._remove(key, entry)
        entry.answer = answer
        entry.token = None
        _wake(entry)
        size = _size(key, entry)
        if size > self.max_bytes:
            return False
        entry.expires_at = time.monotonic() + ttl_s
        self._evict(extra_entries=1, extra_bytes=size)
        self._insert(key, entry)
        return True

    async def abandon(self, key: str, token: str) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry.token == token:
            self._remove(key, entry)
            _wake(entry)

    async def wait(self, key: str, fingerprint: str, *, deadline: float) -> bytes | None:
        self._expire()
        entry = self._entries.get(key)
        if entry is None or entry.fingerprint != fingerprint:
            return None
        if entry.token is not None:
            remaining = min(
                deadline - asyncio.get_running_loop().time(),
                entry.expires_at - time.monotonic(),
            )
            if remaining <= 0:
                return None
            try:
                async with asyncio.timeout(remaining):
                    if entry.waiters is None:
                        entry.waiters = asyncio.Event()
                    await entry.waiters.wait()
            except TimeoutError:
                return None
        # Woken by complete (token cleared), or by abandon/expiry (token kept).
        return entry.answer if entry.token is None else None

    async def aclose(self) -> None:
        for entry in self._entries.values():
            _wake(entry)
        self._entries.clear()
        self._done.clear()
        self._expiry.clear()
        self._bytes = 0

    # --- internals ------------------------------------------------------------------

    def _insert(self, key: str, entry: _Entry) -> None:
        self._entries[key] = entry
        if entry.token is None:
            self._done[key] = entry
        self._bytes += _size(key, entry)
        heapq.heappush(self._expiry, (entry.expires_at, key))
        if len(self._expiry) > len(self._entries) + len(self._entries) // 4 + 64:
            # Evicted and completed entries leave stale heap items until their old
            # expiry (two per call once the store is full); rebuild so the heap stays
            # proportional to the table. At a quarter over, a rebuild every L/8 calls
            # costs ~0.3 us per call and holds ~1 MiB fewer stale items (and evicted
            # keys) at 10,000 entries than at twice the table.
            # _live() inlined: this walks the whole heap, in the middle of one call.
            entries = self._entries
            self._expiry = [
                item
                for item in self._expiry
                if (e := entries.get(item[1])) is not None and e.expires_at == item[0]
            ]
            heapq.heapify(self._expiry)

    def _live(self, item: _Expiry) -> _Entry | None:
        """The entry ``item`` stands for, or None if the item is stale (the key's entry
        was removed, or now expires at another instant: completed after its lease, or a
        new entry under the same key; a new entry expiring at the very same instant is
        due then anyway)."""
        at, key = item
        entry = self._entries.get(key)
        return entry if entry is not None and entry.expires_at == at else None

    def _remove(self, key: str, entry: _Entry) -> None:
        if self._entries.get(key) is entry:
            del self._entries[key]
            self._done.pop(key, None)
            self._bytes -= _size(key, entry)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._expiry and self._expiry[0][0] <= now:
            item = heapq.heappop(self._expiry)
            entry = self._live(item)
            if entry is not None:
                self._remove(item[1], entry)
                _wake(entry)  # waiters on a lost owner wake up and may take over

    def _evict(self, *, extra_entries: int, extra_bytes: int) -> None:
        """Drop least recently used completed entries until the extra fits (if it can)."""
        max_entries, max_bytes = self.max_entries - extra_entries, self.max_bytes - extra_bytes
        while self._done and (len(self._entries) > max_entries or self._bytes > max_bytes):
            key, entry = self._done.popitem(last=False)
            self._remove(key, entry)


def _wake(entry: _Entry) -> None:
    event, entry.waiters = entry.waiters, None  # the waiters hold it; the entry need not
    if event is not None:
        event.set()
