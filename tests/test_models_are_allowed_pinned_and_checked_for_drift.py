"""A target's (and an agent's) ``models:`` rules, end to end: the real OpenAI and
Anthropic SDKs on the drop-in routes, a Gemini-shaped stand-in, and envelopes.

A model outside ``allow`` is refused with nothing sent; a pinned alias reaches the
upstream as its snapshot (budgets and cost see the snapshot); an answer naming another
model than the one sent is recorded as drift (audit record and metric), and refused
under ``on_drift: refuse`` before any byte of it reaches the agent.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import anthropic
import openai
import pytest
from aiohttp import web

from tests.conftest import FakeUpstream, Sidecar, compile_policy, envelope
from tests.test_proxy_sdk import CHAT_USAGE, KEYS, MESSAGE, PLACEHOLDER, sse

MESSAGES = [{"role": "user", "content": "ping"}]
SNAPSHOT = "gpt-4o-2024-08-06"
CLAUDE = "claude-3-5-sonnet-20241022"
GEMINI = "gemini-1.5-flash-002"
OTHER = "gpt-4o-2099-01-01"  # what a drifting upstream answers with


class StandIn:
    """OpenAI, Anthropic and Gemini stand-ins answering with the model they were sent,
    or with ``answer_as`` when set (a provider that swapped the model behind it)."""

    def __init__(self) -> None:
        self.answer_as: str | None = None

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        provider, _, path = request.path.removeprefix("/").partition("/")
        raw = await request.read()
        body = json.loads(raw) if raw else {}
        if provider == "gemini":
            sent = path.rsplit("/", 1)[-1].split(":")[0]
            return await self._gemini(request, self.answer_as or sent, path)
        model = self.answer_as or body["model"]
        if provider == "anthropic":
            return await self._anthropic(request, model, bool(body.get("stream")))
        return await self._openai(request, model, bool(body.get("stream")))

    @staticmethod
    async def _openai(request: web.Request, model: str, stream: bool) -> web.StreamResponse:
        chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": model}
        if stream:
            return await _stream(request, sse(
                {**chunk, "choices": [{"index": 0, "delta": {"content": "Hel"},
                                       "finish_reason": None}]},
                {**chunk, "choices": [{"index": 0, "delta": {"content": "lo"},
                                       "finish_reason": "stop"}]},
                {**chunk, "choices": [], "usage": CHAT_USAGE},
                "[DONE]",
            ))  # fmt: skip
        return web.json_response(
            {
                "id": "c1",
                "object": "chat.completion",
                "created": 1,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {"role": "assistant", "content": "Hello"},
                    }
                ],
                "usage": CHAT_USAGE,
            }
        )

    @staticmethod
    async def _anthropic(request: web.Request, model: str, stream: bool) -> web.StreamResponse:
        message = {**MESSAGE, "model": model}
        if not stream:
            return web.json_response(message)
        return await _stream(request, sse(
            ("message_start", {"type": "message_start", "message": {
                **message, "content": [], "stop_reason": None,
                "usage": {"input_tokens": 20, "output_tokens": 1}}}),
            ("content_block_start", {"type": "content_block_start", "index": 0,
             "content_block": {"type": "text", "text": ""}}),
            ("content_block_delta", {"type": "content_block_delta", "index": 0,
             "delta": {"type": "text_delta", "text": "Hello"}}),
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn",
             "stop_sequence": None}, "usage": {"output_tokens": 4}}),
            ("message_stop", {"type": "message_stop"}),
        ))  # fmt: skip

    @staticmethod
    async def _gemini(request: web.Request, model: str, path: str) -> web.StreamResponse:
        answer = {
            "candidates": [
                {"content": {"role": "model", "parts": [{"text": "Hello"}]}, "finishReason": "STOP"}
            ],
            "usageMetadata": {"promptTokenCount": 5, "candidatesTokenCount": 2,
                              "totalTokenCount": 7},
            "modelVersion": model,
        }  # fmt: skip
        if path.endswith(":streamGenerateContent"):
            return await _stream(request, sse(answer))
        return web.json_response(answer)


async def _stream(request: web.Request, body: bytes) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for piece in body.split(b"\n\n"):
        if piece:
            await resp.write(piece + b"\n\n")
    await resp.write_eof()
    return resp


def targets(url: str, **models: dict[str, Any]) -> dict[str, Any]:
    """The three providers on the stand-in, each with its ``models`` rules."""
    fast = {"retry": {"backoff_base_s": 0.001, "backoff_max_s": 0.005}}
    return {
        "openai": {
            "base_url": f"{url}/openai",
            "credential": {
                "header": "Authorization",
                "format": "Bearer {secret}",
                "default_ref": "env://TEST_OPENAI_KEY",
            },
            "endpoints": [{"path": "/v1/chat/completions", "methods": ["POST"]}],
            "usage": "openai",
            "models": models.get("openai", {}),
            **fast,
        },
        "anthropic": {
            "base_url": f"{url}/anthropic",
            "credential": {"header": "x-api-key", "default_ref": "env://TEST_ANTHROPIC_KEY"},
            "endpoints": [{"path": "/v1/messages", "methods": ["POST"]}],
            "usage": "anthropic",
            "models": models.get("anthropic", {}),
            **fast,
        },
        "gemini": {
            "base_url": f"{url}/gemini",
            "credential": {"header": "x-goog-api-key", "default_ref": "env://TEST_GEMINI_KEY"},
            "endpoints": [{"path": "/v1beta/models/*", "methods": ["POST"]}],
            "usage": "gemini",
            "models": models.get("gemini", {}),
            **fast,
        },
    }


RULES: dict[str, dict[str, Any]] = {
    "openai": {"allow": ["gpt-4o-2024-*", "gpt-4o-mini"], "pin": {"gpt-4o": SNAPSHOT}},
    "anthropic": {"allow": ["claude-3-5-sonnet-2024*"], "pin": {"claude-sonnet": CLAUDE}},
    "gemini": {"allow": ["gemini-1.5-flash-00*"], "pin": {"gemini-flash": GEMINI}},
}
TELEMETRY = {"models": ["gpt-4o*"]}
PRICES = {SNAPSHOT: {"input_usd_per_mtok": 2.5, "output_usd_per_mtok": 10.0}}


@pytest.fixture(autouse=True)
def _provider_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_ANTHROPIC_KEY", KEYS["anthropic"])
    monkeypatch.setenv("TEST_GEMINI_KEY", KEYS["gemini"])


Stack = tuple[FakeUpstream, StandIn, Sidecar]


@pytest.fixture
async def make_stack(
    upstream_factory: Callable[..., Awaitable[FakeUpstream]],
    sidecar_factory: Callable[..., Awaitable[Sidecar]],
) -> Callable[..., Awaitable[Stack]]:
    async def make(on_drift: str = "record", **extra: Any) -> Stack:
        standin = StandIn()
        up = await upstream_factory(standin)
        rules = {name: {**spec, "on_drift": on_drift} for name, spec in RULES.items()}
        policy = compile_policy(
            targets(up.url, **rules), **{"prices": PRICES, "telemetry": TELEMETRY, **extra}
        )
        return up, standin, await sidecar_factory(policy)

    return make


def oai(sc: Sidecar) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{sc.url}/proxy/openai/v1", api_key=PLACEHOLDER, max_retries=0
    )


def claude(sc: Sidecar) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url=f"{sc.url}/proxy/anthropic", api_key=PLACEHOLDER, max_retries=0
    )


def drift_count(sc: Sidecar, sent: str, answered: str, target: str = "openai") -> float:
    value = sc.gateway.metrics.registry.get_sample_value(
        "egress_gateway_model_drift_total",
        {"target": target, "sent": sent, "answered": answered},
    )
    return value or 0.0


def record_of(sc: Sidecar) -> dict[str, Any]:
    [record] = sc.audit_records()
    return record


# -- allow ---------------------------------------------------------------------------


async def test_an_allowed_model_passes_and_the_answer_says_both_models(make_stack) -> None:
    up, _, sc = await make_stack()
    async with oai(sc) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="gpt-4o-mini", messages=MESSAGES
        )
    answer = raw.parse()
    assert answer.model == "gpt-4o-mini"
    assert raw.headers["x-egress-model-requested"] == "gpt-4o-mini"
    assert raw.headers["x-egress-model-sent"] == "gpt-4o-mini"
    assert up.hits == 1
    record = record_of(sc)
    assert (record["model_requested"], record["model_sent"], record["model_drift"]) == (
        "gpt-4o-mini",
        "gpt-4o-mini",
        None,
    )


async def test_a_model_outside_allow_is_refused_with_nothing_sent(make_stack) -> None:
    up, _, sc = await make_stack()
    async with oai(sc) as client:
        with pytest.raises(openai.PermissionDeniedError) as caught:
            await client.chat.completions.create(model="gpt-4.5-preview", messages=MESSAGES)
    assert "gpt-4.5-preview" in caught.value.message
    async with claude(sc) as client:
        with pytest.raises(anthropic.PermissionDeniedError):
            await client.messages.create(
                model="claude-3-opus-20240229", max_tokens=8, messages=MESSAGES
            )
    async with sc.session.post(
        f"{sc.url}/proxy/gemini/v1beta/models/gemini-2.5-pro:generateContent",
        json={"contents": []},
    ) as resp:
        status, body = resp.status, await resp.json()
    assert status == 403
    assert body["error"]["status"] == "PERMISSION_DENIED"  # Gemini's own error shape
    assert up.hits == 0  # nothing sent, for any dialect
    records = sc.audit_records()
    assert [r["error_code"] for r in records] == ["PERMISSION_DENIED"] * 3
    assert [r["decision"] for r in records] == ["denied"] * 3
    assert [r["model_requested"] for r in records] == [
        "gpt-4.5-preview",
        "claude-3-opus-20240229",
        "gemini-2.5-pro",
    ]


async def test_the_envelope_is_refused_with_model_not_allowed(make_stack) -> None:
    up, _, sc = await make_stack()
    status, answer = await sc.call(
        envelope(
            target_system="openai",
            endpoint="/v1/chat/completions",
            parameters={"model": "o1-pro", "messages": MESSAGES},
        )
    )
    assert status == 403
    assert answer["error"]["code"] == "PERMISSION_DENIED"
    assert answer["error"]["details"]["reason"] == "model_not_allowed"
    assert answer["error"]["details"]["rules"] == ["target:openai"]
    assert up.hits == 0


async def test_shadow_mode_records_a_model_outside_allow_and_sends_it(
    upstream_factory: Callable[..., Awaitable[FakeUpstream]],
    sidecar_factory: Callable[..., Awaitable[Sidecar]],
) -> None:
    up = await upstream_factory(StandIn())
    rules = {"openai": {"allow": ["gpt-4o-mini"], "mode": "shadow"}}
    sc = await sidecar_factory(compile_policy(targets(up.url, **rules)))
    async with oai(sc) as client:
        answer = await client.chat.completions.create(model="o1-pro", messages=MESSAGES)
    assert answer.model == "o1-pro"
    assert up.hits == 1
    record = record_of(sc)
    assert record["decision"] == "shadow_denied"
    assert record["shadow_denied"] == ["models:target:openai"]
    shadow = sc.gateway.metrics.registry.get_sample_value(
        "egress_gateway_shadow_denials_total", {"kind": "models", "rule": "target:openai"}
    )
    assert shadow == 1


async def test_an_agents_allow_applies_with_the_targets(
    upstream_factory: Callable[..., Awaitable[FakeUpstream]],
    sidecar_factory: Callable[..., Awaitable[Sidecar]],
    tmp_path: Any,
) -> None:
    token = tmp_path / "token"
    token.write_text("agent-token-1")
    up = await upstream_factory(StandIn())
    agents = {"planner": {"token_ref": f"file://{token}", "models": {"allow": ["gpt-4o-mini"]}}}
    sc = await sidecar_factory(compile_policy(targets(up.url, **RULES), agents=agents))
    headers = {"x-egress-agent-token": "agent-token-1"}
    async with openai.AsyncOpenAI(
        base_url=f"{sc.url}/proxy/openai/v1",
        api_key=PLACEHOLDER,
        max_retries=0,
        default_headers=headers,
    ) as client:
        await client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
        with pytest.raises(openai.PermissionDeniedError) as caught:
            # The target allows the snapshot; the agent does not.
            await client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert "agent:planner" in caught.value.message
    assert up.hits == 1
    refused = sc.audit_records()[-1]
    assert refused["agent_id"] == "planner"
    assert (refused["model_requested"], refused["model_sent"]) == ("gpt-4o", SNAPSHOT)


# -- pin -----------------------------------------------------------------------------


async def test_an_alias_reaches_the_upstream_as_its_snapshot(make_stack) -> None:
    up, _, sc = await make_stack()
    async with oai(sc) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="gpt-4o", messages=MESSAGES
        )
    assert raw.parse().model == SNAPSHOT
    assert (raw.headers["x-egress-model-requested"], raw.headers["x-egress-model-sent"]) == (
        "gpt-4o",
        SNAPSHOT,
    )
    async with claude(sc) as client:
        message = await client.messages.create(
            model="claude-sonnet", max_tokens=8, messages=MESSAGES
        )
    assert message.model == CLAUDE
    async with sc.session.post(
        f"{sc.url}/proxy/gemini/v1beta/models/gemini-flash:generateContent",
        json={"contents": [{"role": "user", "parts": [{"text": "ping"}]}]},
    ) as resp:
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["modelVersion"] == GEMINI
    assert up.seen[0].json()["model"] == SNAPSHOT
    assert up.seen[1].json()["model"] == CLAUDE
    assert up.seen[2].path == f"/gemini/v1beta/models/{GEMINI}:generateContent"
    records = sc.audit_records()
    assert [(r["model_requested"], r["model_sent"]) for r in records] == [
        ("gpt-4o", SNAPSHOT),
        ("claude-sonnet", CLAUDE),
        ("gemini-flash", GEMINI),
    ]
    assert [r["model_drift"] for r in records] == [None, None, None]
    # Cost is the snapshot's (the policy prices it; the alias has no price here).
    assert records[0]["cost_model"] == SNAPSHOT
    assert records[0]["cost_usd"] == pytest.approx((11 * 2.5 + 7 * 10.0) / 1e6)


async def test_the_envelope_answer_names_both_models(make_stack) -> None:
    up, _, sc = await make_stack()
    cases = [
        ("openai", "/v1/chat/completions", {"model": "gpt-4o", "messages": MESSAGES}),
        (
            "anthropic",
            "/v1/messages",
            {"model": "claude-sonnet", "max_tokens": 8, "messages": MESSAGES},
        ),
        ("gemini", "/v1beta/models/gemini-flash:generateContent", {"contents": []}),
    ]
    for target, endpoint, parameters in cases:
        status, answer = await sc.call(
            envelope(
                target_system=target, endpoint=endpoint, parameters=parameters, api_key_ref=...
            )
        )
        assert status == 200, answer
        assert answer["model"]["requested"] == (parameters.get("model") or "gemini-flash")
    assert [s.path for s in up.seen] == [
        "/openai/v1/chat/completions",
        "/anthropic/v1/messages",
        f"/gemini/v1beta/models/{GEMINI}:generateContent",
    ]
    sent = [r["model_sent"] for r in sc.audit_records()]
    assert sent == [SNAPSHOT, CLAUDE, GEMINI]


async def test_a_budget_reserves_at_the_snapshots_price_not_the_alias(make_stack) -> None:
    # The alias is free in this policy, its snapshot is not: a budget too small for the
    # snapshot refuses the call, so the estimate was made for the model sent.
    prices = {**PRICES, "gpt-4o": {"input_usd_per_mtok": 0.0, "output_usd_per_mtok": 0.0}}
    budgets = {"tiny": {"limit_usd": 0.0001, "window": "daily", "applies_to": {"target": "openai"}}}
    up, _, sc = await make_stack(budgets=budgets, prices=prices)
    async with oai(sc) as client:
        with pytest.raises(openai.RateLimitError):  # BUDGET_EXCEEDED is a 429
            await client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=1000)
    assert up.hits == 0
    record = record_of(sc)
    assert record["error_code"] == "BUDGET_EXCEEDED"
    assert (record["model_sent"], record["cost_model"]) == (SNAPSHOT, SNAPSHOT)


# -- drift ---------------------------------------------------------------------------


async def test_drift_is_recorded_and_counted(make_stack) -> None:
    _up, standin, sc = await make_stack()
    standin.answer_as = OTHER
    async with oai(sc) as client:
        answer = await client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
        stream = await client.chat.completions.create(
            model="gpt-4o", messages=MESSAGES, stream=True
        )
        chunks = [chunk async for chunk in stream]
    assert answer.model == OTHER  # under on_drift: record, the answer passes
    assert chunks[0].model == OTHER
    drifts = [r["model_drift"] for r in sc.audit_records()]
    assert drifts == [{"sent": SNAPSHOT, "answered": OTHER}] * 2
    assert drift_count(sc, SNAPSHOT, OTHER) == 2


async def test_drift_on_every_dialect_envelope(make_stack) -> None:
    _up, standin, sc = await make_stack()
    standin.answer_as = "some-other-model"
    for target, endpoint, parameters in [
        ("anthropic", "/v1/messages", {"model": "claude-sonnet", "max_tokens": 8}),
        ("gemini", "/v1beta/models/gemini-flash:generateContent", {"contents": []}),
    ]:
        status, _ = await sc.call(
            envelope(
                target_system=target, endpoint=endpoint, parameters=parameters, api_key_ref=...
            )
        )
        assert status == 200
    drifts = [r["model_drift"] for r in sc.audit_records()]
    assert drifts == [
        {"sent": CLAUDE, "answered": "some-other-model"},
        {"sent": GEMINI, "answered": "some-other-model"},
    ]
    assert drift_count(sc, "_other", "_other", "anthropic") == 1  # not in telemetry.models
    assert drift_count(sc, "_other", "_other", "gemini") == 1


async def test_on_drift_refuse_withholds_a_whole_answer(make_stack) -> None:
    _up, standin, sc = await make_stack(on_drift="refuse")
    standin.answer_as = OTHER
    async with oai(sc) as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert caught.value.status_code == 502
    assert OTHER in caught.value.message
    record = record_of(sc)
    assert record["error_code"] == "DEPENDENCY_FAILED"
    assert record["model_drift"] == {"sent": SNAPSHOT, "answered": OTHER}
    assert record["attempts"] == 1  # not retried: the upstream gave another model
    assert drift_count(sc, SNAPSHOT, OTHER) == 1


async def test_on_drift_refuse_stops_a_stream_before_its_first_byte(make_stack) -> None:
    _up, standin, sc = await make_stack(on_drift="refuse")
    standin.answer_as = OTHER
    # Raw: the agent gets the refusal as the whole answer, not one event of the stream.
    async with sc.session.post(
        f"{sc.url}/proxy/openai/v1/chat/completions",
        json={"model": "gpt-4o", "messages": MESSAGES, "stream": True},
    ) as resp:
        status, content_type, body = resp.status, resp.content_type, await resp.read()
    assert status == 502
    assert content_type == "application/json"
    assert b"Hel" not in body
    assert b"chat.completion.chunk" not in body
    assert json.loads(body)["error"]["code"] == "DEPENDENCY_FAILED"
    # The SDKs raise at once, before any chunk.
    async with oai(sc) as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="gpt-4o", messages=MESSAGES, stream=True)
    assert caught.value.status_code == 502
    async with claude(sc) as client:
        with pytest.raises(anthropic.APIStatusError) as refused:
            await client.messages.create(
                model="claude-sonnet", max_tokens=8, messages=MESSAGES, stream=True
            )
    assert refused.value.status_code == 502
    records = sc.audit_records()
    assert all(r["time_to_first_byte_ms"] is None for r in records)  # nothing relayed
    assert [r["model_drift"]["answered"] for r in records] == [OTHER] * 3


async def test_a_stream_of_the_pinned_model_passes_under_refuse(make_stack) -> None:
    up, _, sc = await make_stack(on_drift="refuse")
    async with (
        claude(sc) as client,
        client.messages.stream(model="claude-sonnet", max_tokens=8, messages=MESSAGES) as stream,
    ):
        text = await stream.get_final_text()
        final = await stream.get_final_message()
    assert text == "Hello"
    assert final.model == CLAUDE
    async with sc.session.post(
        f"{sc.url}/proxy/gemini/v1beta/models/gemini-flash:streamGenerateContent?alt=sse",
        json={"contents": []},
    ) as resp:
        assert resp.status == 200
        assert GEMINI.encode() in await resp.read()
    records = sc.audit_records()
    assert [r["model_drift"] for r in records] == [None, None]
    assert [r["model_sent"] for r in records] == [CLAUDE, GEMINI]
    assert up.seen[1].path == f"/gemini/v1beta/models/{GEMINI}:streamGenerateContent"


async def test_an_envelope_stream_is_refused_before_its_first_event(make_stack) -> None:
    up, standin, sc = await make_stack(on_drift="refuse")
    standin.answer_as = OTHER
    env = envelope(
        target_system="openai",
        endpoint="/v1/chat/completions",
        parameters={"model": "gpt-4o", "messages": MESSAGES, "stream": True},
    )
    async with sc.session.post(
        sc.url + "/v1/calls", json=env, headers={"Accept": "text/event-stream"}
    ) as resp:
        status, content_type, body = resp.status, resp.content_type, await resp.read()
    assert (status, content_type) == (502, "application/json")
    answer = json.loads(body)
    assert answer["error"]["details"] == {
        "reason": "model_drift",
        "sent": SNAPSHOT,
        "answered": OTHER,
    }
    assert b"chat.completion.chunk" not in body
    # Without the Accept header the stream is assembled, and judged whole.
    status, answer = await sc.call(env)
    assert status == 502
    assert answer["error"]["details"]["reason"] == "model_drift"
    assert up.hits == 2


@pytest.mark.parametrize(
    "path",
    [
        "gemini-2.5-pro%3AgenerateContent",  # the upstream reads %3A as ':'
        "gemini-2.5-pro%3agenerateContent",
        "%67emini-2.5-pro:generateContent",  # an escaped letter: the same model
    ],
)
async def test_a_gemini_model_spelt_with_escapes_is_still_checked(make_stack, path: str) -> None:
    up, _, sc = await make_stack()
    async with sc.session.post(
        f"{sc.url}/proxy/gemini/v1beta/models/{path}", json={"contents": []}
    ) as resp:
        status, body = resp.status, await resp.json()
    assert status == 403, body
    assert up.hits == 0
    [record] = sc.audit_records()
    assert record["model_requested"] == "gemini-2.5-pro"


async def test_a_pinned_gemini_alias_spelt_with_escapes_is_sent_pinned(make_stack) -> None:
    up, _, sc = await make_stack()
    async with sc.session.post(
        f"{sc.url}/proxy/gemini/v1beta/models/gemini-flash%3AgenerateContent",
        json={"contents": [{"role": "user", "parts": [{"text": "ping"}]}]},
    ) as resp:
        assert resp.status == 200, await resp.text()
    assert up.seen[0].path == f"/gemini/v1beta/models/{GEMINI}:generateContent"


async def test_an_envelope_naming_a_gemini_model_with_escapes_is_still_checked(make_stack) -> None:
    up, _, sc = await make_stack()
    status, answer = await sc.call(
        envelope(
            target_system="gemini",
            endpoint="/v1beta/models/gemini-2.5-pro%3AgenerateContent",
            parameters={"contents": []},
            api_key_ref=None,
        )
    )
    assert status == 403, answer
    assert answer["error"]["details"]["reason"] == "model_not_allowed"
    assert up.hits == 0
