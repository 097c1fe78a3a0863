"""A call that the upstream answered only with error statuses (5xx, 429, 4xx), and that
reported no usage, books nothing: the providers do not bill them, so its reservation is
released at once, and an outage cannot hold a budget until its window ends. A call the
upstream may have processed (a 2xx without usage, a request lost after it was sent)
keeps its reservation, its cost unknown."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web

from tests.test_budgets import (
    ACTUAL_USD,
    COMPLETION,
    RESERVED_USD,
    call,
    daily,
    policy,
    spent_usd,
)

# One reservation fits, two do not: a kept reservation refuses the next call.
LIMIT_USD = RESERVED_USD * 1.5


def _answers(*statuses: int):
    """An upstream that answers ``statuses`` in turn (a status without usage), then the
    completion with its usage."""
    queue = list(statuses)

    async def handler(_: web.Request) -> web.StreamResponse:
        if queue:
            status = queue.pop(0)
            return web.json_response({"error": {"message": f"status {status}"}}, status=status)
        return web.json_response(COMPLETION)

    return handler


@pytest.mark.parametrize(
    ("statuses", "retries"),
    [([500], 0), ([503, 502, 500], 2), ([429], 0), ([529, 429], 1), ([400], 0)],
    ids=["500", "5xx-retried", "429", "529-then-429", "400"],
)
async def test_a_call_answered_only_with_errors_releases_its_reservation(
    upstream_factory: Any, sidecar_factory: Any, statuses: list[int], retries: int
) -> None:
    up = await upstream_factory(_answers(*statuses))
    retry = {"max_retries": retries, "backoff_base_s": 0.001, "backoff_max_s": 0.002}
    sc = await sidecar_factory(policy(up.url, {"day": daily(LIMIT_USD)}, target={"retry": retry}))
    status, failed = await sc.call(call())
    assert failed["success"] is False
    assert up.hits == len(statuses)
    assert spent_usd(sc, "day") == 0.0  # released: nothing booked
    assert sc.audit_records()[-1]["cost_reason"] == "not_billed"
    status, answer = await sc.call(call())  # fits the budget: passes
    assert status == 200, answer
    assert spent_usd(sc, "day") == pytest.approx(ACTUAL_USD)


async def test_a_call_the_upstream_may_have_processed_keeps_its_reservation(
    upstream_factory: Any, sidecar_factory: Any
) -> None:
    async def no_usage(_: web.Request) -> web.StreamResponse:
        return web.json_response({"choices": []})  # a 2xx without usage: cost unknown

    up = await upstream_factory(no_usage)
    sc = await sidecar_factory(policy(up.url, {"day": daily(LIMIT_USD)}))
    status, _ = await sc.call(call())
    assert status == 200
    assert spent_usd(sc, "day") == pytest.approx(RESERVED_USD)  # kept
    assert sc.audit_records()[-1]["cost_reason"] == "usage_unknown"
    status, refused = await sc.call(call())
    assert (status, refused["error"]["code"]) == (429, "BUDGET_EXCEEDED")


async def test_a_lost_attempt_keeps_its_reservation(
    upstream_factory: Any, sidecar_factory: Any
) -> None:
    """An attempt sent and unanswered (timed out) may have been billed: its reservation
    is kept, although no answer, let alone a 2xx, came."""
    release = asyncio.Event()

    async def silent(_: web.Request) -> web.StreamResponse:
        await release.wait()  # never answered in time
        return web.json_response({"error": {"message": "late"}}, status=500)

    up = await upstream_factory(silent)
    target = {"timeout_s": 0.2}
    sc = await sidecar_factory(policy(up.url, {"day": daily(LIMIT_USD)}, target=target))
    _, failed = await sc.call(call())
    release.set()
    assert failed["error"]["code"] == "OUTCOME_UNKNOWN", failed
    assert up.hits == 1
    assert spent_usd(sc, "day") == pytest.approx(RESERVED_USD)  # kept
    assert sc.audit_records()[-1]["cost_reason"] == "usage_unknown"
