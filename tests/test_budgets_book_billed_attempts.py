"""A budget books every attempt the provider may have billed.

A call resent after an attempt that may have been billed (the request was sent and its
answer lost, its answer cut mid-way, or refused at a redirect after the upstream
answered) books each such attempt, since the provider may have charged for it; a resend
the budget cannot cover is not sent. The bound of docs/features/budgets.md holds across
retries. Real sidecar, loopback upstream counting its hits.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from tests.conftest import FakeUpstream, Sidecar
from tests.test_budgets import (
    ACTUAL_USD,
    COMPLETION,
    RESERVED_USD,
    call,
    daily,
    policy,
    spent_usd,
)

RETRYING = {
    "retry": {"max_retries": 1, "backoff_base_s": 0.01, "backoff_max_s": 0.02},
    "timeout_s": 0.3,
    "idempotency": {"header": "Idempotency-Key", "methods": ["POST"]},
}


async def test_a_resent_call_books_the_attempt_whose_answer_was_lost(
    upstream_factory: Any, sidecar_factory: Any
) -> None:
    stop = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        if upstream.hits == 1:  # read and worked on, then the answer never comes in time
            await asyncio.wait_for(stop.wait(), 10)
        return web.json_response(COMPLETION)

    upstream: FakeUpstream = await upstream_factory(handler)
    sc: Sidecar = await sidecar_factory(policy(upstream.url, {"d": daily(100)}, target=RETRYING))
    status, answer = await sc.call(call())
    stop.set()
    assert (status, answer["success"], upstream.hits) == (200, True, 2)
    # the lost attempt keeps its reservation (maybe billed), the answered one its cost
    assert abs(spent_usd(sc, "d") - (RESERVED_USD + ACTUAL_USD)) < 1e-6
    record = sc.audit_records()[-1]
    assert record["attempts"] == 2
    assert record["cost_usd"] == ACTUAL_USD


async def test_a_resend_that_the_budget_cannot_cover_is_not_sent(
    upstream_factory: Any, sidecar_factory: Any
) -> None:
    stop = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        await asyncio.wait_for(stop.wait(), 10)
        return web.json_response(COMPLETION)

    upstream: FakeUpstream = await upstream_factory(handler)
    limit = RESERVED_USD * 1.5  # one reservation fits, two do not
    sc: Sidecar = await sidecar_factory(policy(upstream.url, {"d": daily(limit)}, target=RETRYING))
    status, answer = await sc.call(call())
    stop.set()
    assert upstream.hits == 1  # the resend would overspend: not sent
    assert status == 429
    assert answer["error"]["code"] == "BUDGET_EXCEEDED"
    assert answer["error"]["retryable"] is False
    assert answer["error"]["suggested_retry_after"] > 0
    assert "may have" in answer["error"]["message"]  # the first attempt's outcome is unknown
    assert abs(spent_usd(sc, "d") - RESERVED_USD) < 1e-6  # the sent attempt's reservation kept


async def test_a_call_refused_at_a_redirect_was_sent_and_keeps_its_reservation(
    upstream_factory: Any, sidecar_factory: Any
) -> None:
    """A refused redirect (another origin) comes after the upstream had the request and
    answered it: the call was sent (the budgets page: it keeps its reservation, cost unknown), not
    'not_sent' with its reservation released."""
    elsewhere: FakeUpstream = await upstream_factory()

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.Response(status=307, headers={"Location": elsewhere.url + "/collect"})

    upstream: FakeUpstream = await upstream_factory(handler)
    sc: Sidecar = await sidecar_factory(policy(upstream.url, {"d": daily(100)}))
    status, answer = await sc.call(call())
    assert (status, answer["error"]["details"]["reason"]) == (403, "cross_origin_redirect")
    assert (upstream.hits, elsewhere.hits) == (1, 0)
    record = sc.audit_records()[-1]
    assert record["cost_reason"] == "usage_unknown"
    assert abs(spent_usd(sc, "d") - RESERVED_USD) < 1e-6


async def test_a_stream_cut_mid_way_and_resent_books_both_attempts(
    upstream_factory: Any, sidecar_factory: Any
) -> None:
    """The other resend after the upstream acted: an assembled stream that ended without
    its terminal marker (tokens were generated, and billed, before the cut)."""
    chunk = {"choices": [{"delta": {"content": "po"}, "index": 0}], "model": "fake-model-1"}
    usage = {"choices": [], "usage": COMPLETION["usage"], "model": "fake-model-1"}

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if upstream.hits > 1:
            await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    upstream: FakeUpstream = await upstream_factory(handler)
    sc: Sidecar = await sidecar_factory(policy(upstream.url, {"d": daily(100)}, target=RETRYING))
    status, answer = await sc.call(call(stream=True))
    assert (status, answer["success"], upstream.hits) == (200, True, 2), answer["error"]
    assert abs(spent_usd(sc, "d") - (RESERVED_USD + ACTUAL_USD)) < 1e-6
