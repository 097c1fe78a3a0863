"""Cluster-scope budgets on real Redis: the Lua script's buckets
and resets are the pure module's; concurrent admissions from several clients never book
past the limit; three real sidecar processes sharing one budget let through exactly what
fits (the upstream counts); a shadow cluster group records without waiting; a
fail-closed budget without Redis refuses retryably and sends nothing.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis
from aiohttp import web

from gateway.budgets import NANO_USD, Budgets
from gateway.budgets.cluster import ClusterBudgets
from gateway.budgets.windows import Window
from gateway.errors import BudgetExceeded, CapacityExceeded
from gateway.policy import RedisSpec
from gateway.policy.budgets import BudgetSpec
from gateway.ratelimit.cluster import ClusterLimits
from gateway.stores.redis import RedisClient
from tests.conftest import compile_policy, envelope, openai_target, policy_yaml
from tests.processes import Process
from tests.redis_fixtures import SHARED_URL, free_port

PRICES = {"fake-model-1": {"input_usd_per_mtok": 100_000, "output_usd_per_mtok": 100_000}}
MESSAGES = [{"role": "user", "content": "ping"}]
RESERVED_USD = (len(json.dumps(MESSAGES, separators=(",", ":"))) + 10) * 0.1  # 4.4 USD

MakeBudgets = Callable[[dict[str, BudgetSpec]], Awaitable[Budgets]]


@pytest.fixture
async def make_budgets(redis_prefix: str) -> AsyncIterator[MakeBudgets]:
    """``await make_budgets(specs)``: a Budgets on its own Redis client (as a sidecar)."""
    opened: list[tuple[RedisClient, ClusterLimits]] = []

    async def make(specs: dict[str, BudgetSpec]) -> Budgets:
        spec = RedisSpec(key_prefix=redis_prefix, connect_timeout_s=5, socket_timeout_s=5)
        client = RedisClient(spec, url=SHARED_URL)
        limits = ClusterLimits(client)
        opened.append((client, limits))
        return Budgets(specs, cluster=ClusterBudgets(limits))

    yield make
    for client, limits in opened:
        await limits.aclose()
        await client.aclose()


def _spec(window: str, limit: float, **extra: Any) -> BudgetSpec:
    return BudgetSpec(limit_usd=limit, window=window, scope="cluster", **extra)  # type: ignore[arg-type]


def _next_month_s() -> float:
    now = dt.datetime.now(dt.UTC)
    year, month = (now.year + 1, 1) if now.month == 12 else (now.year, now.month + 1)
    return dt.datetime(year, month, 1, tzinfo=dt.UTC).timestamp() - now.timestamp()


async def test_lua_buckets_and_resets_are_the_pure_modules(
    make_budgets: MakeBudgets, redis_prefix: str
) -> None:
    specs = {
        "d": _spec("daily", 10),
        "m": _spec("monthly", 10),
        "r": _spec("rolling", 10, per_hours=24.0),  # 24-minute buckets
        "s": _spec("daily", 1, mode="shadow"),
    }
    budgets = await make_budgets(specs)
    applied = budgets.applying("t", None, "a")
    before = {b.name: b.window.bucket(time.time()) for b in applied}
    booking = await budgets.reserve(applied, 6.0)
    after = {b.name: b.window.bucket(time.time()) for b in applied}
    assert booking.shadow_denied == ["s"]  # over its limit: recorded, booked, not refused
    assert len(booking.cluster) == 4
    for budget, bucket in booking.cluster:
        assert bucket in {before[budget.name], after[budget.name]}
    raw = redis.Redis.from_url(SHARED_URL)
    try:
        for budget, bucket in booking.cluster:
            key = f"{redis_prefix}:budget:{{budgets}}:{budget.name}"
            assert int(raw.hget(key, str(bucket)) or 0) == 6 * NANO_USD
            ttl_s = raw.pttl(key) / 1000
            assert 0 < ttl_s <= budget.window.leaves_at(bucket) - time.time() + 61
    finally:
        raw.close()
    for name, expected in (("d", None), ("m", _next_month_s())):
        (budget,) = [b for b in applied if b.name == name]
        with pytest.raises(BudgetExceeded) as caught:
            await budgets.reserve([budget], 5.0)
        if expected is None:
            expected = Window("daily").leaves_at(before["d"]) - time.time()
        assert caught.value.retry_after_s == pytest.approx(expected, abs=5)
        assert caught.value.details["scope"] == "cluster"
    (rolling,) = [b for b in applied if b.name == "r"]
    with pytest.raises(BudgetExceeded) as caught:
        await budgets.reserve([rolling], 5.0)  # fits once the 6 USD bucket leaves
    assert caught.value.retry_after_s == pytest.approx(
        rolling.window.leaves_at({b.name: k for b, k in booking.cluster}["r"]) - time.time(),
        abs=5,
    )
    with pytest.raises(BudgetExceeded) as caught:
        await budgets.reserve([rolling], 11.0)  # more than the whole limit: never
    assert caught.value.retry_after_s is None
    assert caught.value.details["reason"] == "too_large"


async def test_large_amounts_are_exact_in_lua(make_budgets: MakeBudgets) -> None:
    """Near the policy's bounds (1e6 USD = 1e15 nano-USD; 1-minute rolling windows):
    integers reach Redis as integers, never in Lua's exponent form."""
    budgets = await make_budgets(
        {"big": _spec("monthly", 1_000_000), "fast": _spec("rolling", 1_000_000, per_hours=1 / 60)}
    )
    applied = budgets.applying("t", None, "a")
    booking = await budgets.reserve(applied, 999_999.5)
    raw = redis.Redis.from_url(SHARED_URL)
    try:
        for budget, bucket in booking.cluster:
            stored = raw.hget(budgets.cluster.key(budget.name), str(bucket))  # type: ignore[union-attr]
            assert int(stored or 0) == 999_999_500_000_000
    finally:
        raw.close()
    with pytest.raises(BudgetExceeded):
        await budgets.reserve(applied, 1.0)


async def test_concurrent_admissions_from_several_clients_never_overbook(
    make_budgets: MakeBudgets,
) -> None:
    specs = {"shared": _spec("daily", 10.0)}
    sidecars = [await make_budgets(specs) for _ in range(3)]

    async def one(budgets: Budgets) -> bool:
        try:
            await budgets.reserve(budgets.applying("t", None, "a"), 0.7)
        except BudgetExceeded:
            return False
        return True

    results = await asyncio.gather(*(one(sidecars[i % 3]) for i in range(60)))
    assert sum(results) == math.floor(10.0 / 0.7)  # 14: the script is atomic
    budget = sidecars[0].applying("t", None, "a")[0]
    raw = redis.Redis.from_url(SHARED_URL)
    try:
        key = sidecars[0].cluster.key("shared")  # type: ignore[union-attr]
        total = sum(int(v) for v in raw.hgetall(key).values())
    finally:
        raw.close()
    assert total == 14 * math.ceil(0.7 * NANO_USD) <= budget.limit


def _policy(url: str, prefix: str, budget: dict[str, Any], **extra: Any) -> str:
    target = openai_target(url, retry={"max_retries": 0})
    return policy_yaml(
        {"fake-openai": target},
        budgets={"shared": budget},
        prices=PRICES,
        redis={"url": SHARED_URL, "key_prefix": prefix, "socket_timeout_s": 5,
               "connect_timeout_s": 5},
        # Stopped at the end: no quiet period (default 1 s) to wait out once nothing is
        # in flight; the drain itself is tests/test_shutdown.py's.
        server={"shutdown": {"quiet_s": 0}},
        **extra,
    )  # fmt: skip


async def test_three_sidecars_share_one_budget(
    upstream_factory, tmp_path: Path, redis_prefix: str
) -> None:
    """Each call's real cost equals its reservation (the cap is used in full), so exactly
    floor(limit / reservation) calls fit across all three sidecars, whatever the order."""
    body = {"model": "fake-model-1", "usage": {"prompt_tokens": 34, "completion_tokens": 10}}

    async def handler(_: web.Request) -> web.StreamResponse:
        return web.json_response(body)

    up = await upstream_factory(handler)
    limit = 22.5
    budget = {"limit_usd": limit, "window": "daily", "scope": "cluster"}
    path = tmp_path / "policy.yaml"
    path.write_text(_policy(up.url, redis_prefix, budget))
    procs = await Process.start_many(3, path, drop_env=("REDIS_URL",), timeout_s=30)
    try:
        assert all(p.calls_url for p in procs), "a sidecar did not start"
        env = envelope(parameters={"model": "fake-model-1", "max_tokens": 10, "messages": MESSAGES})
        async with aiohttp.ClientSession() as session:

            async def post(proc: Process) -> tuple[int, dict[str, Any]]:
                async with session.post(proc.calls_url + "/v1/calls", json=env) as resp:
                    return resp.status, await resp.json()

            results = await asyncio.gather(*(post(procs[i % 3]) for i in range(30)))
        admitted = math.floor(limit / RESERVED_USD)  # 5
        ok = [a for s, a in results if s == 200]
        refused = [a for s, a in results if s != 200]
        assert len(ok) == admitted == up.hits  # the upstream counts what went out
        assert {(a["error"]["code"], a["error"]["retryable"]) for a in refused} == {
            ("BUDGET_EXCEEDED", False)
        }
        assert up.hits * RESERVED_USD <= limit  # the bound: 0 overshoot, reservations exact
        served = {p.calls_url for p, (s, _) in zip(procs * 10, results, strict=True) if s == 200}
        assert served, "no sidecar admitted a call"
    finally:
        for proc in procs:
            proc.terminate()
        await asyncio.gather(*(proc.stop() for proc in procs))


async def test_shadow_cluster_group_books_without_waiting(
    upstream_factory, sidecar_factory, redis_prefix: str
) -> None:
    async def handler(_: web.Request) -> web.StreamResponse:
        return web.json_response({"model": "fake-model-1"})

    up = await upstream_factory(handler)
    group = {"requests_per_second": 0.01, "burst": 1, "max_queue_s": 1, "scope": "cluster"}
    target = openai_target(up.url, rate_limit_group="g", retry={"max_retries": 0})
    sc = await sidecar_factory(
        compile_policy(
            {"fake-openai": target},
            rate_limit_groups={"g": {**group, "mode": "shadow"}},
            redis={"url": SHARED_URL, "key_prefix": redis_prefix},
        )
    )
    for _ in range(2):
        status, _answer = await sc.call(envelope())
        assert status == 200
    first, second = sc.audit_records()
    assert first["decision"] == "allowed"
    assert second["decision"] == "shadow_denied"
    assert second["shadow_denied"] == ["rate_limit_group:g"]
    assert second["rate_limit_wait_ms"] == 0
    assert up.hits == 2


@pytest.mark.parametrize("on_redis_error", ["fail_closed", "fail_open"])
async def test_budget_without_redis(upstream_factory, sidecar_factory, on_redis_error: str):
    async def handler(_: web.Request) -> web.StreamResponse:
        return web.json_response({"usage": {"prompt_tokens": 1, "completion_tokens": 1}})

    up = await upstream_factory(handler)
    budget = {"limit_usd": 100, "window": "daily", "scope": "cluster"}
    budget["on_redis_error"] = on_redis_error
    sc = await sidecar_factory(
        compile_policy(
            {"fake-openai": openai_target(up.url, retry={"max_retries": 0})},
            budgets={"b": budget},
            prices=PRICES,
            redis={
                "url": f"redis://127.0.0.1:{free_port()}/0",  # nothing listens there
                "connect_timeout_s": 0.5,
                "socket_timeout_s": 0.5,
            },
        )
    )
    env = envelope(parameters={"model": "fake-model-1", "max_tokens": 10, "messages": MESSAGES})
    status, answer = await sc.call(env)
    if on_redis_error == "fail_closed":
        assert status == 429
        assert answer["error"]["code"] == CapacityExceeded.code.value
        assert answer["error"]["retryable"] is True
        assert answer["error"]["details"]["reason"] == "redis_unavailable"
        assert up.hits == 0
    else:
        assert status == 200
        assert up.hits == 1
        assert any("Redis unavailable" in w for w in sc.audit_records()[-1]["warnings"])


def test_a_cluster_budget_without_redis_says_it_is_counted_here_alone() -> None:
    """A reload can bring a ``scope: cluster`` budget and its ``redis:`` section to a
    sidecar started without one (Redis needs a restart: the reload's record says so);
    until then each sidecar counts the budget alone, and every call's record says it."""
    budgets = Budgets({"b": BudgetSpec(limit_usd=10, window="daily", scope="cluster")})
    booking = asyncio.run(budgets.reserve(budgets.applying("t", None, "a"), 1.0))
    assert booking.warnings == [
        "budget 'b' (scope: cluster) is counted by this sidecar alone: it runs without "
        "Redis (the redis section needs a restart)"
    ]
    local = Budgets({"b": BudgetSpec(limit_usd=10, window="daily")})
    assert asyncio.run(local.reserve(local.applying("t", None, "a"), 1.0)).warnings == []
