"""Cluster-scope rate-limit groups on a real Redis: the admission script's bound,
booking and refusals, shared tokens and holds, fail-open / fail-closed, reconnection,
and one script call per admission (counted by the server)."""

from __future__ import annotations

import asyncio
import itertools
import math
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.errors import CapacityExceeded
from gateway.metrics import Metrics
from gateway.policy import RateLimitGroupSpec, RedisSpec, parse_policy
from gateway.ratelimit import RateLimitGroup, RateLimitGroups
from gateway.ratelimit.cluster import ClusterLimits, ClusterRateLimitGroup
from gateway.stores.redis import FAIL_FAST_S, RedisClient, RedisUnavailable, redis_url
from tests.conftest import SOON_S, CountWaits, wait_for
from tests.redis_fixtures import (
    SHARED_URL,
    PrivateRedis,
    free_port,
)

FAR = 1e9
US = 1_000_000
MakeGroup = Callable[..., Awaitable[ClusterRateLimitGroup]]


def spec(**kw: Any) -> RateLimitGroupSpec:
    base: dict[str, Any] = {"requests_per_second": 10.0, "burst": 1, "scope": "cluster"}
    return RateLimitGroupSpec(**(base | kw))


def now() -> float:
    return asyncio.get_running_loop().time()


def assert_bound_us(instants: list[int], burst: int, rate: float) -> None:
    """Every window [t_i, t_j] (microseconds) holds at most burst + rate * (t_j - t_i)."""
    times = sorted(instants)
    for i in range(len(times)):
        for j in range(i, len(times)):
            allowed = burst + rate * (times[j] - times[i]) / US
            assert j - i + 1 <= allowed + 1e-9, (i, j, j - i + 1, allowed)


@pytest.fixture
async def make_group(redis_prefix: str) -> AsyncIterator[MakeGroup]:
    """``await make_group(name, spec, url=..., fallbacks=list)``: a cluster group on its own
    client (its own pool, as another sidecar would have), all on the test's prefix."""
    made: list[tuple[ClusterLimits, RedisClient]] = []

    async def make(
        name: str = "g",
        group_spec: RateLimitGroupSpec | None = None,
        *,
        url: str = SHARED_URL,
        fallbacks: list[str] | None = None,
        on_admit: Any = None,
    ) -> ClusterRateLimitGroup:
        # The bound's arithmetic is under test, not Redis timeouts: dozens of connections
        # opened at once on a busy 2-core machine may take longer than the 0.5 s default.
        spec_ = RedisSpec(key_prefix=redis_prefix, connect_timeout_s=5, socket_timeout_s=5)
        client = RedisClient(spec_, url=url)
        on_fallback = fallbacks.append if fallbacks is not None else None
        limits = ClusterLimits(client, on_fallback=on_fallback)
        made.append((limits, client))
        return limits.group(name, group_spec or spec(), on_admit)

    yield make
    for limits, client in made:
        await limits.aclose()
        await client.aclose()


async def wait_until_up(client: RedisClient, timeout_s: float = 5.0) -> None:
    """Poll (bounded) until the client reaches Redis again: it retries by itself once its
    fail-fast window (FAIL_FAST_S) after the last failure has passed."""
    deadline = now() + timeout_s
    while True:
        try:
            await client.ping()
            return
        except RedisUnavailable:
            assert now() < deadline, "the client did not reconnect"
            await asyncio.sleep(0.02)


# --- the script -------------------------------------------------------------------------


@pytest.mark.parametrize(("rate", "burst"), [(10.0, 1), (20.0, 4), (3.0, 2), (250.0, 7)])
async def test_bookings_from_three_sidecars_keep_the_bound(
    make_group: MakeGroup, rate: float, burst: int
) -> None:
    groups = [await make_group("shared", spec(requests_per_second=rate, burst=burst))]
    groups += [await make_group("shared", spec(requests_per_second=rate, burst=burst))]
    groups += [await make_group("shared", spec(requests_per_second=rate, burst=burst))]
    n = 45
    bookings = await asyncio.gather(*(groups[i % 3].reserve(0, 60.0) for i in range(n)))
    assert all(b.booked for b in bookings)
    instants = [b.at_us for b in bookings]
    assert_bound_us(instants, burst, rate)
    # And not stricter than needed, on Redis' clock whatever the scripts' spread in time:
    # a booking that had to wait is booked one slot of 1/rate (rounded up to the
    # microsecond) after the booking before it, not later.
    slot_us = math.ceil(US / rate)
    ordered = sorted(bookings, key=lambda b: b.at_us)
    assert any(b.at_us > b.now_us for b in ordered)  # the bound was reached
    for before, after in itertools.pairwise(ordered):
        if after.at_us > after.now_us:
            assert after.at_us - before.at_us <= slot_us, (before, after)


async def test_random_arrivals_with_refusals_keep_the_bound(make_group: MakeGroup) -> None:
    rate, burst = 40.0, 3
    groups = [await make_group("r", spec(requests_per_second=rate, burst=burst)) for _ in range(3)]
    rng = random.Random(7)
    booked: list[int] = []
    refused = 0

    async def sidecar(group: ClusterRateLimitGroup) -> None:
        nonlocal refused
        for _ in range(25):
            await asyncio.sleep(rng.uniform(0, 0.02))
            booking = await group.reserve(0, rng.choice([0.0, 0.01, 0.05]))
            if booking.booked:
                booked.append(booking.at_us)
            else:
                refused += 1
                assert booking.wait_s > 0

    await asyncio.gather(*(sidecar(g) for g in groups))
    assert refused > 0  # the load was above the rate, so the bound was exercised
    assert len(booked) > burst
    assert_bound_us(booked, burst, rate)


async def test_refusal_says_the_exact_wait(make_group: MakeGroup) -> None:
    group = await make_group("w", spec(requests_per_second=2.0, burst=1, max_queue_s=0.1))
    first = await group.reserve(0, 0.0)
    assert first.booked
    assert first.wait_s == 0
    second = await group.reserve(0, 0.0)
    assert not second.booked
    assert second.at_us == first.at_us + US // 2  # one slot of 1/2 s after the first
    with pytest.raises(CapacityExceeded) as info:
        await group.acquire(deadline=FAR)  # max_queue_s 0.1 < the ~0.5 s wait
    err = info.value
    assert err.retryable
    assert err.details == {"group": "w", "reason": "queue_timeout", "scope": "cluster"}
    assert err.retry_after_s is not None
    assert 0.3 < err.retry_after_s <= 0.5
    with pytest.raises(CapacityExceeded) as info:
        await group.acquire(deadline=now() + 0.05)
    assert info.value.details["reason"] == "deadline"


async def test_acquire_sleeps_until_the_booked_instant(make_group: MakeGroup) -> None:
    admitted: list[float] = []
    a = await make_group(
        "s", spec(requests_per_second=10.0), on_admit=lambda _, t: admitted.append(t)
    )
    b = await make_group(
        "s", spec(requests_per_second=10.0), on_admit=lambda _, t: admitted.append(t)
    )
    waits = await asyncio.gather(*(g.acquire(deadline=FAR) for g in (a, b, a, b)))
    # One admission per slot of 0.1 s, across both "sidecars": the k-th waited k slots
    # at least (all four arrived before the first booking; a late wake-up only adds).
    for k, waited in enumerate(sorted(waits)):
        assert waited >= 0.1 * k - 0.01, (k, waits)
    assert len(admitted) == 4
    assert a.queued == b.queued == 0


async def test_cancelled_waiter_gives_its_tokens_back(make_group: MakeGroup) -> None:
    group = await make_group("c", spec(requests_per_second=100.0, tokens_per_minute=600))
    await group.acquire(tokens=10, deadline=FAR)
    task = asyncio.create_task(group.acquire(tokens=595, deadline=FAR))  # books ~0.5 s ahead
    await wait_for(lambda: group.queued == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await group._limits.aclose()  # the refund is a background write: let it land
    # 595 tokens back: 590 fit again, right after the request slot the cancelled call
    # kept (~0.5 s ahead); without the refund they would fit in about a minute.
    booking = await group.reserve(590, 1.0)
    assert booking.booked
    assert booking.wait_s < 0.6  # the kept slot is <= 0.5 s ahead (+ scheduling slack)


# --- tokens and holds are shared --------------------------------------------------------


async def test_token_budget_is_shared_and_reconciled(make_group: MakeGroup) -> None:
    s = spec(requests_per_second=100.0, burst=10, tokens_per_minute=600, max_queue_s=0.2)
    a, b = await make_group("t", s), await make_group("t", s)
    assert await a.acquire(tokens=600, deadline=FAR) < 0.5
    with pytest.raises(CapacityExceeded) as info:
        await b.acquire(tokens=300, deadline=FAR)
    assert info.value.retry_after_s is not None
    assert 25 < info.value.retry_after_s <= 30  # 300 tokens at 10 per second, minus drain
    a.reconcile(600, 0)  # the call used nothing: refund, for every sidecar
    await a._limits.aclose()
    assert await b.acquire(tokens=300, deadline=FAR) < 0.5
    with pytest.raises(CapacityExceeded) as info:
        await b.acquire(tokens=601, deadline=FAR)
    assert not info.value.retryable
    assert info.value.details["reason"] == "too_large"


async def test_provider_hold_reaches_the_other_sidecars(make_group: MakeGroup) -> None:
    s = spec(requests_per_second=100.0, burst=10, max_queue_s=2.0)
    a, b = await make_group("h", s), await make_group("h", s)
    a.hold_for(0.3, reason="retry-after")
    await a._limits.aclose()
    with pytest.raises(CapacityExceeded) as info:
        await b.acquire(deadline=now() + 0.1)
    assert info.value.details["reason"] == "provider_hold"
    assert info.value.details["hold"] == "retry-after"
    assert b.held_for_s() > 0.1  # b learnt the hold from Redis
    started = now()
    waited = await b.acquire(deadline=FAR)
    assert now() - started >= 0.1
    assert waited >= 0.1
    a.hold_for(0, reason="nothing")  # no-op
    assert b.held_for_s() == 0


async def test_a_hold_during_the_wait_moves_the_booked_call_after_it(
    make_group: MakeGroup,
) -> None:
    admitted: list[float] = []
    group = await make_group(
        "hw", spec(requests_per_second=10.0), on_admit=lambda _, t: admitted.append(t)
    )
    await group.acquire(deadline=FAR)
    waiter = asyncio.create_task(group.acquire(deadline=FAR))  # booked ~0.1 s ahead
    await asyncio.sleep(0.02)
    held_at = now()
    group.hold_for(0.3, reason="retry-after")  # the provider says: not before +0.3 s
    await waiter
    assert admitted[-1] >= held_at + 0.3


# --- Redis unavailable --------------------------------------------------------------------


async def test_fail_open_falls_back_to_the_local_bucket(make_group: MakeGroup) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    fallbacks: list[str] = []
    group = await make_group("o", spec(requests_per_second=10.0), url=dead, fallbacks=fallbacks)
    warnings: list[str] = []
    assert await group.acquire(deadline=FAR, warnings=warnings) < 0.5
    assert warnings == [
        "rate-limit group 'o': Redis unavailable, admitted by this sidecar's own limiter "
        "(fail_open)"
    ]
    started = now()
    await group.acquire(deadline=FAR, warnings=warnings)
    assert now() - started >= 0.08  # the local bucket still limits: 1 per 0.1 s
    assert len(warnings) == 1  # one warning per call, not per attempt
    assert fallbacks == ["o", "o"]
    assert group._limits.client.state == "unavailable"


async def test_fail_closed_refuses_retryably(make_group: MakeGroup) -> None:
    dead = f"redis://:pw-TEST-redis-NOTREAL@127.0.0.1:{free_port()}/0"
    group = await make_group("x", spec(on_redis_error="fail_closed"), url=dead)
    with pytest.raises(CapacityExceeded) as info:
        await group.acquire(deadline=FAR)
    err = info.value
    assert err.retryable
    assert err.details == {"group": "x", "reason": "redis_unavailable", "scope": "cluster"}
    assert err.retry_after_s == 1.0
    assert "pw-TEST-redis-NOTREAL" not in err.message
    assert "127.0.0.1" in err.message


async def test_a_hung_redis_costs_one_timeout_per_fail_fast_window() -> None:
    async def black_hole(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(-1)  # accepts, reads, never answers
        writer.close()

    server = await asyncio.start_server(black_hole, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    s = RedisSpec(key_prefix="hung", socket_timeout_s=0.1, connect_timeout_s=0.1)
    client = RedisClient(s, url=f"redis://127.0.0.1:{port}/0")
    limits = ClusterLimits(client)
    group = limits.group("hung", spec(requests_per_second=1000.0, burst=100))
    try:
        started = now()
        await group.acquire(deadline=FAR)  # waits for the timeout, then falls back
        assert 0.1 <= now() - started < SOON_S  # one timeout (0.2 s), not a hang
        for _ in range(10):
            counted = CountWaits(group.acquire(deadline=FAR))
            await counted
            assert counted.waits == 0  # inside FAIL_FAST_S: no more waiting on Redis
        await asyncio.sleep(FAIL_FAST_S)
        started = now()
        await group.acquire(deadline=FAR)
        assert now() - started >= 0.1  # tried Redis again
    finally:
        await limits.aclose()
        await client.aclose()
        server.close()
        await server.wait_closed()


async def test_reconnects_when_redis_is_back_and_costs_one_script_call(
    private_redis: PrivateRedis,
) -> None:
    client = RedisClient(RedisSpec(key_prefix="rt", pool_size=4), url=private_redis.url)
    limits = ClusterLimits(client)
    group = limits.group("rt", spec(requests_per_second=1000.0, burst=50))
    try:
        warnings: list[str] = []
        await group.acquire(deadline=FAR, warnings=warnings)
        assert client.state == "ok"
        private_redis.kill()
        await group.acquire(deadline=FAR, warnings=warnings)
        assert client.state == "unavailable"
        assert len(warnings) == 1
        private_redis.start()  # empty: no keys, no scripts
        await wait_until_up(client)
        private_redis.reset_stats()
        warnings.clear()
        n = 30
        for _ in range(n):
            await group.acquire(deadline=FAR, warnings=warnings)
        assert warnings == []  # Redis again, no fallback, from the first call on
        assert client.state == "ok"
        stats = private_redis.commandstats()
        assert stats.pop("evalsha") == n + 1  # one per admission (+1 refused: NOSCRIPT)
        assert stats.pop("script|load") == 1
        assert stats.pop("hello") <= 4  # one per new connection, at most the pool
        assert stats.pop("config|resetstat", 0) <= 1
        assert stats.pop("info", 0) <= 1
        # What is left ran inside the script, not over the network.
        assert set(stats) <= {"time", "hmget", "get", "set"}, stats
    finally:
        await limits.aclose()
        await client.aclose()


async def test_reconcile_is_one_more_script_call_off_the_hot_path(
    private_redis: PrivateRedis,
) -> None:
    client = RedisClient(RedisSpec(key_prefix="rc"), url=private_redis.url)
    limits = ClusterLimits(client)
    group = limits.group("rc", spec(requests_per_second=1000.0, burst=50, tokens_per_minute=10**6))
    try:
        await group.acquire(tokens=100, deadline=FAR)
        group.reconcile(100, 40)
        await limits.aclose()  # both scripts are loaded now
        private_redis.reset_stats()
        for _ in range(10):
            await group.acquire(tokens=100, deadline=FAR)
            group.reconcile(100, 40)
        await limits.aclose()
        assert private_redis.commandstats()["evalsha"] == 20
    finally:
        await client.aclose()


# --- wiring ---------------------------------------------------------------------------


async def test_groups_build_cluster_groups_by_scope(redis_prefix: str) -> None:
    client = RedisClient(RedisSpec(key_prefix=redis_prefix))
    metrics = Metrics()
    limits = ClusterLimits(client, on_fallback=metrics.observe_redis_fallback)
    specs = {"c": spec(), "l": spec(scope="local")}
    groups = RateLimitGroups(specs, cluster=limits.group)
    try:
        assert isinstance(groups.get("c"), ClusterRateLimitGroup)
        local = groups.get("l")
        assert type(local) is RateLimitGroup
        old = groups.get("c")
        groups.update(specs)
        assert groups.get("c") is old  # unchanged: same object
        groups.update({"c": spec(burst=3), "l": spec(scope="local")})
        assert isinstance(groups.get("c"), ClusterRateLimitGroup)
        assert groups.get("c") is not old
        assert type(RateLimitGroups(specs).get("c")) is RateLimitGroup  # no factory: local
    finally:
        await limits.aclose()
        await client.aclose()


def test_the_docs_example_is_a_valid_policy() -> None:
    text = (Path(__file__).parent.parent / "docs" / "cluster.md").read_text()
    example = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    policy = parse_policy(example, "docs/cluster.md")
    assert policy.rate_limit_groups["openai-org"].scope == "cluster"
    assert policy.redis is not None
    assert policy.redis.pool_size == 32
    payments = policy.targets["payments"].idempotency
    assert payments is not None
    assert payments.scope == "cluster"


def test_redis_url_env_overrides_the_policy() -> None:
    s = RedisSpec(url="redis://policy-host:6379/1")
    assert redis_url(s, {}) == "redis://policy-host:6379/1"
    assert redis_url(s, {"REDIS_URL": ""}) == "redis://policy-host:6379/1"
    assert redis_url(s, {"REDIS_URL": "redis://env-host:6380/2"}) == "redis://env-host:6380/2"


async def test_client_refuses_bad_urls_without_echoing_them() -> None:
    with pytest.raises(ValueError, match="redis://, rediss:// or unix://") as info:
        RedisClient(RedisSpec(), url="http://user:pw-TEST-redis-NOTREAL@host/")
    assert "NOTREAL" not in str(info.value)
    client = RedisClient(RedisSpec(), url=f"redis://:pw-TEST-redis-NOTREAL@127.0.0.1:{free_port()}")
    assert "NOTREAL" not in repr(client)
    with pytest.raises(RedisUnavailable) as unavailable:
        await client.ping()
    assert "NOTREAL" not in str(unavailable.value)
    await client.aclose()
    await client.aclose()  # idempotent
