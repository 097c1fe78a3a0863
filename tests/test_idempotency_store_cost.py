"""The in-memory idempotency store's per-call work: an entry completes in
place, expiry is looked at only when something can have expired, eviction pops a
queue's front. What it stores, replays, expires and evicts is unchanged."""

from __future__ import annotations

import asyncio
import random
import time

from gateway.errors import CapacityExceeded
from gateway.idempotency import MemoryIdempotencyStore, Proceed, Replay

FP = "f" * 64


async def outlive(seconds: float) -> None:
    """Let ``seconds`` of monotonic time pass (the store reads the clock itself)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        await asyncio.sleep(end - time.monotonic())


async def proceed(store: MemoryIdempotencyStore, key: str, lease_s: float = 30) -> str:
    outcome = await store.begin(key, FP, lease_s=lease_s)
    assert isinstance(outcome, Proceed)
    return outcome.token


def check_books(store: MemoryIdempotencyStore) -> None:
    """The counts the store keeps agree with what it holds."""
    entries = store._entries
    assert store.size_bytes == sum(
        len(key.encode()) + len(e.fingerprint) + len(e.answer) for key, e in entries.items()
    )
    queued = [key for queue in store._done.values() for key in queue]
    assert sorted(queued) == sorted(k for k, e in entries.items() if e.token is None)
    assert store._completed == len(queued)
    assert all(queue for queue in store._done.values())  # empty queues go
    for queue in store._done.values():  # each queue in expiry order
        times = [e.expires_at for e in queue.values()]
        assert times == sorted(times)
    if queued:
        soonest = min(e.expires_at for key, e in entries.items() if e.token is None)
        assert store._next_expiry <= soonest


async def test_a_sooner_ttl_completed_later_is_still_swept_as_calls_pass() -> None:
    store = MemoryIdempotencyStore()
    await store.complete("long", await proceed(store, "long"), b"L", ttl_s=60)
    await store.complete("short", await proceed(store, "short"), bytes(100), ttl_s=0.02)
    check_books(store)
    await outlive(0.03)
    await store.complete("n", await proceed(store, "n"), b"n", ttl_s=60)  # not a lookup
    assert store.entries == 2  # short went, swept by an unrelated call
    assert await store.begin("long", FP, lease_s=30) == Replay(b"L")
    check_books(store)


async def test_an_owner_past_its_lease_cannot_complete_even_unchallenged() -> None:
    store = MemoryIdempotencyStore()
    token = await proceed(store, "k", lease_s=0.02)
    await outlive(0.03)
    assert await store.complete("k", token, b"late", ttl_s=60) is False
    assert (store.entries, store.size_bytes) == (0, 0)
    assert isinstance(await store.begin("k", FP, lease_s=30), Proceed)  # nothing stored


async def test_an_answer_too_large_to_keep_leaves_the_books_exact() -> None:
    store = MemoryIdempotencyStore(max_bytes=600)
    await store.complete("a", await proceed(store, "a"), bytes(200), ttl_s=60)
    token = await proceed(store, "big")
    assert await store.complete("big", token, bytes(600), ttl_s=60) is False
    check_books(store)
    assert store.entries == 1
    # An answer that fits only once an older one goes: the older one is evicted, not it.
    await store.complete("b", await proceed(store, "b"), bytes(400), ttl_s=60)
    check_books(store)
    assert isinstance(await store.begin("a", FP, lease_s=30), Proceed)
    assert await store.begin("b", FP, lease_s=30) == Replay(bytes(400))


async def test_the_books_hold_through_a_random_mix_at_capacity() -> None:
    rng = random.Random(21)
    store = MemoryIdempotencyStore(max_entries=20, max_bytes=4000)
    owned: dict[str, str] = {}
    for step in range(3000):
        key = f"k{rng.randrange(60)}"
        action = rng.random()
        if key in owned and action < 0.5:
            answer = bytes(rng.choice((0, 10, 150, 500)))
            ttl = rng.choice((60.0, 600.0, 0.001))
            await store.complete(key, owned.pop(key), answer, ttl_s=ttl)
        elif key in owned and action < 0.6:
            await store.abandon(key, owned.pop(key))
        else:
            try:
                outcome = await store.begin(key, FP, lease_s=rng.choice((30.0, 0.001)))
            except CapacityExceeded:
                assert store.entries == store.max_entries
                for victim in list(owned)[:5]:
                    await store.abandon(victim, owned.pop(victim))
                continue
            if isinstance(outcome, Proceed):
                owned[key] = outcome.token
        assert store.entries <= store.max_entries
        if step % 50 == 0:
            await asyncio.sleep(0.002)  # let the short leases and ttls run out
        check_books(store)
