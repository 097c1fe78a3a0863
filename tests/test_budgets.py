"""Cost, budgets and shadow mode, in one process: pure parts table-driven,
then real sidecars in front of loopback upstreams that count what reaches them.

Prices in these tests come from the policy's ``prices:`` table (0.1 USD per token, so
the figures are easy to check by hand) except where the library (genai-prices) is the
point. The reservation of the base call below is 34 prompt bytes + 10 output tokens =
44 tokens = 4.4 USD; its real cost (3 + 1 tokens) is 0.4 USD.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import math
import sys
import time
from typing import Any

import pytest
from aiohttp import web

from gateway.audit.query.summary import summarize
from gateway.budgets import NANO_USD, Applied, Budgets, LocalLedger
from gateway.budgets.windows import Window, civil_to_days, days_to_civil
from gateway.cost import Pricing
from gateway.cost.rates import Rates, cost_usd
from gateway.errors import BudgetExceeded
from gateway.policy import PolicyError, parse_policy
from gateway.policy.budgets import BudgetSpec, PriceSpec
from gateway.providers import TokenUsage
from tests.conftest import compile_policy, envelope, openai_target, policy_yaml

PRICE = {"input_usd_per_mtok": 100_000, "output_usd_per_mtok": 100_000}  # 0.1 USD a token
PRICES = {"fake-model-1": PRICE}
MESSAGES = [{"role": "user", "content": "ping"}]
RESERVED_USD = (len(json.dumps(MESSAGES, separators=(",", ":"))) + 10) * 0.1  # 4.4
COMPLETION = {
    "model": "fake-model-1",
    "choices": [{"message": {"role": "assistant", "content": "pong"}}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}
ACTUAL_USD = 0.4


def call(**parameters: Any) -> dict[str, Any]:
    params = {"model": "fake-model-1", "max_tokens": 10, "messages": MESSAGES, **parameters}
    return envelope(parameters={k: v for k, v in params.items() if v is not ...})


def policy(url: str, budgets: dict[str, Any], **extra: Any) -> Any:
    target = openai_target(url, retry={"max_retries": 0})
    target.update(extra.pop("target", {}))
    return compile_policy(
        {"fake-openai": target}, budgets=budgets, prices=extra.pop("prices", PRICES), **extra
    )


def daily(limit: float, **extra: Any) -> dict[str, Any]:
    return {"limit_usd": limit, "window": "daily", "applies_to": {"target": "fake-openai"}, **extra}


def completion(body: dict[str, Any] = COMPLETION):
    async def handler(_: web.Request) -> web.StreamResponse:
        return web.json_response(body)

    return handler


def spent_usd(sc: Any, name: str) -> float:
    budgets: Budgets = sc.gateway.pipeline.budgets
    (budget,) = [b for b in budgets.applying("fake-openai", None, "test-agent") if b.name == name]
    return budgets.ledger.spent(budget, time.time()) / NANO_USD


def seconds_to_utc_midnight() -> float:
    now = dt.datetime.now(dt.UTC)
    midnight = dt.datetime.combine(now.date() + dt.timedelta(days=1), dt.time(), dt.UTC)
    return (midnight - now).total_seconds()


# -- windows (pure) -------------------------------------------------------------------------


def test_civil_date_arithmetic_matches_datetime() -> None:
    epoch = dt.date(1970, 1, 1)
    for days in range(-800, 60_000, 7):  # 1967 to 2134, every weekday shift
        date = epoch + dt.timedelta(days=days)
        assert days_to_civil(days) == (date.year, date.month, date.day)
        assert civil_to_days(date.year, date.month, date.day) == days


@pytest.mark.parametrize(
    ("window", "at", "resets"),
    [
        (Window("daily"), "2026-12-01T11:30:00", "2026-12-02T00:00:00"),
        (Window("daily"), "2026-12-31T23:59:59", "2027-01-01T00:00:00"),
        (Window("monthly"), "2026-12-15T08:00:00", "2027-01-01T00:00:00"),
        (Window("monthly"), "2028-02-29T23:00:00", "2028-03-01T00:00:00"),
        (Window("monthly"), "2027-01-01T00:00:00", "2027-02-01T00:00:00"),
    ],
)
def test_calendar_windows_reset_at_utc_boundaries(window: Window, at: str, resets: str) -> None:
    now = dt.datetime.fromisoformat(at).replace(tzinfo=dt.UTC).timestamp()
    end = dt.datetime.fromisoformat(resets).replace(tzinfo=dt.UTC).timestamp()
    bucket = window.bucket(now)
    assert window.leaves_at(bucket) == end
    assert window.bucket(end - 0.001) == bucket
    assert window.bucket(end) == bucket + 1


def test_rolling_window_buckets_and_retry_after() -> None:
    window = Window("rolling", per_hours=1.0)  # 60 buckets of 60 s
    assert window.width_s == 60.0
    assert window.buckets == 60
    now = 1_800_000_030.0  # 30 s into a bucket
    current = window.bucket(now)
    # 3 USD spent 59 buckets ago (leaves in 30 s), 5 USD 10 buckets ago (leaves 50 min later).
    spends = {current - 59: 3 * NANO_USD, current - 10: 5 * NANO_USD, current - 60: 99}
    assert window.spent(spends, current) == 8 * NANO_USD  # the bucket 60 back no longer counts
    wait = window.retry_after_s(spends, current, 4 * NANO_USD, 10 * NANO_USD, now)
    assert wait == pytest.approx(30.0)
    wait = window.retry_after_s(spends, current, 7 * NANO_USD, 10 * NANO_USD, now)
    assert wait == pytest.approx(30.0 + 49 * 60)
    assert window.retry_after_s(spends, current, 11 * NANO_USD, 10 * NANO_USD, now) is None


def test_local_ledger_refuses_without_booking_and_shadow_books() -> None:
    enforce = Applied("a", BudgetSpec(limit_usd=1, window="daily"), Window("daily"), NANO_USD)
    shadow = Applied(
        "s", BudgetSpec(limit_usd=1, window="daily", mode="shadow"), Window("daily"), NANO_USD
    )
    ledger, now = LocalLedger(), time.time()
    refusal, booked, denied = ledger.admit([enforce, shadow], NANO_USD // 2, now)
    assert refusal is None
    assert len(booked) == 2
    assert denied == []
    refusal, booked, denied = ledger.admit([shadow], NANO_USD, now)  # shadow: over, booked
    assert refusal is None
    assert denied == ["s"]
    assert ledger.spent(shadow, now) == NANO_USD * 3 // 2
    refusal, booked, _ = ledger.admit([enforce, shadow], NANO_USD, now)
    assert isinstance(refusal, BudgetExceeded)
    assert booked == []
    assert ledger.spent(enforce, now) == NANO_USD // 2  # nothing booked anywhere
    assert refusal.retry_after_s == pytest.approx(seconds_to_utc_midnight(), abs=5)
    assert refusal.details["budget"] == "a"
    assert refusal.details["reason"] == "budget_spent"


# -- cost (pure) ------------------------------------------------------------------------------

RATES = Rates(2.0, 8.0, 0.5, 2.5, "policy", "m")


@pytest.mark.parametrize(
    ("usage", "flags", "expected"),
    [
        # OpenAI: cached inside input, reasoning inside output.
        (TokenUsage(1000, 500, 200, 1500, reasoning=100), {}, (800 * 2 + 200 * 0.5 + 500 * 8)),
        # Anthropic: cache reads and writes outside input, billed at the higher cache rate.
        (TokenUsage(1000, 500, 200, 1700), {"cached_outside_input": True}, 2000 + 500 + 4000),
        # ... and with the split known: writes at the write rate, reads at the cached rate.
        (
            TokenUsage(1000, 500, 200, 1700, cache_write=50),
            {"cached_outside_input": True},
            2000 + 150 * 0.5 + 50 * 2.5 + 4000,
        ),
        # Gemini: thoughts outside the candidates' count, billed as output.
        (
            TokenUsage(1000, 500, 0, 1600, reasoning=100),
            {"reasoning_outside_output": True},
            2000 + 600 * 8,
        ),
        (TokenUsage(None, 500, None, 500), {}, None),  # half a usage: no number
    ],
)
def test_cost_of_usage_by_dialect(usage: TokenUsage, flags: dict[str, bool], expected: Any) -> None:
    got = cost_usd(RATES, usage, **flags)
    assert got == (pytest.approx(expected / 1e6) if expected is not None else None)


def test_policy_prices_win_and_unknown_prices_say_why() -> None:
    pricing = Pricing(parse_policy(policy_yaml({}, prices={"gpt-4o": PRICE})).prices)
    params = {"model": "gpt-4o", "max_tokens": 5, "messages": MESSAGES}
    price = pricing.price("openai", "/v1/chat/completions", params, measure=True)
    assert price.rates is not None
    assert price.rates.source == "policy"
    assert price.upper_usd(None) == (pytest.approx(RESERVED_USD - 0.5), None)
    unknown = {"model": "no-such-model-zz9", "max_tokens": 5}
    assert pricing.price("openai", "/v1/chat/completions", unknown, measure=True).reason == (
        "no_price"
    )
    assert pricing.price("none", "/x", params, measure=True).reason == "no_dialect"
    assert pricing.price("openai", "/v1/files", params, measure=True).reason == "not_a_model_call"
    no_cap = pricing.price("openai", "/v1/chat/completions", {"model": "gpt-4o"}, measure=True)
    assert no_cap.upper_usd(None) == (None, "no_output_cap")
    assert no_cap.upper_usd(7)[0] == pytest.approx(7 * 0.1)
    two = pricing.price("openai", "/v1/chat/completions", {**params, "n": 2}, measure=True)
    assert two.output_tokens == 10  # n choices, each up to max_tokens
    embed = pricing.price(
        "openai", "/v1/embeddings", {"model": "gpt-4o", "input": "abcd"}, measure=True
    )
    assert embed.upper_usd(None) == (pytest.approx(4 * 0.1), None)  # nothing generated
    stored = {**params, "previous_response_id": "resp_1"}
    hidden = pricing.price("openai", "/v1/responses", stored, measure=True)
    assert hidden.upper_usd(100) == (None, "hidden_context")  # input kept by the provider


def test_library_prices_offline_and_match_genai_prices() -> None:
    genai_prices = pytest.importorskip("genai_prices")
    from genai_prices import data_snapshot

    pricing = Pricing({})
    params = {"model": "gpt-4o-mini", "max_tokens": 5, "messages": MESSAGES}
    price = pricing.price("openai", "/v1/chat/completions", params, measure=False)
    assert price.rates is not None
    assert price.rates.source == "genai-prices"
    usage = TokenUsage(1200, 300, 200, 1500)
    got, reason = price.cost(usage)
    expected = genai_prices.calc_price(
        genai_prices.Usage(input_tokens=1200, cache_read_tokens=200, output_tokens=300),
        "gpt-4o-mini",
        provider_id="openai",
    ).total_price
    assert reason is None
    assert got == pytest.approx(float(expected), rel=1e-9)
    # A tiered price (every token at the higher rate past 200k input tokens), both sides.
    rates = pricing.rates("anthropic", "claude-sonnet-4-5")
    assert rates is not None
    assert rates.tiers
    for prompt in (150_000, 250_000):
        got = cost_usd(rates, TokenUsage(prompt, 1000, 0, prompt + 1000), cached_outside_input=True)
        expected = genai_prices.calc_price(
            genai_prices.Usage(input_tokens=prompt, output_tokens=1000),
            "claude-sonnet-4-5",
            provider_id="anthropic",
        ).total_price
        assert got == pytest.approx(float(expected), rel=1e-9)
    # The bundled snapshot, never one fetched by UpdatePrices.
    assert data_snapshot.get_snapshot().from_auto_update is False


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        (
            {"limit_usd": 5, "window": "rolling"},
            "'per_hours' is required with window: rolling",
        ),
        ({"limit_usd": 5, "window": "daily", "applies_to": {"target": "nope"}}, "no target"),
        ({"limit_usd": 5, "window": "daily", "scope": "cluster"}, "needs a redis section"),
        ({"limit_usd": 5, "window": "weekly"}, "window"),
        ({"limit_usd": 5, "window": "daily", "mode": "dry-run"}, "mode"),
    ],
)
def test_budget_policy_errors_name_the_key(budget: dict[str, Any], message: str) -> None:
    with pytest.raises(PolicyError) as caught:
        parse_policy(policy_yaml({}, budgets={"b1": budget}), "p.yaml")
    assert "budgets.b1" in str(caught.value)
    assert message in str(caught.value)


# -- budgets through a sidecar ------------------------------------------------------------------


async def test_budget_refuses_before_the_upstream_once_spent(upstream_factory, sidecar_factory):
    up = await upstream_factory(completion())
    sc = await sidecar_factory(policy(up.url, {"day": daily(10.2)}))
    admitted = math.floor((10.2 - RESERVED_USD) / ACTUAL_USD) + 1  # 15
    for _ in range(admitted):
        status, answer = await sc.call(call())
        assert status == 200, answer
    assert spent_usd(sc, "day") == pytest.approx(admitted * ACTUAL_USD)
    status, answer = await sc.call(call())
    assert status == 429
    error = answer["error"]
    assert error["code"] == "BUDGET_EXCEEDED"
    assert error["retryable"] is False
    assert error["suggested_retry_after"] == pytest.approx(seconds_to_utc_midnight(), abs=5)
    assert error["details"]["budget"] == "day"
    assert up.hits == admitted  # the refused call never reached the upstream
    records = sc.audit_records()
    assert records[0]["cost_usd"] == pytest.approx(ACTUAL_USD)
    assert records[0]["cost_source"] == "policy"
    assert records[0]["budgets"] == ["day"]
    assert records[-1]["decision"] == "denied"
    assert records[-1]["error_code"] == "BUDGET_EXCEEDED"
    assert records[-1]["cost_usd"] is None
    assert records[-1]["cost_reason"] == "not_sent"
    body, _ = sc.gateway.metrics.render()
    assert b'egress_gateway_budget_rejections_total{budget="day"} 1.0' in body
    assert b"egress_gateway_cost_usd_total{" in body
    total = summarize(records).total().to_dict()
    assert total["cost_usd"] == pytest.approx(admitted * ACTUAL_USD)


def held_upstream(body: dict[str, Any], release_at: int):
    """Answers ``body`` once ``release_at`` requests have arrived (so they overlap)."""
    arrived = 0
    release = asyncio.Event()

    async def handler(_: web.Request) -> web.StreamResponse:
        nonlocal arrived
        arrived += 1
        if arrived >= release_at:
            release.set()
        await asyncio.wait_for(release.wait(), 10)
        return web.json_response(body)

    return handler


@pytest.mark.parametrize("excess_tokens", [0, 66])
async def test_concurrent_calls_hold_the_stated_bound(
    upstream_factory, sidecar_factory, excess_tokens: int
):
    """The budgets page's bound: spend <= limit + K * max(actual - reserved) for K calls in flight.
    With an output cap and a text prompt the reservation is an upper bound (excess 0);
    an upstream that bills more than the estimate (images, server-side state) shows
    the K * excess term."""
    limit = 10.2
    in_flight = math.floor(limit / RESERVED_USD)  # 2 reservations fit at once
    prompt, output = 34 + excess_tokens, 10  # the real usage: the cap, plus any excess
    body = {**COMPLETION, "usage": {"prompt_tokens": prompt, "completion_tokens": output}}
    up = await upstream_factory(held_upstream(body, in_flight))
    sc = await sidecar_factory(policy(up.url, {"day": daily(limit)}))
    results = await asyncio.gather(*(sc.call(call()) for _ in range(40)))
    ok = [a for s, a in results if s == 200]
    refused = [a for s, a in results if s == 429]
    assert len(ok) == in_flight == up.hits
    assert len(refused) == 40 - in_flight
    assert {a["error"]["code"] for a in refused} == {"BUDGET_EXCEEDED"}
    actual = (prompt + output) * 0.1
    assert spent_usd(sc, "day") == pytest.approx(in_flight * actual)
    assert spent_usd(sc, "day") <= limit + in_flight * (actual - RESERVED_USD) + 1e-9
    if excess_tokens == 0:
        assert spent_usd(sc, "day") <= limit


async def test_unknown_price_fails_closed_unless_allowed(upstream_factory, sidecar_factory):
    up = await upstream_factory(completion())
    sc = await sidecar_factory(policy(up.url, {"day": daily(100)}))
    status, answer = await sc.call(call(model="mystery-model-zz9"))
    assert status == 403
    assert answer["error"]["code"] == "PERMISSION_DENIED"
    assert answer["error"]["details"]["reason"] == "budget_price_unknown"
    assert answer["error"]["details"]["price_unknown"] == "no_price"
    status, answer = await sc.call(call(max_tokens=...))  # no output cap
    assert status == 403
    assert answer["error"]["details"]["price_unknown"] == "no_output_cap"
    assert up.hits == 0
    allowed = await sidecar_factory(policy(up.url, {"day": daily(100, on_unknown_price="allow")}))
    status, answer = await allowed.call(call(model="mystery-model-zz9"))
    assert status == 200, answer
    record = allowed.audit_records()[-1]
    assert record["cost_usd"] is None
    assert record["cost_reason"] == "no_price"
    assert any("cannot be bounded" in w for w in record["warnings"])
    capped = await sidecar_factory(policy(up.url, {"day": daily(100, max_output_tokens=5)}))
    status, _ = await capped.call(call(max_tokens=...))  # the budget's default caps the output
    assert status == 200
    assert up.hits == 2
    # 34 prompt bytes + the default's 5 output tokens were reserved; 0.4 USD remains.
    assert spent_usd(capped, "day") == pytest.approx(ACTUAL_USD)


async def test_reservation_released_without_contact_or_billable_answer(
    upstream_factory, sidecar_factory
):
    closed = await upstream_factory()
    url = closed.url
    assert closed.server is not None
    await closed.server.close()  # nothing listens: the connection is refused
    sc = await sidecar_factory(policy(url, {"day": daily(100)}))
    status, answer = await sc.call(call())
    assert status == 502
    assert answer["error"]["code"] == "DEPENDENCY_FAILED"
    assert spent_usd(sc, "day") == 0.0  # never sent: released

    async def no_usage(_: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "boom"}}, status=500)

    up = await upstream_factory(no_usage)
    sc = await sidecar_factory(policy(up.url, {"day": daily(100)}))
    _status, answer = await sc.call(call())
    assert answer["error"]["code"] == "DEPENDENCY_FAILED"
    assert up.hits == 1
    # Answered with an error status only: not billed by the provider, released (a
    # billable answer without usage keeps it: test_budget_released_after_error_answers).
    assert spent_usd(sc, "day") == 0.0
    assert sc.audit_records()[-1]["cost_reason"] == "not_billed"


async def test_streamed_answer_reconciles_its_real_cost(upstream_factory, sidecar_factory):
    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"model": "fake-model-1", "choices": [{"delta": {"content": "po"}}]}
        usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}
        for event in (chunk, usage):
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    up = await upstream_factory(stream)
    sc = await sidecar_factory(policy(up.url, {"day": daily(100)}))
    env = call(stream=True)
    async with sc.session.post(
        sc.url + "/v1/calls", json=env, headers={"Accept": "text/event-stream"}
    ) as resp:
        text = await resp.text()
    assert resp.status == 200
    assert "egress.response" in text
    assert spent_usd(sc, "day") == pytest.approx(0.7)  # 5 + 2 tokens, not the 4.4 reserved
    assert sc.audit_records()[-1]["cost_usd"] == pytest.approx(0.7)


async def test_proxy_stream_reconciles_its_real_cost(upstream_factory, sidecar_factory):
    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"model": "fake-model-1", "choices": [{"delta": {"content": "po"}}]}
        usage = {"choices": [], "usage": {"prompt_tokens": 6, "completion_tokens": 3}}
        for event in (chunk, usage):
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    up = await upstream_factory(stream)
    sc = await sidecar_factory(policy(up.url, {"day": daily(100)}))
    body = {"model": "fake-model-1", "max_tokens": 10, "messages": MESSAGES, "stream": True}
    async with sc.session.post(
        sc.url + "/proxy/fake-openai/v1/chat/completions", json=body
    ) as resp:
        text = await resp.text()
    assert resp.status == 200
    assert "[DONE]" in text
    assert spent_usd(sc, "day") == pytest.approx(0.9)  # 6 + 3 tokens, not the 4.4 reserved
    record = sc.audit_records()[-1]
    assert record["api"] == "proxy"
    assert record["cost_usd"] == pytest.approx(0.9)


async def test_proxy_route_is_refused_in_the_providers_shape(upstream_factory, sidecar_factory):
    up = await upstream_factory(completion())
    sc = await sidecar_factory(policy(up.url, {"day": daily(1.0)}))
    body = {"model": "fake-model-1", "max_tokens": 10, "messages": MESSAGES}
    async with sc.session.post(
        sc.url + "/proxy/fake-openai/v1/chat/completions", json=body
    ) as resp:
        answer = await resp.json()
    assert resp.status == 429
    assert resp.headers["x-egress-error-code"] == "BUDGET_EXCEEDED"
    assert resp.headers["x-egress-retryable"] == "false"
    assert "budget" in answer["error"]["message"]
    assert up.hits == 0


# -- shadow mode ----------------------------------------------------------------------------


async def test_shadow_endpoint_rule_records_and_proceeds(upstream_factory, sidecar_factory):
    up = await upstream_factory(completion())
    endpoints = [
        {"path": "/v1/chat/completions", "methods": ["POST"]},
        {"path": "/v1/**", "methods": ["POST"], "mode": "shadow"},
    ]
    sc = await sidecar_factory(policy(up.url, {}, target={"endpoints": endpoints}))
    status, _ = await sc.call(call())
    assert status == 200
    status, _ = await sc.call(envelope(endpoint="/v1/embeddings", parameters={"input": "x"}))
    assert status == 200
    assert up.hits == 2
    first, second = sc.audit_records()
    assert first["decision"] == "allowed"
    assert first["shadow_denied"] == []
    assert second["decision"] == "shadow_denied"
    assert second["shadow_denied"] == ["endpoint:/v1/**"]
    status, _answer = await sc.call(envelope(endpoint="/v2/x", parameters={}))
    assert status == 403
    assert up.hits == 2
    body, _ = sc.gateway.metrics.render()
    assert b'shadow_denials_total{kind="endpoint",rule="/v1/**"} 1.0' in body


async def test_shadow_rate_limit_group_never_waits(upstream_factory, sidecar_factory):
    up = await upstream_factory(completion())
    groups = {"slow": {"requests_per_second": 0.01, "burst": 1, "max_queue_s": 1}}
    sc = await sidecar_factory(
        policy(
            up.url,
            {},
            target={"rate_limit_group": "slow"},
            rate_limit_groups={"slow": {**groups["slow"], "mode": "shadow"}},
        )
    )
    results = [await sc.call(call()) for _ in range(3)]
    assert [s for s, _ in results] == [200, 200, 200]
    assert up.hits == 3
    records = sc.audit_records()
    assert [r["decision"] for r in records] == ["allowed", "shadow_denied", "shadow_denied"]
    assert records[1]["shadow_denied"] == ["rate_limit_group:slow"]
    assert all(r["rate_limit_wait_ms"] == 0 for r in records)
    enforced = await sidecar_factory(
        policy(up.url, {}, target={"rate_limit_group": "slow"}, rate_limit_groups=groups)
    )
    await enforced.call(call())
    status, answer = await enforced.call(call())  # the control: enforced, it refuses
    assert status == 429
    assert answer["error"]["code"] == "CAPACITY_EXCEEDED"


async def test_shadow_budget_counts_and_proceeds(upstream_factory, sidecar_factory):
    up = await upstream_factory(completion())
    sc = await sidecar_factory(policy(up.url, {"try": daily(5.0, mode="shadow")}))
    for _ in range(3):
        status, _ = await sc.call(call())
        assert status == 200
    assert up.hits == 3
    records = sc.audit_records()
    # 4.4 fits; 0.4 + 4.4 fits; 0.8 + 4.4 > 5: would deny, goes out, is counted.
    assert [r["decision"] for r in records] == ["allowed", "allowed", "shadow_denied"]
    assert records[2]["shadow_denied"] == ["budget:try"]
    assert spent_usd(sc, "try") == pytest.approx(3 * ACTUAL_USD)
    body, _ = sc.gateway.metrics.render()
    assert b'shadow_denials_total{kind="budget",rule="try"} 1.0' in body


def test_reload_keeps_a_budgets_spend_under_its_name() -> None:
    budgets = Budgets({"b": BudgetSpec(limit_usd=10, window="daily")})
    applied = budgets.applying("t", None, "a")
    asyncio.run(budgets.reserve(applied, 4.0))
    budgets.update({"b": BudgetSpec(limit_usd=5, window="daily")})  # lowered: 4 of 5 spent
    with pytest.raises(BudgetExceeded):
        asyncio.run(budgets.reserve(budgets.applying("t", None, "a"), 2.0))
    budgets.update({})
    budgets.update({"b": BudgetSpec(limit_usd=5, window="daily")})  # removed, then back: new
    asyncio.run(budgets.reserve(budgets.applying("t", None, "a"), 2.0))


def test_without_the_library_prices_are_unknown_not_a_crash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gateway.cost import prices

    prices._cached.cache_clear()
    monkeypatch.setitem(sys.modules, "genai_prices", None)  # an image built without it
    try:
        assert prices.library_rates("openai", "gpt-4o-mini") is None
        pricing = Pricing({"gpt-4o": PriceSpec(**PRICE)})
        params = {"model": "gpt-4o-mini", "max_tokens": 5}
        assert pricing.price("openai", "/v1/chat/completions", params, measure=False).reason == (
            "no_price"
        )
        params = {"model": "gpt-4o", "max_tokens": 5}  # the policy's own prices still work
        assert pricing.price("openai", "/v1/chat/completions", params, measure=False).rates
    finally:
        prices._cached.cache_clear()


@pytest.mark.parametrize("provider", ["anthropic", "gemini"])
async def test_cost_matches_genai_prices_by_provider(upstream_factory, sidecar_factory, provider):
    """The answer's own usage shape, through a sidecar, priced from the library: the
    record's cost_usd is what genai-prices computes for the same tokens."""
    genai_prices = pytest.importorskip("genai_prices")
    if provider == "anthropic":
        model, endpoint = "claude-sonnet-4-5", "/v1/messages"
        answer = {
            "model": model,
            "usage": {
                "input_tokens": 1000,
                "cache_creation_input_tokens": 100,
                "cache_read_input_tokens": 200,
                "output_tokens": 500,
            },
        }
        oracle = genai_prices.Usage(
            input_tokens=1300, cache_read_tokens=200, cache_write_tokens=100, output_tokens=500
        )
        target = {
            "credential": {"header": "x-api-key", "default_ref": "env://TEST_OPENAI_KEY"},
            "endpoints": [{"path": "/v1/messages", "methods": ["POST"]}],
        }
        params: dict[str, Any] = {"model": model, "max_tokens": 600, "messages": MESSAGES}
    else:
        model = "gemini-2.5-flash"
        endpoint = f"/v1beta/models/{model}:generateContent"
        answer = {
            "usageMetadata": {
                "promptTokenCount": 1000,
                "cachedContentTokenCount": 200,
                "candidatesTokenCount": 300,
                "thoughtsTokenCount": 200,
                "totalTokenCount": 1500,
            }
        }
        oracle = genai_prices.Usage(input_tokens=1000, cache_read_tokens=200, output_tokens=500)
        target = {
            "credential": {"header": "x-goog-api-key", "default_ref": "env://TEST_OPENAI_KEY"},
            "endpoints": [{"path": "/v1beta/models/*", "methods": ["POST"]}],
        }
        params = {"contents": [{"parts": [{"text": "hi"}]}]}
    up = await upstream_factory(completion(answer))
    spec = {**openai_target(up.url), **target, "usage": provider}
    sc = await sidecar_factory(compile_policy({"t": spec}))
    status, got = await sc.call(
        envelope(target_system="t", endpoint=endpoint, parameters=params, api_key_ref=...)
    )
    assert status == 200, got
    record = sc.audit_records()[-1]
    provider_id = "anthropic" if provider == "anthropic" else "google"
    expected = genai_prices.calc_price(oracle, model, provider_id=provider_id).total_price
    assert record["cost_source"] == "genai-prices"
    assert record["cost_model"] == model
    assert record["cost_usd"] == pytest.approx(float(expected), rel=1e-6)


async def test_agent_budget_leaves_calls_without_token_prices_alone(
    upstream_factory, sidecar_factory
):
    """A budget over all of an agent's calls books its model calls and lets its other
    calls through: a target with ``usage: none`` (a weather API, an MCP server) has no
    token price, and costs nothing in USD that the sidecar could count."""
    up = await upstream_factory(completion())
    plain = openai_target(up.url, retry={"max_retries": 0}, usage="none")
    sc = await sidecar_factory(
        compile_policy(
            {"fake-openai": openai_target(up.url, retry={"max_retries": 0}), "plain": plain},
            budgets={"agent-day": {"limit_usd": 100, "window": "daily",
                                   "applies_to": {"agent": "test-agent"}}},
            prices=PRICES,
        )
    )  # fmt: skip
    status, answer = await sc.call(call(max_tokens=...) | {"target_system": "plain"})
    assert status == 200, answer
    record = sc.audit_records()[-1]
    assert record["budgets"] == []
    assert record["cost_reason"] == "no_dialect"
    status, answer = await sc.call(call())
    assert status == 200, answer
    assert sc.audit_records()[-1]["budgets"] == ["agent-day"]
    assert up.hits == 2


def test_budget_naming_a_target_without_usage_is_a_policy_error() -> None:
    plain = openai_target("http://127.0.0.1:9", usage="none")
    budget = {"limit_usd": 5, "window": "daily", "applies_to": {"target": "plain"}}
    with pytest.raises(PolicyError) as caught:
        parse_policy(policy_yaml({"plain": plain}, budgets={"b1": budget}), "p.yaml")
    assert "budgets.b1.applies_to.target" in str(caught.value)
    assert "usage: none" in str(caught.value)
