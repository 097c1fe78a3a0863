"""Review of budgets (issue 20): a call resent after an attempt that may have been billed
(the request was sent and its answer lost, or its answer cut mid-way) books each such
attempt, since the provider may have charged for it; the bound of README "Cost and
budgets" holds across retries. Real sidecar, loopback upstream counting its hits."""

from __future__ import annotations

import asyncio
import io
import json
from typing import Any

from aiohttp import web

from gateway.audit.query.cli import main
from gateway.budgets import Budgets
from gateway.cost import Pricing
from gateway.policy.budgets import BudgetSpec, PriceSpec
from tests.conftest import FakeUpstream, Sidecar, compile_policy, envelope, openai_target
from tests.test_budgets import (
    ACTUAL_USD,
    COMPLETION,
    PRICES,
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


async def test_calls_that_are_not_model_calls_pass_an_enforced_budget(
    upstream_factory: Any, sidecar_factory: Any
) -> None:
    """A budget counts model spend: a call with no model to price (the target has no usage
    dialect, or the endpoint is not a model call, e.g. ``GET /v1/models/...``) costs it
    nothing and is not refused as of unknown price; a model call without a price is."""
    upstream: FakeUpstream = await upstream_factory()
    llm = openai_target(upstream.url, retry={"max_retries": 0})
    llm["endpoints"] = [
        {"path": "/v1/chat/completions", "methods": ["POST"]},
        {"path": "/v1/models/*", "methods": ["GET"]},
    ]
    plain = {"base_url": upstream.url, "endpoints": [{"path": "/items", "methods": ["GET"]}]}
    budgets = {"d": {**daily(100), "applies_to": {"agent": "test-agent"}}}
    sc: Sidecar = await sidecar_factory(
        compile_policy({"fake-openai": llm, "inventory": plain}, budgets=budgets, prices=PRICES)
    )
    listing = envelope(method="GET", endpoint="/v1/models/fake-model-1", parameters={})
    status, answer = await sc.call(listing)
    assert (status, answer["success"]) == (200, True), answer["error"]
    inventory = envelope(target_system="inventory", method="GET", endpoint="/items")
    inventory.pop("api_key_ref")
    inventory["parameters"] = {}
    status, answer = await sc.call(inventory)
    assert (status, answer["success"]) == (200, True), answer["error"]
    status, answer = await sc.call(call(model="no-such-model"))
    assert status == 403
    assert answer["error"]["details"]["reason"] == "budget_price_unknown"
    assert upstream.hits == 2
    records = sc.audit_records()
    assert [r["cost_reason"] for r in records[:2]] == ["not_a_model_call", "no_dialect"]


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


async def test_a_call_refused_at_a_redirect_was_sent_and_keeps_its_reservation(
    upstream_factory: Any, sidecar_factory: Any
) -> None:
    """A refused redirect (another origin) comes after the upstream had the request and
    answered it: the call was sent (README: it keeps its reservation, cost unknown), not
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


async def test_the_summary_shows_small_spends(
    upstream_factory: Any, sidecar_factory: Any, tmp_path: Any
) -> None:
    """An auditor's table: a day of gpt-4o-mini calls costs cents; four decimals showed
    a real spend of 0.000028 USD as 0.0000."""
    upstream: FakeUpstream = await upstream_factory()
    sc: Sidecar = await sidecar_factory(policy(upstream.url, {}))
    await sc.call(call())
    record = {**sc.audit_records()[-1], "cost_usd": 0.000028}
    path = tmp_path / "audit.jsonl"
    path.write_text(json.dumps(record) + "\n")
    out = io.StringIO()
    assert main(["summary", str(path)], stdout=out, stderr=io.StringIO()) == 0
    rows = [line.split() for line in out.getvalue().splitlines() if line.strip()[:4] == "all "]
    assert rows[0][-1] == "0.000028"


def test_estimates_count_every_billed_input_the_request_carries() -> None:
    """The upper estimate must not be below the bill (README "Bound": 0 overshoot for text
    with an output cap). OpenAI bills the legacy ``functions`` and a ``response_format``
    schema as input like ``tools``; Gemini's ``cachedContent`` brings in a whole cached
    context (up to the model's window) that is not in the request, like the Responses
    API's ``previous_response_id``: it cannot be bounded."""
    pricing = Pricing(
        {"m": PriceSpec(input_usd_per_mtok=100_000, output_usd_per_mtok=100_000)}
    )  # 0.1 USD a token
    schema = {"name": "f", "parameters": {"type": "object", "properties": {"q": {}}}}
    messages = [{"role": "user", "content": "hi"}]
    base = {"model": "m", "max_tokens": 1, "messages": messages}
    plain = pricing.price("openai", "/v1/chat/completions", base, measure=True)
    for extra in ({"functions": [schema]}, {"response_format": {"json_schema": schema}}):
        more = pricing.price("openai", "/v1/chat/completions", {**base, **extra}, measure=True)
        billed = len(json.dumps(next(iter(extra.values())), separators=(",", ":")))
        assert more.prompt_bytes >= plain.prompt_bytes + billed, extra
    gemini = {
        "contents": [{"parts": [{"text": "hi"}]}],
        "cachedContent": "cachedContents/abc123",
        "generationConfig": {"maxOutputTokens": 10},
    }
    price = pricing.price("gemini", "/v1beta/models/m:generateContent", gemini, measure=True)
    assert price.upper_usd(None) == (None, "hidden_context")


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


async def test_an_unpriced_post_to_an_llm_target_stays_under_the_budget(
    upstream_factory: Any, sidecar_factory: Any
) -> None:
    """An endpoint of an LLM provider that the sidecar cannot price but that is billed
    (``POST /v1/images/generations``, audio, batches) is not outside the budget: an
    enforced budget refuses it as of unknown price, before any upstream contact. Only
    safe methods (GET, HEAD, OPTIONS: RFC 9110 9.2.1, nothing is done, nothing billed)
    of such endpoints go through unbooked."""
    upstream: FakeUpstream = await upstream_factory()
    llm = openai_target(upstream.url, retry={"max_retries": 0})
    llm["endpoints"] = [
        {"path": "/v1/images/generations", "methods": ["POST"]},
        {"path": "/v1/models/*", "methods": ["GET"]},
    ]
    budgets = {"d": {**daily(100), "applies_to": {"agent": "test-agent"}}}
    sc: Sidecar = await sidecar_factory(
        compile_policy({"fake-openai": llm}, budgets=budgets, prices=PRICES)
    )
    images = envelope(endpoint="/v1/images/generations", parameters={"prompt": "a cat", "n": 9})
    status, answer = await sc.call(images)
    assert status == 403, answer
    assert answer["error"]["details"]["reason"] == "budget_price_unknown"
    assert answer["error"]["details"]["price_unknown"] == "not_a_model_call"
    assert upstream.hits == 0
    listing = envelope(method="GET", endpoint="/v1/models/fake-model-1", parameters={})
    status, answer = await sc.call(listing)
    assert (status, answer["success"]) == (200, True), answer["error"]
    assert upstream.hits == 1
