"""A 429 that does not say when to come back is not retried at once: full jitter may
draw a wait near zero, so the wait has a floor (within the target's ``backoff_max_s``)."""

from __future__ import annotations

import random

from aiohttp import web

from gateway.call.retry import RATE_LIMITED_FLOOR_S, Outcome, RetryBudget, next_step
from gateway.errors import CapacityExceeded, DependencyFailed
from tests.conftest import compile_policy, envelope, openai_target

BUDGET = RetryBudget(retries=3, deadline=1e9, backoff_base_s=0.5, backoff_max_s=20.0)


def _limited() -> Outcome:
    error = CapacityExceeded("slow down", status_code=429, details={"source": "upstream"})
    return Outcome(error, retryable=True)


def test_every_draw_waits_at_least_the_floor() -> None:
    rng = random.Random(3)
    waits = [next_step(_limited(), n % 3, BUDGET, 0.0, rng).wait_s for n in range(300)]
    assert min(w for w in waits if w is not None) >= RATE_LIMITED_FLOOR_S
    # Three retries of a 429 cannot all happen within three seconds.
    assert RATE_LIMITED_FLOOR_S * 3 >= 3.0


def test_the_floor_stays_within_the_backoff_cap() -> None:
    capped = BUDGET._replace(backoff_max_s=0.05)
    step = next_step(_limited(), 0, capped, 0.0, random.Random(1))
    assert step.wait_s == 0.05


def test_retry_after_and_other_failures_keep_their_waits() -> None:
    said = _limited()._replace(retry_after_s=0.2)
    assert next_step(said, 0, BUDGET, 0.0, random.Random(1)).wait_s == 0.2
    failed = Outcome(DependencyFailed("x", status_code=503), retryable=True)
    draws = [next_step(failed, 0, BUDGET, 0.0, random.Random(s)).wait_s for s in range(50)]
    assert min(w for w in draws if w is not None) < RATE_LIMITED_FLOOR_S


async def test_a_429_without_retry_after_is_resent_no_sooner_than_the_floor(
    upstream_factory, sidecar_factory
):
    async def limited(_: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "slow", "type": "rate_limit"}}, status=429)

    up = await upstream_factory(limited)
    target = openai_target(up.url, retry={"max_retries": 1, "backoff_base_s": 0.001})
    sc = await sidecar_factory(compile_policy({"fake-openai": target}))
    _, body = await sc.call(envelope(max_retries=1, timeout=10))
    assert body["error"]["code"] == "CAPACITY_EXCEEDED"
    assert up.hits == 2
    assert up.seen[1].at - up.seen[0].at >= RATE_LIMITED_FLOOR_S
