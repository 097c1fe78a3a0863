"""What an enforced budget prices: model spend, every billed input, nothing unbillable.

A call with no model to price (a target without a usage dialect, a ``GET`` of a model
listing) costs the budget nothing; a billed endpoint the sidecar cannot price (image
generation) is refused before any upstream contact; the upper estimate counts every
input the provider bills (legacy ``functions``, a ``response_format`` schema) and says
when a hidden context cannot be bounded.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.cost import Pricing
from gateway.policy.budgets import PriceSpec
from tests.conftest import FakeUpstream, Sidecar, compile_policy, envelope, openai_target
from tests.test_budgets import (
    PRICES,
    call,
    daily,
)


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


def test_estimates_count_every_billed_input_the_request_carries() -> None:
    """The upper estimate must not be below the bill (budgets page, "Bound": 0 overshoot for text
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
