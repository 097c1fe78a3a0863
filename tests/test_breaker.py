"""Circuit breakers: B07 (opens on failed attempts), B09 (4xx never opens), one probe."""

from __future__ import annotations

import asyncio
import io
import json
import time

import pytest

from gateway.audit import log as audit
from gateway.breaker import (
    MIN_PROBE_RETRY_AFTER_S,
    BreakerState,
    CircuitBreakers,
    Permit,
    TargetBreaker,
    breaker_specs,
    is_failure,
)
from gateway.errors import CircuitOpen
from gateway.policy import BreakerSpec, parse_policy
from tests.conftest import calls_made

ATTEMPT_S = 1.0
#: Rounding of a computed Retry-After (milliseconds at most).
EPS = 0.002


def breaker(fail_max: int = 3, reset_timeout_s: float = 30.0) -> TargetBreaker:
    return TargetBreaker(
        "fake-openai", BreakerSpec(fail_max=fail_max, reset_timeout_s=reset_timeout_s)
    )


async def until_probe_due(b: TargetBreaker, timeout: float = 2.0) -> None:
    """Bounded poll until the reset timeout has elapsed."""
    end = time.monotonic() + timeout
    while b.seconds_until_probe() > 0:
        assert time.monotonic() < end, "reset timeout never elapsed"
        await asyncio.sleep(0.005)


def fail_times(b: TargetBreaker, n: int, status: int = 500) -> None:
    for _ in range(n):
        b.acquire(attempt_timeout_s=ATTEMPT_S).record(status, None)


@pytest.mark.parametrize(
    ("status", "exc_kind", "expected"),
    [
        (500, None, True),
        (502, None, True),
        (503, None, True),
        (504, None, True),
        (529, None, True),
        (599, None, True),
        (200, None, False),
        (204, None, False),
        (301, None, False),
        (400, None, False),
        (401, None, False),
        (404, None, False),
        (409, None, False),
        (429, None, False),
        (None, "timeout", True),
        (None, "connect", True),
        (None, "reset", True),
        (None, "cancelled", False),
        (None, "response_too_large", False),
        (None, None, False),
    ],
)
def test_is_failure(status: int | None, exc_kind: str | None, expected: bool) -> None:
    assert is_failure(status, exc_kind) is expected


async def test_b07_three_failed_attempts_open_it_and_later_calls_fail_fast() -> None:
    b = breaker(fail_max=3, reset_timeout_s=30.0)
    upstream_hits = 0
    for _ in range(3):
        permit = b.acquire(attempt_timeout_s=ATTEMPT_S)
        upstream_hits += 1
        permit.failure()
    assert b.state == "open"
    for _ in range(2):
        with calls_made() as calls, pytest.raises(CircuitOpen) as info:
            b.acquire(attempt_timeout_s=ATTEMPT_S)
        # Fails fast: synchronous, a few dozen calls, nothing that sleeps or blocks.
        assert len(calls) < 200, calls
        assert not {"sleep", "select", "poll"} & set(calls), calls
        exc = info.value
        assert exc.retryable is True
        assert exc.details == {"target": "fake-openai", "state": "open"}
        assert exc.retry_after_s is not None
        assert 0 < exc.retry_after_s <= 30
        assert exc.retry_after_s > 29  # it just opened
    assert upstream_hits == 3


@pytest.mark.parametrize("kind", ["timeout", "connect", "reset"])
async def test_b07_connection_failures_count_too(kind: str) -> None:
    b = breaker(fail_max=3)
    for _ in range(3):
        b.acquire(attempt_timeout_s=ATTEMPT_S).record(None, kind)
    assert b.state == "open"


@pytest.mark.parametrize("status", [400, 401, 403, 404, 409, 422, 429])
async def test_b09_client_errors_never_open_it(status: int) -> None:
    b = breaker(fail_max=3)
    for _ in range(5):
        b.acquire(attempt_timeout_s=ATTEMPT_S).record(status, None)
        assert b.state == "closed"
    b.acquire(attempt_timeout_s=ATTEMPT_S).record(200, None)
    assert b.state == "closed"
    assert b.failures == 0


async def test_b09_control_six_503_do_open_it() -> None:
    b = breaker(fail_max=3)
    opened_after = None
    for i in range(6):
        try:
            permit = b.acquire(attempt_timeout_s=ATTEMPT_S)
        except CircuitOpen:
            opened_after = opened_after or i
            continue
        permit.record(503, None)
    assert b.state == "open"
    assert opened_after == 3


async def test_failures_must_be_consecutive() -> None:
    b = breaker(fail_max=3)
    fail_times(b, 2)
    b.acquire(attempt_timeout_s=ATTEMPT_S).success()
    fail_times(b, 2)
    assert b.state == "closed"
    assert b.failures == 2
    fail_times(b, 1)
    assert b.state == "open"


async def test_cancelled_attempts_count_nothing() -> None:
    b = breaker(fail_max=2)
    fail_times(b, 1)
    for _ in range(5):
        b.acquire(attempt_timeout_s=ATTEMPT_S).record(None, "cancelled")
    assert b.failures == 1  # neither counted as failure nor as success
    assert b.state == "closed"


async def test_half_open_lets_exactly_one_probe_through() -> None:
    b = breaker(fail_max=1, reset_timeout_s=0.03)
    fail_times(b, 1)
    assert b.state == "open"
    await until_probe_due(b)

    async def try_acquire() -> Permit | CircuitOpen:
        await asyncio.sleep(0)
        try:
            return b.acquire(attempt_timeout_s=0.5)
        except CircuitOpen as exc:
            return exc

    started = time.monotonic()
    results = await asyncio.gather(*(try_acquire() for _ in range(10)))
    took = time.monotonic() - started
    permits = [r for r in results if isinstance(r, Permit)]
    refused = [r for r in results if isinstance(r, CircuitOpen)]
    assert len(permits) == 1
    assert permits[0].probe is True
    assert len(refused) == 9
    for exc in refused:
        assert exc.details == {"target": "fake-openai", "state": "half_open"}
        assert exc.retry_after_s is not None
        # The probe's remaining attempt time: 0.5 s less what passed since the probe
        # began, bracketed by the clock's readings whatever the machine's speed.
        assert max(0.5 - took, MIN_PROBE_RETRY_AFTER_S) - EPS <= exc.retry_after_s <= 0.5
    assert b.state == "half_open"


async def test_probe_retry_after_has_a_floor() -> None:
    b = breaker(fail_max=1, reset_timeout_s=0.02)
    fail_times(b, 1)
    await until_probe_due(b)
    b.acquire(attempt_timeout_s=0.01)
    with pytest.raises(CircuitOpen) as info:
        b.acquire(attempt_timeout_s=0.01)
    assert info.value.retry_after_s == MIN_PROBE_RETRY_AFTER_S


async def test_probe_success_closes() -> None:
    b = breaker(fail_max=2, reset_timeout_s=0.02)
    fail_times(b, 2)
    await until_probe_due(b)
    probe = b.acquire(attempt_timeout_s=ATTEMPT_S)
    probe.record(200, None)
    assert b.state == "closed"
    assert b.failures == 0
    assert b.acquire(attempt_timeout_s=ATTEMPT_S).probe is False


async def test_probe_failure_reopens_for_another_reset_timeout() -> None:
    b = breaker(fail_max=2, reset_timeout_s=0.05)
    fail_times(b, 2)
    await until_probe_due(b)
    probe = b.acquire(attempt_timeout_s=ATTEMPT_S)
    reopened = time.monotonic()
    probe.record(503, None)
    assert b.state == "open"
    with pytest.raises(CircuitOpen) as info:
        b.acquire(attempt_timeout_s=ATTEMPT_S)
    took = time.monotonic() - reopened
    assert info.value.details["state"] == "open"
    assert info.value.retry_after_s is not None
    # Another reset timeout (0.05 s) from the reopening, bracketed by the clock.
    assert 0.05 - took - EPS <= info.value.retry_after_s <= 0.05


async def test_released_probe_neither_closes_nor_opens_and_frees_the_slot() -> None:
    b = breaker(fail_max=1, reset_timeout_s=0.02)
    fail_times(b, 1)
    await until_probe_due(b)
    probe = b.acquire(attempt_timeout_s=ATTEMPT_S)
    with pytest.raises(CircuitOpen):
        b.acquire(attempt_timeout_s=ATTEMPT_S)
    probe.record(None, "cancelled")  # the agent hung up mid-probe
    assert b.state == "half_open"
    probe.success()  # settling twice is ignored
    assert b.state == "half_open"
    second = b.acquire(attempt_timeout_s=ATTEMPT_S)  # the slot is free again
    assert second.probe is True
    second.failure()
    assert b.state == "open"


async def test_probe_past_its_attempt_time_frees_the_slot() -> None:
    b = breaker(fail_max=1, reset_timeout_s=0.02)
    fail_times(b, 1)
    await until_probe_due(b)
    lost = b.acquire(attempt_timeout_s=0.03)
    end = time.monotonic() + 2
    while True:
        try:
            fresh = b.acquire(attempt_timeout_s=ATTEMPT_S)
            break
        except CircuitOpen:
            assert time.monotonic() < end
            await asyncio.sleep(0.005)
    assert fresh.probe is True
    lost.success()  # a stale probe does not speak for the breaker any more
    assert b.state == "half_open"
    fresh.success()
    assert b.state == "closed"


async def test_outcomes_of_permits_from_before_it_opened_are_ignored() -> None:
    b = breaker(fail_max=2, reset_timeout_s=30)
    early = [b.acquire(attempt_timeout_s=ATTEMPT_S) for _ in range(3)]
    early[0].failure()
    early[1].failure()
    assert b.state == "open"
    early[2].success()  # in flight when it opened: must not close it
    assert b.state == "open"


async def test_state_change_callbacks_and_hot_reload() -> None:
    changes: list[tuple[str, BreakerState, BreakerState]] = []
    registry = CircuitBreakers({"a": BreakerSpec(fail_max=1, reset_timeout_s=0.02), "b": None})
    registry.on_state_change(lambda t, old, new: changes.append((t, old, new)))
    assert registry.get("b") is None
    a = registry.get("a")
    assert a is not None
    fail_times(a, 1)
    await until_probe_due(a)
    a.acquire(attempt_timeout_s=ATTEMPT_S).failure()
    await until_probe_due(a)
    a.acquire(attempt_timeout_s=ATTEMPT_S).success()
    assert changes == [
        ("a", "closed", "open"),
        ("a", "open", "half_open"),
        ("a", "half_open", "open"),
        ("a", "open", "half_open"),
        ("a", "half_open", "closed"),
    ]

    fail_times(a, 1)
    registry.update({"a": BreakerSpec(fail_max=5, reset_timeout_s=60), "b": BreakerSpec()})
    assert registry.get("a") is a  # kept, still open, new limits
    assert a.state == "open"
    assert a.spec.fail_max == 5
    assert registry.get("b") is not None
    registry.update({"b": BreakerSpec()})
    assert registry.get("a") is None


async def test_failing_hook_is_logged_and_does_not_break_the_breaker() -> None:
    stream = io.StringIO()
    audit.configure_logging(stream)
    seen: list[str] = []

    def bad_hook(target: str, old: BreakerState, new: BreakerState) -> None:
        raise RuntimeError("metrics backend down")

    registry = CircuitBreakers({"a": BreakerSpec(fail_max=1)})
    registry.on_state_change(bad_hook)
    registry.on_state_change(lambda t, old, new: seen.append(new))
    a = registry.get("a")
    assert a is not None
    try:
        fail_times(a, 1)
    finally:
        audit.configure_logging()
    assert a.state == "open"
    assert seen == ["open"]
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    failed = [line for line in lines if line.get("event") == "breaker_hook_failed"]
    assert len(failed) == 1
    assert failed[0]["target"] == "a"
    assert failed[0]["new_state"] == "open"


def test_breaker_specs_from_policy() -> None:
    policy = parse_policy(
        """
version: 1
agent_id: planner-01
targets:
  with:
    base_url: https://api.example.com
    endpoints: [{path: /v1/x, methods: [POST]}]
    circuit_breaker: {fail_max: 3, reset_timeout_s: 30}
  without:
    base_url: https://api.example.org
    endpoints: [{path: /v1/x, methods: [POST]}]
    circuit_breaker: null
"""
    )
    specs = breaker_specs(policy.targets)
    assert specs["with"] == BreakerSpec(fail_max=3, reset_timeout_s=30)
    assert specs["without"] is None
    registry = CircuitBreakers(specs)
    assert registry.get("with") is not None
    assert registry.get("without") is None
