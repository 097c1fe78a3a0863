"""The Redis idempotency store on a real Redis: the IdempotencyStore contract across two
clients (two sidecars), leases, waiting, and failing closed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from gateway.errors import DependencyFailed
from gateway.idempotency import (
    Conflict,
    IdempotencyStore,
    IdempotencyStores,
    InFlight,
    MemoryIdempotencyStore,
    Proceed,
    Replay,
)
from gateway.idempotency.redis import RedisIdempotencyStore
from gateway.policy import RedisSpec
from gateway.stores.redis import RedisClient
from tests.conftest import RULED_OUT_S, SOON_S
from tests.redis_fixtures import SHARED_URL, free_port

MakeStore = Callable[..., RedisIdempotencyStore]

#: Polls too far apart to answer a waiter within SOON_S: only a wake-up can.
NO_POLLS = {"min_poll_s": RULED_OUT_S, "max_poll_s": RULED_OUT_S}


def now() -> float:
    return asyncio.get_running_loop().time()


@pytest.fixture
async def make_store(redis_prefix: str) -> AsyncIterator[MakeStore]:
    """``make_store(url=..., **polls)``: a store on its own client, as another sidecar
    would have."""
    made: list[RedisIdempotencyStore] = []

    def make(url: str = SHARED_URL, **polls: float) -> RedisIdempotencyStore:
        client = RedisClient(RedisSpec(key_prefix=redis_prefix), url=url)
        store = RedisIdempotencyStore(client, **polls)
        made.append(store)
        return store

    yield make
    for store in made:
        await store.aclose()
        await store.client.aclose()


async def test_implements_the_interface(make_store: MakeStore) -> None:
    assert isinstance(make_store(), IdempotencyStore)


async def test_begin_complete_replay_conflict_across_sidecars(make_store: MakeStore) -> None:
    a, b = make_store(), make_store()
    first = await a.begin("t:k1", "fp1", lease_s=5)
    assert isinstance(first, Proceed)
    assert repr(first) == "Proceed()"
    assert isinstance(await b.begin("t:k1", "fp1", lease_s=5), InFlight)
    assert isinstance(await b.begin("t:k1", "fp2", lease_s=5), Conflict)
    assert await a.complete("t:k1", first.token, b'{"status": 200}', ttl_s=5)
    assert await a.complete("t:k1", first.token, b'{"status": 200}', ttl_s=5)  # repeatable
    assert await b.begin("t:k1", "fp1", lease_s=5) == Replay(b'{"status": 200}')
    assert isinstance(await b.begin("t:k1", "fp2", lease_s=5), Conflict)
    assert not await b.complete("t:k1", "not-the-token", b"x", ttl_s=5)
    assert await a.begin("t:k1", "fp1", lease_s=5) == Replay(b'{"status": 200}')


async def test_concurrent_begins_yield_exactly_one_owner(make_store: MakeStore) -> None:
    stores = [make_store() for _ in range(3)]
    for round_ in range(10):
        outcomes = await asyncio.gather(
            *(s.begin(f"t:race-{round_}", "fp", lease_s=5) for s in stores for _ in range(4))
        )
        assert sum(isinstance(o, Proceed) for o in outcomes) == 1
        assert sum(isinstance(o, InFlight) for o in outcomes) == 11


async def test_abandon_frees_the_key_and_wakes_waiters(make_store: MakeStore) -> None:
    a, b = make_store(), make_store()
    owner = await a.begin("t:k2", "fp", lease_s=5)
    assert isinstance(owner, Proceed)
    waiter = asyncio.create_task(b.wait("t:k2", "fp", deadline=now() + RULED_OUT_S))
    await a.abandon("t:k2", "someone-else")  # not the owner: no-op
    assert isinstance(await b.begin("t:k2", "fp", lease_s=5), InFlight)
    await a.abandon("t:k2", owner.token)
    assert await asyncio.wait_for(waiter, SOON_S) is None  # by a poll, not at the deadline
    assert isinstance(await b.begin("t:k2", "fp", lease_s=5), Proceed)


async def test_waiter_gets_the_answer_from_another_sidecar(make_store: MakeStore) -> None:
    a, b = make_store(**NO_POLLS), make_store()
    owner = await a.begin("t:k3", "fp", lease_s=5)
    assert isinstance(owner, Proceed)
    far = now() + RULED_OUT_S
    waiters = [asyncio.create_task(b.wait("t:k3", "fp", deadline=far)) for _ in range(3)]
    local = asyncio.create_task(a.wait("t:k3", "fp", deadline=far))
    await asyncio.sleep(0.02)
    assert not any(w.done() for w in [*waiters, local])
    assert await a.complete("t:k3", owner.token, b"answer", ttl_s=5)
    # Same process: a polls every 45 s, so only complete's wake-up answers it this soon.
    assert await asyncio.wait_for(local, SOON_S) == b"answer"
    # Another process: by b's polls, not at the deadline.
    assert await asyncio.wait_for(asyncio.gather(*waiters), SOON_S) == [b"answer"] * 3
    assert await b.wait("t:k3", "other-fp", deadline=now() + 5) is None


async def test_wait_gives_up_at_the_deadline(make_store: MakeStore) -> None:
    a = make_store(**NO_POLLS)  # a wait that overran its deadline to the next poll: 45 s
    assert isinstance(await a.begin("t:k4", "fp", lease_s=5), Proceed)
    started = now()
    assert await a.wait("t:k4", "fp", deadline=started + 0.15) is None
    assert 0.14 <= now() - started < SOON_S
    assert await a.wait("t:unknown", "fp", deadline=now() + 5) is None


async def test_a_lost_owner_blocks_the_key_only_for_its_lease(make_store: MakeStore) -> None:
    crashed, b = make_store(), make_store()
    lost = await crashed.begin("t:k5", "fp", lease_s=0.1)
    assert isinstance(lost, Proceed)
    started = now()
    assert await b.wait("t:k5", "fp", deadline=now() + RULED_OUT_S) is None  # lease ran out
    assert now() - started < SOON_S  # at the lease's end, not at the deadline
    taken = await b.begin("t:k5", "fp", lease_s=5)
    assert isinstance(taken, Proceed)
    assert not await crashed.complete("t:k5", lost.token, b"late", ttl_s=5)  # refused
    assert await b.complete("t:k5", taken.token, b"fresh", ttl_s=5)
    assert await crashed.begin("t:k5", "fp", lease_s=5) == Replay(b"fresh")


async def test_completed_answer_expires_after_ttl(make_store: MakeStore) -> None:
    a = make_store()
    owner = await a.begin("t:k6", "fp", lease_s=5)
    assert isinstance(owner, Proceed)
    assert await a.complete("t:k6", owner.token, b"x", ttl_s=0.05)
    deadline = now() + SOON_S
    while isinstance(await a.begin("t:k6", "fp", lease_s=5), Replay):
        assert now() < deadline, "the answer did not expire"
        await asyncio.sleep(0.01)


async def test_aclose_wakes_waiters(make_store: MakeStore) -> None:
    a = make_store(**NO_POLLS)  # only aclose's wake-up ends the wait this soon
    assert isinstance(await a.begin("t:k7", "fp", lease_s=5), Proceed)
    waiter = asyncio.create_task(a.wait("t:k7", "fp", deadline=now() + RULED_OUT_S))
    await asyncio.sleep(0.01)
    await a.aclose()
    assert await asyncio.wait_for(waiter, SOON_S) is None
    await a.aclose()  # idempotent


async def test_fails_closed_when_redis_is_down(make_store: MakeStore) -> None:
    dead = make_store(url=f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(DependencyFailed) as info:
        await dead.begin("t:k8", "fp", lease_s=5)
    assert info.value.retryable
    assert info.value.details == {"reason": "redis_unavailable"}
    with pytest.raises(DependencyFailed):
        await dead.wait("t:k8", "fp", deadline=now() + 5)
    assert not await dead.complete("t:k8", "token", b"x", ttl_s=5)  # never raises
    await dead.abandon("t:k8", "token")  # never raises


async def test_stores_by_scope() -> None:
    local, cluster = MemoryIdempotencyStore(), MemoryIdempotencyStore()
    stores = IdempotencyStores(local, cluster)
    assert stores.for_scope("local") is local
    assert stores.for_scope("cluster") is cluster
    assert IdempotencyStores(local).for_scope("cluster") is local
    assert isinstance(await cluster.begin("k", "fp", lease_s=5), Proceed)
    waiter = asyncio.create_task(cluster.wait("k", "fp", deadline=now() + 5))
    await asyncio.sleep(0)
    await stores.aclose()  # closes both
    assert await waiter is None
