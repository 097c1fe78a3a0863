"""The stop switch's pure parts and its in-process behaviour: which stop holds a call,
which reasons are refused, what a stored stop reads back as, and a stop cancelling the
tasks it covers (and only those) with AGENT_STOPPED instead of CancelledError; the
repeated-call breaker's cluster count with Redis down (fail_open counts locally,
fail_closed refuses, retryable)."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from gateway.agents.controls import Stop, StopSwitch, check_reason, stop_for
from gateway.agents.repeats import Operation, RepeatedCalls
from gateway.errors import AgentStopped, CapacityExceeded
from gateway.policy.controls import RepeatedCallsSpec, StopSwitchSpec
from gateway.policy.stores import RedisSpec
from gateway.stores.redis import RedisClient
from tests.redis_fixtures import PrivateRedis, private_redis

__all__ = ["private_redis"]  # fixture, imported for pytest


def _stop(scope: str, name: str = "", reason: str = "r") -> Stop:
    return Stop(scope=scope, name=name, reason=reason, by="ops", at=1.0)  # type: ignore[arg-type]


ALL, AGENT, TARGET = _stop("all"), _stop("agent", "a1"), _stop("target", "t1")


@pytest.mark.parametrize(
    ("stops", "agent", "target", "expected"),
    [
        ([], "a1", "t1", None),
        ([AGENT], "a1", "t1", AGENT),
        ([AGENT], "a2", "t1", None),
        ([TARGET], "a2", "t1", TARGET),
        ([TARGET], "a1", "t2", None),
        ([TARGET], "a1", None, None),
        ([TARGET, AGENT], "a1", "t1", AGENT),  # the agent's stop before the target's
        ([TARGET, AGENT, ALL], "a1", "t1", ALL),  # the fleet's first
        ([ALL], "anyone", None, ALL),
    ],
)
def test_which_stop_holds_a_call(
    stops: list[Stop], agent: str, target: str | None, expected: Stop | None
) -> None:
    assert stop_for({s.key: s for s in stops}, agent, target) == expected


@pytest.mark.parametrize(
    ("reason", "problem"),
    [
        ("", "a reason is required"),
        ("   ", "a reason is required"),
        ("x" * 501, "longer than 500"),
        ("line\nbreak", "control character"),
        ("tab\there", "control character"),
        ("esc\x1b[0m", "control character"),
        ("c1\x85in the middle", "control character"),
        ("sep\u2028in the middle", "control character"),
    ],
)
def test_bad_reasons_are_refused(reason: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        check_reason(reason)


def test_a_good_reason_is_kept_stripped() -> None:
    assert check_reason("  INC-4411: looping, über 9000 calls  ") == (
        "INC-4411: looping, über 9000 calls"
    )


def test_a_stop_reads_back_as_written_and_foreign_values_are_refused() -> None:
    stop = _stop("agent", "a1", "why")
    assert Stop.from_json(stop.to_json()) == stop
    for junk in ('{"scope": "planet"}', "[]", '"all"'):
        with pytest.raises(ValueError, match="not a stop"):
            Stop.from_json(junk)


async def test_a_stop_cancels_the_calls_it_covers_and_only_those() -> None:
    switch = StopSwitch(StopSwitchSpec())
    gate = asyncio.Event()

    async def call(agent: str, target: str) -> str:
        with switch.track(agent, target):
            await gate.wait()
            return "done"

    covered = asyncio.create_task(call("a1", "t1"))
    other = asyncio.create_task(call("a2", "t2"))
    await asyncio.sleep(0)  # both are inside track()
    assert switch.inflight == 2
    assert await switch.stop(_stop("target", "t1", "incident")) is True
    with pytest.raises(AgentStopped) as caught:
        await covered
    assert caught.value.details == {"scope": "target", "name": "t1", "reason": "incident"}
    gate.set()
    assert await other == "done"
    assert switch.inflight == 0
    with pytest.raises(AgentStopped):
        switch.check("a2", "t1")
    assert await switch.resume("target", "t1") == (True, True)
    switch.check("a2", "t1")


async def test_a_cancellation_that_is_not_a_stop_still_propagates() -> None:
    switch = StopSwitch(StopSwitchSpec())

    async def call() -> None:
        with switch.track("a1", "t1"):
            await asyncio.Event().wait()

    task = asyncio.create_task(call())
    await asyncio.sleep(0)
    task.cancel()  # the agent hung up, or the shutdown
    with pytest.raises(asyncio.CancelledError):
        await task
    assert switch.inflight == 0


@pytest.mark.parametrize("on_error", ["fail_open", "fail_closed"])
async def test_a_cluster_count_with_redis_down(private_redis: PrivateRedis, on_error: str) -> None:
    spec = RepeatedCallsSpec(max_repeats=1, window_s=60, scope="cluster", on_redis_error=on_error)  # type: ignore[arg-type]
    client = RedisClient(
        RedisSpec(
            url=private_redis.url, key_prefix="egw", socket_timeout_s=0.2, connect_timeout_s=0.2
        )
    )
    breaker = RepeatedCalls(spec, redis=client)
    op = [Operation("/v1/x", b'"call"')]
    try:
        assert await breaker.check("a1", op) == ()
        private_redis.kill()
        if on_error == "fail_closed":
            with pytest.raises(CapacityExceeded) as caught:
                await breaker.check("a1", op)
            assert caught.value.retryable is True
            assert caught.value.details["reason"] == "redis_unavailable"
        else:
            assert await breaker.check("a1", op) == ()  # counted here alone: the first
            [refusal] = await breaker.check("a1", op)
            assert refusal.details["count"] == 2
    finally:
        await client.aclose()


async def test_a_cluster_count_key_is_the_fleets(private_redis: PrivateRedis) -> None:
    """Every sidecar of a fleet, of any version, names a counted call alike in Redis:
    ``repeat:`` and the SHA-256 hex of ``AGENT\\n`` and the SHA-256 hex of the call's
    canonical bytes (whatever hash a local count uses)."""
    spec = RepeatedCallsSpec(max_repeats=5, window_s=60, scope="cluster")
    client = RedisClient(RedisSpec(url=private_redis.url, key_prefix="egw"))
    canonical = b'{"endpoint":"/v1/x"}'
    try:
        assert (
            await RepeatedCalls(spec, redis=client).check("a1", [Operation("/v1/x", canonical)])
            == ()
        )
        listed = await client.script("return redis.call('KEYS', ARGV[1])")([], ["egw:repeat:*"])
        inner = hashlib.sha256(canonical).hexdigest()
        expected = "egw:repeat:" + hashlib.sha256(f"a1\n{inner}".encode()).hexdigest()
        assert [k.decode() if isinstance(k, bytes) else k for k in listed] == [expected]
    finally:
        await client.aclose()


async def test_a_sidecar_that_starts_without_redis_refuses_until_it_has_read_the_stops(
    private_redis: PrivateRedis,
) -> None:
    """``fail_open`` keeps the last state read; a sidecar that has read none (it started
    while Redis was down: a stop of the fleet may be in force) refuses every call with
    ``stop_state_unavailable`` until its first read, then obeys what it read."""
    client = RedisClient(
        RedisSpec(
            url=private_redis.url, key_prefix="egw", socket_timeout_s=0.2, connect_timeout_s=0.2
        )
    )
    private_redis.kill()
    switch = StopSwitch(StopSwitchSpec(scope="cluster", poll_interval_s=0.1), redis=client)
    try:
        await switch.start()
        with pytest.raises(AgentStopped) as caught:
            switch.check("a2", "t1")
        assert caught.value.details["reason"] == "stop_state_unavailable"
        private_redis.start()  # (empty: it keeps nothing across a restart)
        other = RedisClient(RedisSpec(url=private_redis.url, key_prefix="egw"))
        try:  # another sidecar's stop of the fleet
            writer = StopSwitch(StopSwitchSpec(scope="cluster"), redis=other)
            assert await writer.stop(_stop("agent", "a1", "runaway"))
        finally:
            await other.aclose()
        for _ in range(200):  # bounded: the watcher reads within poll_interval_s
            if switch.stops:
                break
            await asyncio.sleep(0.05)
        switch.check("a2", "t1")  # read: a2 is not stopped
        with pytest.raises(AgentStopped) as caught:
            switch.check("a1", "t1")
        assert caught.value.details["reason"] == "runaway"
        private_redis.kill()
        for _ in range(200):  # the watcher notices Redis is gone
            if switch._unavailable:
                break
            await asyncio.sleep(0.05)
        assert switch._unavailable
        switch.check("a2", "t1")  # fail_open: the last state read holds
        with pytest.raises(AgentStopped) as caught:
            switch.check("a1", "t1")
        assert caught.value.details["reason"] == "runaway"
    finally:
        await switch.aclose()
        await client.aclose()
