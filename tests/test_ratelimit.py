"""Rate-limit groups: the B + r*T bound (B10), computed rejections, FIFO, tokens, holds."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiolimiter
import pytest

from gateway.errors import CapacityExceeded
from gateway.policy import RateLimitGroupSpec
from gateway.providers import estimate_tokens
from gateway.ratelimit import MAX_PROVIDER_HOLD_S, RateLimitGroup, RateLimitGroups
from gateway.ratelimit.local import _Bucket
from tests.conftest import SOON_S, CountWaits, turns_until

FAR = 1e9  # a deadline that never binds
#: Rounding of a computed wait (the group rounds to milliseconds at most).
EPS = 0.002


def spec(**kw: Any) -> RateLimitGroupSpec:
    base: dict[str, Any] = {"requests_per_second": 10.0, "burst": 1, "max_queue_s": 5.0}
    return RateLimitGroupSpec(**(base | kw))


def now() -> float:
    return asyncio.get_running_loop().time()


def deadline_in(seconds: float) -> float:
    return now() + seconds


def assert_bound(times: list[float], burst: int, rate: float) -> None:
    """Every window [t_i, t_j] holds at most burst + rate * (t_j - t_i) admissions."""
    times = sorted(times)
    for i in range(len(times)):
        for j in range(i, len(times)):
            count = j - i + 1
            allowed = burst + rate * (times[j] - times[i])
            assert count <= allowed + 1e-9, (i, j, count, allowed)


async def poll_until(predicate: Any, timeout: float = 2.0, step: float = 0.002) -> float:
    """Wait (bounded) until predicate() is true; return the loop time it became true."""
    end = now() + timeout
    while not predicate():
        assert now() < end, "condition not reached in time"
        await asyncio.sleep(step)
    return now()


def test_aiolimiter_internals_we_rely_on_exist() -> None:
    # _Bucket reads these; an aiolimiter release that drops them must fail here first.
    limiter = aiolimiter.AsyncLimiter(2, 1)
    assert hasattr(limiter, "_leak")
    assert {"_level", "_last_check"} <= set(aiolimiter.AsyncLimiter.__slots__)


# --- the bound (B10) -----------------------------------------------------------------


@pytest.mark.parametrize(("burst", "rate"), [(3, 100.0), (1, 150.0), (10, 200.0)])
async def test_bound_holds_in_every_window(burst: int, rate: float) -> None:
    admitted: list[float] = []
    group = RateLimitGroup(
        "g", spec(requests_per_second=rate, burst=burst), on_admit=lambda _, t: admitted.append(t)
    )
    rng = random.Random(burst)
    calls = 60

    async def one() -> float:
        return await group.acquire(deadline=FAR)

    tasks = []
    for i in range(calls):
        tasks.append(asyncio.create_task(one()))
        # The first 2B + 1 arrive together, so that some call waits however slowly a
        # loaded machine runs the sleeps that spread the rest.
        if i >= 2 * burst and rng.random() < 0.3:
            await asyncio.sleep(rng.random() * 0.02)  # irregular arrivals, not synchronisation
    waits = await asyncio.gather(*tasks)
    assert len(admitted) == calls
    assert_bound(admitted, burst, rate)  # on the limiter's own admission instants: exact
    # Not stalled either: a loaded machine lengthens the span by its late wake-ups, so
    # over-strictness is shown exactly by the computed waits (test_retry_after_is_the_real_
    # time_until_capacity, test_deadline_shorter_than_max_queue_rejects_at_once); here,
    # no timer far too long.
    span = max(admitted) - min(admitted)
    assert span < (calls - burst) / rate + SOON_S
    assert max(waits) > 0


async def test_true_window_by_burst_one() -> None:
    # "2 calls per 0.2 s" upstream window: burst 1, rate N/W = 10/s -> any 3 calls span >= 0.2 s.
    admitted: list[float] = []
    group = RateLimitGroup(
        "slack", spec(requests_per_second=10.0, burst=1), on_admit=lambda _, t: admitted.append(t)
    )
    await asyncio.gather(*(group.acquire(deadline=FAR) for _ in range(5)))
    for i in range(len(admitted) - 2):
        assert admitted[i + 2] - admitted[i] >= 0.2 - 1e-9
    assert_bound(admitted, 1, 10.0)


async def test_b10_five_calls_two_per_window_rejected_beyond_queue() -> None:
    # B10 scaled down: "2 per 0.5 s" as burst 1, rate 4/s, max_queue_s 0.3. Calls at 0..40 ms.
    group = RateLimitGroup(
        "fake-slack-post", spec(requests_per_second=4.0, burst=1, max_queue_s=0.3)
    )
    results: list[Any] = []

    async def call(delay: float) -> None:
        await asyncio.sleep(delay)
        counted = CountWaits(group.acquire(deadline=deadline_in(30)))
        try:
            results.append(("ok", await counted, counted.waits))
        except CapacityExceeded as exc:
            results.append(("rejected", exc, counted.waits))

    await asyncio.gather(*(call(d / 1000) for d in (0, 10, 20, 30, 40)))
    ok = [r for r in results if r[0] == "ok"]
    rejected = [r for r in results if r[0] == "rejected"]
    assert len(ok) == 2  # one at once, one after 0.25 s; the rest would wait > 0.3 s
    assert len(rejected) == 3
    for _, exc, waits in rejected:
        assert waits == 0  # answered at once, not after waiting
        assert exc.retryable
        assert exc.details["reason"] == "queue_timeout"
        assert 0.3 < exc.retry_after_s <= 0.5 + 0.1


# --- computed rejections ---------------------------------------------------------------


async def test_retry_after_is_the_real_time_until_capacity() -> None:
    group = RateLimitGroup("g", spec(requests_per_second=5.0, burst=2, max_queue_s=0.05))
    first = now()
    await group.acquire(deadline=FAR)
    await group.acquire(deadline=FAR)
    t0 = now()
    counted = CountWaits(group.acquire(deadline=FAR))
    with pytest.raises(CapacityExceeded) as info:
        await counted
    refused = now()  # the refusal read the clock between t0 and this
    assert counted.waits == 0  # computed, not waited for
    exc = info.value
    assert exc.details == {"group": "g", "reason": "queue_timeout", "queued": 0}
    # 0.2 s from the admissions (at or after ``first``), less the time until the refusal
    # (at most ``refused``): bracketed by the clock's readings, whatever the machine's
    # speed (the process may be descheduled between two readings, without any await).
    assert 0.2 - (refused - first) - EPS <= exc.retry_after_s <= 0.2 + EPS
    promised = t0 + exc.retry_after_s

    # The real time until capacity: probe with a zero budget until admitted.
    async def try_once() -> bool:
        try:
            await group.acquire(deadline=now())
        except CapacityExceeded:
            return False
        return True

    refused_at = t0  # the refusal above
    while True:
        probe = now()
        if await try_once():
            admitted_at = probe
            break
        refused_at = probe
        assert probe < t0 + 2
        await asyncio.sleep(0.005)
    # Capacity came after the last refused probe and by the admitting one: the promise
    # lies between them (neither early nor late), however late the probes ran.
    assert refused_at - EPS <= promised <= admitted_at + EPS


async def test_retry_after_counts_the_queue_ahead() -> None:
    group = RateLimitGroup("g", spec(requests_per_second=10.0, burst=1, max_queue_s=1.0))
    first = now()
    await group.acquire(deadline=FAR)
    ahead = [asyncio.create_task(group.acquire(deadline=FAR)) for _ in range(3)]
    await poll_until(lambda: group.queued == 3)
    refused = now()
    with pytest.raises(CapacityExceeded) as info:
        await group.acquire(deadline=deadline_in(0.05))
    # Three waiters ahead at 0.1 s spacing, then this one: 0.4 s from the first call,
    # less the time since (bracketed by the clock's readings).
    assert 0.4 - (refused - first) - EPS <= info.value.retry_after_s <= 0.4 + EPS
    assert info.value.details["reason"] == "deadline"
    waits = await asyncio.gather(*ahead)
    assert waits == sorted(waits)


async def test_deadline_shorter_than_max_queue_rejects_at_once() -> None:
    group = RateLimitGroup("g", spec(requests_per_second=5.0, burst=1, max_queue_s=5.0))
    first = now()
    await group.acquire(deadline=FAR)
    t0 = now()
    counted = CountWaits(group.acquire(deadline=t0 + 0.05))
    with pytest.raises(CapacityExceeded) as info:
        await counted
    refused = now()  # the refusal read the clock between t0 and this
    assert counted.waits == 0  # computed, not waited for
    assert info.value.details["reason"] == "deadline"
    assert 0.2 - (refused - first) - EPS <= info.value.retry_after_s <= 0.2 + EPS
    # A deadline long enough is waited for, and the wait is the predicted one at least
    # (a loaded machine can only add to it: the wake-up is late, never early).
    t1 = now()
    waited = await group.acquire(deadline=deadline_in(SOON_S))
    assert 0.2 - (t1 - first) - EPS <= waited <= now() - t1 + EPS


async def test_waiting_call_returns_seconds_waited() -> None:
    group = RateLimitGroup("g", spec(requests_per_second=20.0, burst=1))
    first = now()
    assert await group.acquire(deadline=FAR) == 0.0
    t0 = now()
    waited = await group.acquire(deadline=FAR)
    # One slot of 1/20 s from the first call at least, less the time since (a loaded
    # machine may take milliseconds between the two calls; late wake-ups can only add),
    # and what was waited: not the planned wait nor 0, at most the time the call took.
    assert 0.05 - (t0 - first) - EPS <= waited <= now() - t0 + EPS


async def test_cancelled_waiter_frees_its_turn() -> None:
    admitted: list[float] = []
    group = RateLimitGroup(
        "g", spec(requests_per_second=10.0, burst=1), on_admit=lambda _, t: admitted.append(t)
    )
    await group.acquire(deadline=FAR)
    b = asyncio.create_task(group.acquire(deadline=FAR))
    c = asyncio.create_task(group.acquire(deadline=FAR))
    await poll_until(lambda: group.queued == 2)
    b.cancel()
    with pytest.raises(asyncio.CancelledError):
        await b
    assert group.queued == 1
    waited = await c
    assert len(admitted) == 2
    # Measured between the admissions, not from c's start (which came a scheduling delay
    # after the first admission): c took b's slot, not the next one at 0.2 s.
    assert 0.1 - EPS <= admitted[1] - admitted[0] < 0.2 - EPS
    assert 0 < waited <= admitted[1] - admitted[0]


# --- FIFO under a large token request --------------------------------------------------


async def test_large_token_request_is_not_starved() -> None:
    # 600 tokens/min = 10 tokens/s. aiolimiter alone would wake the 1-token waiters first.
    order: list[str] = []
    group = RateLimitGroup(
        "llm", spec(requests_per_second=1000.0, burst=100, tokens_per_minute=600)
    )
    await group.acquire(tokens=600, deadline=FAR)  # bucket full

    async def call(name: str, tokens: int) -> float:
        waited = await group.acquire(tokens=tokens, deadline=FAR)
        order.append(name)
        return waited

    large = asyncio.create_task(call("large", 3))
    await poll_until(lambda: group.queued == 1)
    small = [asyncio.create_task(call(f"s{i}", 1)) for i in range(4)]
    await poll_until(lambda: group.queued == 5)
    waits = await asyncio.gather(large, *small)
    assert order == ["large", "s0", "s1", "s2", "s3"]
    assert waits[0] >= 0.3 - EPS  # its 3 tokens at 10/s; late wake-ups only add
    assert waits[1:] == sorted(waits[1:])


async def test_aiolimiter_alone_would_serve_small_first() -> None:
    # The reason for the FIFO: aiolimiter's waiters are a heap ordered by amount.
    limiter = aiolimiter.AsyncLimiter(600, 60)
    await limiter.acquire(600)
    order: list[str] = []

    async def call(name: str, amount: int) -> None:
        await limiter.acquire(amount)
        order.append(name)

    large = asyncio.create_task(call("large", 3))
    await asyncio.sleep(0)
    small = asyncio.create_task(call("small", 1))
    await asyncio.gather(large, small)
    assert order == ["small", "large"]


async def test_token_estimate_larger_than_the_limit_is_refused_for_good() -> None:
    group = RateLimitGroup("llm", spec(tokens_per_minute=1000))
    with pytest.raises(CapacityExceeded) as info:
        await group.acquire(tokens=1001, deadline=FAR)
    assert info.value.retryable is False
    assert info.value.details["reason"] == "too_large"
    assert info.value.retry_after_s is None


# --- reconcile ------------------------------------------------------------------------


async def test_reconcile_refunds_and_charges() -> None:
    group = RateLimitGroup(
        "llm", spec(requests_per_second=1000.0, burst=100, tokens_per_minute=600, max_queue_s=0.0)
    )
    await group.acquire(tokens=600, deadline=FAR)
    with pytest.raises(CapacityExceeded):
        await group.acquire(tokens=400, deadline=FAR)
    group.reconcile(600, 100)  # refund 500
    assert await group.acquire(tokens=400, deadline=FAR) == 0.0
    group.reconcile(400, 1000)  # charge 600 more: ~1100 in a 600 bucket
    with pytest.raises(CapacityExceeded) as info:
        await group.acquire(tokens=10, deadline=FAR)
    # (1100 + 10 - 600) tokens at 10 tokens/s.
    assert info.value.retry_after_s == pytest.approx(51.0, abs=0.1)


async def test_charge_refuses_waiters_it_pushes_past_their_budget() -> None:
    group = RateLimitGroup(
        "llm", spec(requests_per_second=1000.0, burst=100, tokens_per_minute=600, max_queue_s=1.0)
    )
    await group.acquire(tokens=600, deadline=FAR)
    waiter = asyncio.create_task(group.acquire(tokens=5, deadline=FAR))  # ~0.5 s
    await poll_until(lambda: group.queued == 1)
    group.reconcile(600, 700)  # +100 tokens: now ~10.5 s away
    await turns_until(waiter.done)  # refused at once, not when its budget ends
    with pytest.raises(CapacityExceeded) as info:
        await waiter
    assert info.value.retry_after_s == pytest.approx(10.5, abs=0.1)


async def test_refund_admits_waiters_early() -> None:
    group = RateLimitGroup(
        "llm", spec(requests_per_second=1000.0, burst=100, tokens_per_minute=600, max_queue_s=60)
    )
    await group.acquire(tokens=600, deadline=FAR)
    waiter = asyncio.create_task(group.acquire(tokens=300, deadline=FAR))  # 30 s away
    await poll_until(lambda: group.queued == 1)
    group.reconcile(600, 0)
    await turns_until(waiter.done)  # at once, not in 30 s
    await waiter


async def test_tokens_ignored_without_a_token_limit() -> None:
    group = RateLimitGroup("g", spec(requests_per_second=1000.0, burst=2))
    assert await group.acquire(tokens=10**9, deadline=FAR) == 0.0
    group.reconcile(10**9, 5)  # no-op


# --- provider holds -------------------------------------------------------------------


async def test_hold_for_delays_then_admits() -> None:
    group = RateLimitGroup("g", spec(requests_per_second=1000.0, burst=10))
    group.hold_for(0.1, reason="retry-after")
    held = group.held_for_s()
    assert 0 < held <= 0.1
    t0 = now()
    waited = await group.acquire(deadline=FAR)
    assert held - EPS <= waited <= now() - t0 + EPS  # the hold, waited (not skipped)


async def test_hold_past_budget_rejects_new_and_waiting_calls() -> None:
    group = RateLimitGroup("g", spec(requests_per_second=1000.0, burst=10, max_queue_s=0.3))
    group.hold_for(0.1, reason="x-ratelimit-reset-requests")
    waiter = asyncio.create_task(group.acquire(deadline=FAR))
    await poll_until(lambda: group.queued == 1)
    group.hold_for(5.0, reason="retry-after")
    await turns_until(waiter.done)  # at once, not when the hold or the budget ends
    with pytest.raises(CapacityExceeded) as info:
        await waiter
    assert info.value.details["reason"] == "provider_hold"
    assert info.value.details["hold"] == "retry-after"
    assert info.value.retry_after_s == pytest.approx(5.0, abs=0.05)
    with pytest.raises(CapacityExceeded) as info2:
        await group.acquire(deadline=FAR)
    assert info2.value.details["reason"] == "provider_hold"
    assert info2.value.retry_after_s == pytest.approx(5.0, abs=0.05)


async def test_hold_only_extends_and_is_capped() -> None:
    group = RateLimitGroup("g", spec())
    group.hold_for(1.0, reason="a")
    group.hold_for(0.1, reason="b")  # shorter: ignored
    assert group.held_for_s() > 0.9
    group.hold_for(10 * MAX_PROVIDER_HOLD_S, reason="bogus")
    assert group.held_for_s() <= MAX_PROVIDER_HOLD_S
    group.hold_for(-1, reason="nonsense")
    group.hold_for(float("nan"), reason="nonsense")
    assert group.held_for_s() > MAX_PROVIDER_HOLD_S - 1


# --- registry and reload ----------------------------------------------------------------


async def test_groups_update_keeps_unchanged_state() -> None:
    groups = RateLimitGroups(
        {"a": spec(burst=1, max_queue_s=0.0), "b": spec(burst=1, max_queue_s=0.0)}
    )
    a, b = groups.get("a"), groups.get("b")
    assert a is not None
    assert b is not None
    assert groups.get("zzz") is None
    await a.acquire(deadline=FAR)
    await b.acquire(deadline=FAR)
    groups.update(
        {"a": spec(burst=1, max_queue_s=0.0), "b": spec(burst=2, max_queue_s=0.0), "c": spec()}
    )
    assert groups.get("a") is a  # unchanged: same state, still empty of capacity
    with pytest.raises(CapacityExceeded):
        await a.acquire(deadline=FAR)
    new_b = groups.get("b")
    assert new_b is not None
    assert new_b is not b
    assert new_b.spec.burst == 2
    # The changed group starts from the old usage (1 of 2 used): one more fits, not two.
    await new_b.acquire(deadline=FAR)
    with pytest.raises(CapacityExceeded):
        await new_b.acquire(deadline=FAR)
    assert groups.names() == ["a", "b", "c"]
    groups.update({"c": spec()})
    assert groups.get("a") is None


async def test_bucket_projection_matches_aiolimiter() -> None:
    bucket = _Bucket(capacity=2, rate_per_s=10.0)
    assert bucket.has_capacity(2)
    bucket.add(2)
    projection = bucket.projection()
    at = projection.fit_at(1, projection.at)
    assert at == pytest.approx(projection.at + 0.1)
    await poll_until(lambda: now() >= at)
    assert bucket.has_capacity(1)


# --- estimate_tokens ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [
        ({}, 0),
        ({"channel": "C0FAKE", "text": "deploy done"}, 0),
        ({"max_tokens": 100}, 100),
        ({"max_completion_tokens": 50, "max_tokens": 20}, 50),
        ({"max_output_tokens": 7, "input": "abcd"}, 8),
        ({"max_tokens": True}, 0),
        ({"max_tokens": -5, "prompt": "abcde"}, 2),
        ({"prompt": "é" * 4}, 2),  # 8 UTF-8 bytes
        ({"messages": [{"role": "user", "content": "hi"}]}, 8),  # 30 bytes of JSON
        ({"generationConfig": {"maxOutputTokens": 64}, "contents": "abcd"}, 65),
    ],
)
def test_estimate_tokens(parameters: dict[str, Any], expected: int) -> None:
    assert estimate_tokens(parameters) == expected


async def test_changed_token_group_inherits_usage_and_hold() -> None:
    groups = RateLimitGroups(
        {"llm": spec(requests_per_second=1000.0, burst=100, tokens_per_minute=600)}
    )
    old = groups.get("llm")
    assert old is not None
    await old.acquire(tokens=600, deadline=FAR)
    old.hold_for(0.05, reason="retry-after")
    groups.update({"llm": spec(requests_per_second=1000.0, burst=100, tokens_per_minute=1200)})
    new = groups.get("llm")
    assert new is not None
    assert new is not old
    assert new.held_for_s() > 0  # the provider's hold survives a reload
    waited = await new.acquire(tokens=600, deadline=FAR)  # 600 of 1200 were used
    assert waited <= 0.1
    with pytest.raises(CapacityExceeded) as info:
        await new.acquire(tokens=100, deadline=now())
    assert info.value.details["reason"] == "deadline"
    assert info.value.retry_after_s == pytest.approx(5.0, abs=0.1)  # 100 tokens at 20/s
