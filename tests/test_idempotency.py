"""Idempotency: keys, fingerprints, and the in-memory store (replay, B06 conflict,
joiners, abandon, expiry, bounds)."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from gateway.errors import CapacityExceeded
from gateway.idempotency import (
    Conflict,
    IdempotencyStore,
    InFlight,
    MemoryIdempotencyStore,
    Proceed,
    Replay,
    canonical_json,
    derive_key,
    fingerprint,
    store_key,
)
from tests.conftest import RULED_OUT_S, SOON_S, turns_until

FP = "f" * 64


async def outlive(seconds: float) -> None:
    """Let ``seconds`` of monotonic time pass: the store reads the clock itself, so an
    answer's ttl can only run out in real time."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        await asyncio.sleep(end - time.monotonic())


def in_s(seconds: float) -> float:
    return asyncio.get_running_loop().time() + seconds


async def poll_until(predicate: object, timeout: float = 2.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < end, "condition not reached in time"
        await asyncio.sleep(0.002)


async def proceed(
    store: MemoryIdempotencyStore, key: str, fp: str = FP, lease_s: float = 30
) -> str:
    outcome = await store.begin(key, fp, lease_s=lease_s)
    assert isinstance(outcome, Proceed)
    return outcome.token


# --- keys and fingerprints ---------------------------------------------------------------


def test_derived_key_is_stable_and_versioned() -> None:
    key = derive_key("trace-1", "corr-refund-0007", "fake-stripe", "POST", "/v1/refunds")
    # A literal: changing the derivation must be a deliberate, visible change.
    assert key == "egw1-11e745e1bbaee96569f9395183d5204d293c1d8bce17f846769f2adeb3cf3212"
    assert key == derive_key("trace-1", "corr-refund-0007", "fake-stripe", "post", "/v1/refunds")


@pytest.mark.parametrize(
    "other",
    [
        ("trace-2", "corr-refund-0007", "fake-stripe", "POST", "/v1/refunds"),
        ("trace-1", "corr-refund-0008", "fake-stripe", "POST", "/v1/refunds"),
        ("trace-1", "corr-refund-0007", "fake-openai", "POST", "/v1/refunds"),
        ("trace-1", "corr-refund-0007", "fake-stripe", "PUT", "/v1/refunds"),
        ("trace-1", "corr-refund-0007", "fake-stripe", "POST", "/v1/refunds/x"),
        ("trace-1corr-refund-0007", "", "fake-stripe", "POST", "/v1/refunds"),  # no concat clash
    ],
)
def test_derived_key_changes_with_any_part(other: tuple[str, str, str, str, str]) -> None:
    base = derive_key("trace-1", "corr-refund-0007", "fake-stripe", "POST", "/v1/refunds")
    assert derive_key(*other) != base


def test_fingerprint_is_canonical() -> None:
    a = fingerprint("fake-stripe", "POST", "/v1/refunds", {"charge": "ch_fake_01", "amount": 500})
    b = fingerprint("fake-stripe", "post", "/v1/refunds", {"amount": 500, "charge": "ch_fake_01"})
    assert a == b
    assert len(a) == 64
    assert a != fingerprint(
        "fake-stripe", "POST", "/v1/refunds", {"charge": "ch_fake_01", "amount": 5000}
    )
    assert a != fingerprint(
        "fake-stripe", "POST", "/v1/refund", {"charge": "ch_fake_01", "amount": 500}
    )
    assert canonical_json({"b": [1, "é"], "a": None}) == '{"a":null,"b":[1,"é"]}'.encode()
    with pytest.raises(ValueError, match="JSON compliant"):
        fingerprint("t", "POST", "/x", {"v": float("nan")})


def test_store_key_scopes_by_target() -> None:
    assert store_key("fake-stripe", "k1") != store_key("fake-openai", "k1")
    assert store_key("fake-stripe", "k1") == "fake-stripe:k1"


# --- the store ----------------------------------------------------------------------------


def test_memory_store_implements_the_protocol() -> None:
    assert isinstance(MemoryIdempotencyStore(), IdempotencyStore)
    assert "tok" not in repr(Proceed("tok"))


async def test_replay_returns_the_stored_answer() -> None:
    store = MemoryIdempotencyStore()
    token = await proceed(store, "k")
    assert await store.complete("k", token, b'{"id":"re_fake_01"}', ttl_s=60) is True
    assert await store.begin("k", FP, lease_s=30) == Replay(b'{"id":"re_fake_01"}')
    assert await store.begin("k", FP, lease_s=30) == Replay(b'{"id":"re_fake_01"}')


async def test_b06_same_key_different_request_is_a_conflict() -> None:
    store = MemoryIdempotencyStore()
    key = store_key(
        "fake-stripe", derive_key("t", "corr-refund-0007", "fake-stripe", "POST", "/v1/refunds")
    )
    fp1 = fingerprint("fake-stripe", "POST", "/v1/refunds", {"charge": "ch_fake_01", "amount": 500})
    fp2 = fingerprint(
        "fake-stripe", "POST", "/v1/refunds", {"charge": "ch_fake_01", "amount": 5000}
    )
    token = await proceed(store, key, fp1)
    assert await store.begin(key, fp2, lease_s=30) == Conflict()  # while in flight
    await store.complete(key, token, b'{"id":"re_fake_01","amount":500}', ttl_s=60)
    outcome = await store.begin(key, fp2, lease_s=30)
    assert outcome == Conflict()  # never the stored answer of the other request
    assert await store.wait(key, fp2, deadline=in_s(1)) is None
    assert await store.begin(key, fp1, lease_s=30) == Replay(b'{"id":"re_fake_01","amount":500}')


async def test_concurrent_joiners_make_one_call_and_share_its_answer() -> None:
    store = MemoryIdempotencyStore()
    hits = 0
    gate = asyncio.Event()
    waiting = 0

    async def call() -> tuple[str, bytes]:
        nonlocal hits, waiting
        while True:
            outcome = await store.begin("k", FP, lease_s=30)
            if isinstance(outcome, Proceed):
                hits += 1
                await gate.wait()  # the upstream call
                answer = b'{"ok":true}'
                await store.complete("k", outcome.token, answer, ttl_s=60)
                return "owner", answer
            if isinstance(outcome, Replay):
                return "replay", outcome.answer
            assert isinstance(outcome, InFlight)
            waiting += 1
            joined = await store.wait("k", FP, deadline=in_s(5))
            if joined is not None:
                return "joined", joined

    tasks = [asyncio.create_task(call()) for _ in range(10)]
    await poll_until(lambda: waiting == 9)
    gate.set()
    results = await asyncio.gather(*tasks)
    assert hits == 1
    assert sorted(kind for kind, _ in results) == ["joined"] * 9 + ["owner"]
    assert {answer for _, answer in results} == {b'{"ok":true}'}


async def test_abandon_wakes_waiters_who_may_then_proceed() -> None:
    store = MemoryIdempotencyStore()
    token = await proceed(store, "k")
    waiters = [asyncio.create_task(store.wait("k", FP, deadline=in_s(5))) for _ in range(3)]
    await asyncio.sleep(0)  # one turn of the loop: each task runs to its wait
    assert not any(w.done() for w in waiters)
    await store.abandon("k", token)
    await turns_until(lambda: all(w.done() for w in waiters))  # woken, not timed out
    assert await asyncio.gather(*waiters) == [None, None, None]
    outcomes = await asyncio.gather(*(store.begin("k", FP, lease_s=30) for _ in range(3)))
    assert sum(isinstance(o, Proceed) for o in outcomes) == 1
    assert sum(isinstance(o, InFlight) for o in outcomes) == 2


async def test_abandon_and_complete_need_the_owner_token() -> None:
    store = MemoryIdempotencyStore()
    await proceed(store, "k")
    await store.abandon("k", "not-the-token")
    assert await store.begin("k", FP, lease_s=30) == InFlight()
    assert await store.complete("k", "not-the-token", b"x", ttl_s=60) is False
    assert await store.begin("k", FP, lease_s=30) == InFlight()


async def test_wait_gives_up_at_its_deadline() -> None:
    store = MemoryIdempotencyStore()
    await proceed(store, "k")
    t0 = time.monotonic()
    assert await store.wait("k", FP, deadline=in_s(0.03)) is None
    assert 0.02 < time.monotonic() - t0 < SOON_S  # at the deadline: the key stays in flight
    assert await store.wait("unknown", FP, deadline=in_s(1)) is None


async def test_completed_entries_expire_after_ttl() -> None:
    store = MemoryIdempotencyStore()
    token = await proceed(store, "k")
    await store.complete("k", token, b"answer", ttl_s=0.05)
    t0 = time.monotonic()
    assert await store.begin("k", FP, lease_s=30) == Replay(b"answer")
    outcome: object = None

    async def expired() -> bool:
        nonlocal outcome
        outcome = await store.begin("k", FP, lease_s=30)
        return isinstance(outcome, Proceed)

    while not await expired():
        assert time.monotonic() - t0 < 2
        await asyncio.sleep(0.005)
    assert time.monotonic() - t0 >= 0.04


async def test_lost_owner_blocks_its_key_only_for_its_lease() -> None:
    store = MemoryIdempotencyStore()
    lost = await proceed(store, "k", lease_s=0.05)
    t0 = time.monotonic()
    # Woken by the lease's end, not by the wait's deadline.
    assert await store.wait("k", FP, deadline=in_s(RULED_OUT_S)) is None
    assert 0.03 < time.monotonic() - t0 < SOON_S
    fresh = await proceed(store, "k")
    assert await store.complete("k", lost, b"late", ttl_s=60) is False
    assert await store.complete("k", fresh, b"fresh", ttl_s=60) is True
    assert await store.begin("k", FP, lease_s=30) == Replay(b"fresh")


async def test_entry_bound_evicts_the_answers_closest_to_expiry() -> None:
    store = MemoryIdempotencyStore(max_entries=3)
    for key, ttl in (("k1", 60.0), ("k2", 600.0), ("k3", 60.0)):
        await store.complete(key, await proceed(store, key), key.encode(), ttl_s=ttl)
    assert await store.begin("k1", FP, lease_s=30) == Replay(b"k1")  # no longer a "use"
    await store.complete("k4", await proceed(store, "k4"), b"k4", ttl_s=60)
    assert store.entries == 3
    assert isinstance(await store.begin("k1", FP, lease_s=30), Proceed)  # k1 expired first
    assert store.entries == 3  # ... and k3, next to expire, made room for the k1 claim
    assert await store.begin("k2", FP, lease_s=30) == Replay(b"k2")
    assert await store.begin("k4", FP, lease_s=30) == Replay(b"k4")
    assert isinstance(await store.begin("k3", FP, lease_s=30), Proceed)


async def test_in_flight_entries_are_never_evicted() -> None:
    store = MemoryIdempotencyStore(max_entries=2)
    await proceed(store, "a")
    await proceed(store, "b")
    with pytest.raises(CapacityExceeded) as info:
        await store.begin("c", FP, lease_s=30)
    assert info.value.retryable is True
    assert info.value.details == {"reason": "idempotency_store_full"}
    assert await store.begin("a", FP, lease_s=30) == InFlight()


async def test_byte_bound_holds_and_oversized_answers_still_reach_waiters() -> None:
    store = MemoryIdempotencyStore(max_bytes=1000)
    for i in range(10):
        key = f"k{i}"
        await store.complete(key, await proceed(store, key), bytes(250), ttl_s=60)
        assert store.size_bytes <= 1000
    assert store.entries == 3  # 3 * (250 + key + 64-char fingerprint) fits, 4 do not
    assert isinstance(await store.begin("k0", FP, lease_s=30), Proceed)  # oldest went first
    assert await store.begin("k9", FP, lease_s=30) == Replay(bytes(250))

    token = await proceed(store, "big")
    waiter = asyncio.create_task(store.wait("big", FP, deadline=in_s(5)))
    await asyncio.sleep(0)
    assert not waiter.done()
    assert await store.complete("big", token, bytes(5000), ttl_s=60) is False
    assert await waiter == bytes(5000)
    assert isinstance(await store.begin("big", FP, lease_s=30), Proceed)  # not stored
    assert store.size_bytes <= 1000


async def test_an_evicted_answer_is_released_at_once() -> None:
    # Expiry items hold the key, not the entry: an evicted answer is not kept alive by
    # its stale item until the expiry heap is next rebuilt (memory, docs/performance.md).
    store = MemoryIdempotencyStore(max_entries=2)
    answer = bytes(1000)
    await store.complete("k1", await proceed(store, "k1"), answer, ttl_s=60)
    held = sys.getrefcount(answer)  # ours, getrefcount's and the store's
    for key in ("k2", "k3"):
        await store.complete(key, await proceed(store, key), key.encode(), ttl_s=60)
    assert isinstance(await store.begin("k1", FP, lease_s=30), Proceed)  # k1 was evicted
    assert sys.getrefcount(answer) == held - 1


async def test_lease_heap_stays_small_and_expiry_works_without_table_walks() -> None:
    # Completed calls leave their lease behind; the lease heap is cleaned at twice the
    # calls in flight, never walking the whole table (that stalled the loop for ~3 ms
    # every few hundred calls at 5,000 entries). Replay, eviction and expiry still work.
    store = MemoryIdempotencyStore(max_entries=400)
    largest = 0
    for i in range(3000):
        key = f"k{i}"
        await store.complete(key, await proceed(store, key), key.encode(), ttl_s=60)
        largest = max(largest, len(store._leases))
    assert store.entries == 400
    assert largest <= 2 * 1 + 64 + 1
    assert await store.begin("k2600", FP, lease_s=30) == Replay(b"k2600")
    assert isinstance(await store.begin("k2599", FP, lease_s=30), Proceed)  # evicted

    await store.complete("short", await proceed(store, "short"), b"s", ttl_s=0.05)
    t0 = time.monotonic()
    while not isinstance(await store.begin("short", FP, lease_s=30), Proceed):
        assert time.monotonic() - t0 < 2, "the short answer did not expire"
        await asyncio.sleep(0.005)
    assert time.monotonic() - t0 >= 0.04


async def test_expired_answers_are_dropped_as_calls_pass() -> None:
    # Not only on lookup: an answer past its ttl leaves memory while other calls go on,
    # a few per call, the closest to expiry first.
    store = MemoryIdempotencyStore()
    for key in ("old1", "old2", "old3"):
        await store.complete(key, await proceed(store, key), bytes(100), ttl_s=0.02)
    await store.complete("keep", await proceed(store, "keep"), b"k", ttl_s=60)
    assert store.entries == 4
    await outlive(0.03)
    for i in range(2):  # each store operation drops up to two expired answers
        await store.complete(f"n{i}", await proceed(store, f"n{i}"), b"n", ttl_s=60)
    assert store.entries == 3  # keep, n0, n1
    assert store.size_bytes == sum(
        len(k) + len(FP) + n for k, n in (("keep", 1), ("n0", 1), ("n1", 1))
    )
    assert await store.begin("keep", FP, lease_s=30) == Replay(b"k")


async def test_size_counts_the_key_in_utf8() -> None:
    store = MemoryIdempotencyStore()
    await proceed(store, "ключ")  # 4 characters, 8 bytes
    assert store.size_bytes == 8 + len(FP)
    token = await proceed(store, "key")
    await store.complete("key", token, b"12345", ttl_s=60)
    assert store.size_bytes == 8 + len(FP) + 3 + len(FP) + 5


async def test_aclose_wakes_waiters() -> None:
    store = MemoryIdempotencyStore()
    await proceed(store, "k")
    waiter = asyncio.create_task(store.wait("k", FP, deadline=in_s(5)))
    await asyncio.sleep(0)
    assert not waiter.done()
    await store.aclose()
    assert await asyncio.wait_for(waiter, 1) is None
    assert store.entries == 0
    await store.aclose()  # idempotent


def test_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_entries"):
        MemoryIdempotencyStore(max_entries=0)


@pytest.mark.parametrize(
    "text",
    ["plain", 'q"uote\\back', "ctl\n\t\x00\x1f\x7f", "Zoë ☃ 😀 \u2028", "", "/v1/a?b=c&d"],
)
def test_keys_and_fingerprints_are_the_canonical_json_ones(text: str) -> None:
    """Built piecewise for speed, they must stay the documented SHA-256 of canonical
    JSON: keys are stored (in Redis too) and must not change across versions."""
    import hashlib

    from gateway.idempotency.keys import DERIVED_KEY_PREFIX, canonical_json

    parts = [text, "corr-1", "openai", "POST", "/v1/" + text]
    assert derive_key(*parts[:3], "post", parts[4]) == DERIVED_KEY_PREFIX + (
        hashlib.sha256(canonical_json(parts)).hexdigest()
    )
    params = {"b": [1, 2.5, None], "a": {"z": text, "y": True}}
    whole = {"target_system": text, "method": "PATCH", "endpoint": "/e/" + text}
    assert fingerprint(text, "patch", "/e/" + text, params) == (
        hashlib.sha256(canonical_json({**whole, "parameters": params})).hexdigest()
    )


async def test_expired_answers_go_before_a_live_one_is_evicted() -> None:
    # With a sweep from the least recently used end only, expired
    # answers behind a live one kept their room and a live answer was evicted instead,
    # so a retry within its ttl went upstream again.
    store = MemoryIdempotencyStore(max_entries=4)
    for key, ttl in (("pay", 86_400.0), ("s1", 0.05), ("s2", 0.05), ("s3", 0.05)):
        await store.complete(key, await proceed(store, key), b"answer-" + key.encode(), ttl_s=ttl)
    await outlive(0.07)
    assert isinstance(await store.begin("new", FP, lease_s=30), Proceed)
    assert await store.begin("pay", FP, lease_s=30) == Replay(b"answer-pay")


async def test_a_replay_does_not_extend_an_answer_and_eviction_takes_the_soonest() -> None:
    store = MemoryIdempotencyStore(max_entries=3)
    await store.complete("a", await proceed(store, "a"), b"A", ttl_s=0.05)
    await store.complete("b", await proceed(store, "b"), b"B", ttl_s=60)
    assert await store.begin("a", FP, lease_s=30) == Replay(b"A")
    await outlive(0.07)
    await store.complete("c", await proceed(store, "c"), b"C", ttl_s=120)
    assert isinstance(await store.begin("d", FP, lease_s=30), Proceed)  # a (expired) went
    assert await store.begin("b", FP, lease_s=30) == Replay(b"B")
    await store.complete("e", await proceed(store, "e"), b"E", ttl_s=30)  # full: b goes
    assert isinstance(await store.begin("b", FP, lease_s=30), Proceed)  # soonest to expire
    assert await store.begin("c", FP, lease_s=30) == Replay(b"C")
