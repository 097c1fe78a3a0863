"""The in-memory idempotency store (one process; ``idempotency.scope: local``).

Bounds (checkable with :attr:`MemoryIdempotencyStore.entries` and ``.size_bytes``): at most
``max_entries`` keys and at most ``max_bytes`` bytes, counting each entry's key,
fingerprint and stored answer. When a new entry or a completed answer would exceed a
bound, completed entries are evicted closest to their expiry first: expired ones before
any live one, then those with the least time left (a replay does not extend an answer's
life, as with Stripe's keys). Entries in flight are never evicted: if they alone fill
``max_entries``, ``begin`` raises :class:`CapacityExceeded`. An answer larger than
``max_bytes`` is handed to the waiters but not stored.

Expiry: a completed entry lives ``ttl_s`` after completion (policy
``targets.<name>.idempotency.ttl_s``); an entry in flight lives ``lease_s`` after
``begin``, so a lost owner blocks its key for at most its lease. Evicted or expired
keys behave as new: the next call with that key goes upstream again. An expired entry
is never served: every lookup checks the time. Completed entries are kept in one queue
per ``ttl_s`` in completion order, which is their expiry order, so the soonest to expire
is always at the front of one of a few queues: expired entries are dropped a few per
call (looked for only once the soonest expiry has passed) and eviction takes the
earliest front, each in O(1) per queue, never a walk of the table that would stall the
event loop. An entry completes in place (the table keeps it under its key). Entries in
flight whose lease ends are dropped from a heap of leases, which holds only the calls in
flight and a bounded number of stale items.

Concurrency: the methods do not await between reading and writing the table, so on one
event loop each is atomic; concurrent ``begin`` calls on a fresh key yield exactly one
:class:`Proceed`.

Memory: besides the bytes counted above, an entry costs about 500 bytes of bookkeeping
(its slots, the table and its queue).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
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
    size: int  # what it counts against max_bytes: key (UTF-8), fingerprint, answer
    answer: bytes = b""  # meaningful once token is None
    ttl_s: float = 0.0  # the completed entry's queue (meaningful once token is None)
    # Created by the first waiter only: most entries are never waited on, and thousands
    # of idle Events (each with a deque) would double what the cyclic GC walks.
    waiters: asyncio.Event | None = None


#: (expires_at, key) of a lease: live while the key's entry is still in flight and
#: expires at that instant.
_Lease: TypeAlias = tuple[float, str]
#: Expired completed entries dropped per store operation (the queues' earliest fronts).
_SWEEP_PER_CALL: Final = 2
_NEVER: Final = math.inf


def _key_size(key: str, fingerprint: str) -> int:
    """What an entry in flight counts against ``max_bytes``: key (UTF-8), fingerprint."""
    return (len(key) if key.isascii() else len(key.encode())) + len(fingerprint)


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
        # Completed entries by ttl_s, each queue in completion (so expiry) order; the
        # queues are as many as the policy has distinct ttl_s, and empty ones go.
        self._done: dict[float, OrderedDict[str, _Entry]] = {}
        self._completed = 0
        self._bytes = 0
        self._leases: list[_Lease] = []  # a heap of the in-flight entries' leases
        # At most the soonest expiry of a completed entry (inf if none): until then no
        # completed entry can have expired, so a call need not look.
        self._next_expiry = _NEVER
        self._tokens = itertools.count(1)

    @property
    def entries(self) -> int:
        return len(self._entries)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    async def begin(self, key: str, fingerprint: str, *, lease_s: float) -> Outcome:
        now = time.monotonic()
        leases = self._leases
        if now >= self._next_expiry or (leases and leases[0][0] <= now):
            self._expire(now)
        entries = self._entries
        entry = entries.get(key)
        if entry is not None:
            if entry.expires_at > now:
                if entry.fingerprint != fingerprint:
                    return Conflict()
                if entry.token is None:
                    return Replay(entry.answer)
                return InFlight()
            self._drop(key, entry)
        size = _key_size(key, fingerprint)
        if len(entries) >= self.max_entries or self._bytes + size > self.max_bytes:
            self._evict(extra_entries=1, extra_bytes=size)
            if len(entries) >= self.max_entries:
                raise CapacityExceeded(
                    f"the idempotency store holds {len(entries)} calls in flight, its "
                    "limit; retry when some have finished",
                    details={"reason": "idempotency_store_full"},
                )
        # The owner's token only has to differ from every other owner's in this process
        # (it never leaves it): a counter, not a random value from a system call.
        token = f"m{next(self._tokens)}"
        expires_at = now + lease_s
        entries[key] = _Entry(fingerprint, token, expires_at, size)
        self._bytes += size
        heapq.heappush(leases, (expires_at, key))
        if len(leases) > 2 * (len(entries) - self._completed) + 64:
            # A completed call leaves its lease behind until the lease's end; dropping
            # the stale ones when they reach twice the calls in flight keeps this heap
            # small (a few dozen items under load), so a rebuild costs microseconds.
            self._leases = [lease for lease in leases if self._live(lease) is not None]
            heapq.heapify(self._leases)
        return Proceed(token)

    async def complete(self, key: str, token: str, answer: bytes, *, ttl_s: float) -> bool:
        now = time.monotonic()
        leases = self._leases
        if now >= self._next_expiry or (leases and leases[0][0] <= now):
            self._expire(now)  # an owner whose lease has ended loses its key here
        entry = self._entries.get(key)
        if entry is None or entry.token != token:
            return False
        # In flight -> completed, in place: the table keeps the entry under its key.
        entry.answer = answer
        entry.token = None
        _wake(entry)
        size = entry.size + len(answer)
        if size > self.max_bytes:
            del self._entries[key]
            self._bytes -= entry.size
            return False
        self._bytes += len(answer)
        entry.size = size
        entry.expires_at = expires_at = now + ttl_s
        entry.ttl_s = ttl_s
        if self._bytes > self.max_bytes:
            self._evict(extra_entries=0, extra_bytes=0)  # not this one: not queued yet
        queue = self._done.get(ttl_s)
        if queue is None:
            queue = self._done[ttl_s] = OrderedDict()
        queue[key] = entry
        self._completed += 1
        if expires_at < self._next_expiry:
            self._next_expiry = expires_at
        return True

    async def abandon(self, key: str, token: str) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry.token == token:
            self._drop(key, entry)

    async def wait(self, key: str, fingerprint: str, *, deadline: float) -> bytes | None:
        now = time.monotonic()
        self._expire(now)
        entry = self._lookup(key, now)
        if entry is None or entry.fingerprint != fingerprint:
            return None
        if entry.token is not None:
            remaining = min(deadline, entry.expires_at) - time.monotonic()
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
        self._completed = 0
        self._leases.clear()
        self._next_expiry = _NEVER
        self._bytes = 0

    # --- internals ------------------------------------------------------------------

    def _live(self, lease: _Lease) -> _Entry | None:
        """The entry in flight ``lease`` stands for, or None if the lease is stale (the
        entry completed, was abandoned or expired; or the key is in flight again under a
        later lease)."""
        at, key = lease
        entry = self._entries.get(key)
        if entry is None or entry.token is None or entry.expires_at != at:
            return None
        return entry

    def _lookup(self, key: str, now: float) -> _Entry | None:
        """The key's entry, unless it has expired (then it is dropped here)."""
        entry = self._entries.get(key)
        if entry is not None and entry.expires_at <= now:
            self._drop(key, entry)
            return None
        return entry

    def _remove(self, key: str, entry: _Entry) -> None:
        if self._entries.get(key) is entry:
            del self._entries[key]
            self._bytes -= entry.size
            if entry.token is None:
                queue = self._done[entry.ttl_s]
                del queue[key]
                self._completed -= 1
                if not queue:
                    del self._done[entry.ttl_s]

    def _drop(self, key: str, entry: _Entry) -> None:
        """Remove an entry that will not complete here (abandoned, expired) and wake its
        waiters: one of them may take over the key."""
        self._remove(key, entry)
        _wake(entry)

    def _expire(self, now: float) -> None:
        leases = self._leases
        while leases and leases[0][0] <= now:
            lease = heapq.heappop(leases)
            entry = self._live(lease)
            if entry is not None:
                self._drop(lease[1], entry)
        for _ in range(_SWEEP_PER_CALL):
            queue = self._soonest()
            if queue is None:
                self._next_expiry = _NEVER
                return
            at = next(iter(queue.values())).expires_at
            if at > now:
                self._next_expiry = at
                return
            self._pop_front(queue)

    def _soonest(self) -> OrderedDict[str, _Entry] | None:
        """The queue whose front (its oldest entry) is the completed entry closest to its
        expiry, or None if there is no completed entry."""
        done = self._done
        if len(done) <= 1:
            return next(iter(done.values()), None)
        return min(done.values(), key=_front_expiry)

    def _pop_front(self, queue: OrderedDict[str, _Entry]) -> None:
        """Remove ``queue``'s front: completed, so nobody waits on it."""
        key, entry = queue.popitem(last=False)
        del self._entries[key]
        self._bytes -= entry.size
        self._completed -= 1
        if not queue:
            del self._done[entry.ttl_s]

    def _evict(self, *, extra_entries: int, extra_bytes: int) -> None:
        """Drop completed entries, closest to expiry first (expired ones before any live
        one), until the extra fits (if it can)."""
        max_entries, max_bytes = self.max_entries - extra_entries, self.max_bytes - extra_bytes
        entries = self._entries
        while len(entries) > max_entries or self._bytes > max_bytes:
            queue = self._soonest()
            if queue is None:
                return  # only entries in flight left: never evicted
            self._pop_front(queue)


def _front_expiry(queue: OrderedDict[str, _Entry]) -> float:
    return next(iter(queue.values())).expires_at


def _wake(entry: _Entry) -> None:
    event, entry.waiters = entry.waiters, None  # the waiters hold it; the entry need not
    if event is not None:
        event.set()
