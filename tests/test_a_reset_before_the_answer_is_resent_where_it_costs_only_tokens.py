"""A connection reset before the answer's head, on a provider dialect's inference
endpoint (a chat completion), is sent again without an idempotency key, as every
provider SDK does: a duplicate costs tokens, never a side effect. The target's
``retry.resend_unanswered: false`` keeps the strict rule (OUTCOME_UNKNOWN, sent once);
so does every other endpoint, a target without a provider dialect, and an answer lost
after it began. Real loopback stand-ins, the real OpenAI SDK on the drop-in route."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web

from gateway.budgets import NANO_USD
from gateway.call.retry import transport_retryable, unanswered_resendable
from gateway.cli import main
from gateway.policy import DEFAULT_RETRY_ON
from gateway.providers import resendable
from tests.conftest import compile_policy, envelope, openai_target
from tests.test_budgets import ACTUAL_USD, COMPLETION, MESSAGES, PRICES, RESERVED_USD
from tests.test_proxy_sdk import PLACEHOLDER

FAST = {"backoff_base_s": 0.001, "backoff_max_s": 0.005}


def _reset_first(then: dict[str, Any]) -> Any:
    """A stand-in that reads the first request and closes its connection before any
    answer byte, then answers every later one with ``then``."""
    seen = 0

    async def handler(request: web.Request) -> web.StreamResponse:
        nonlocal seen
        seen += 1
        await request.read()
        if seen == 1:
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        return web.json_response(then)

    return handler


def _policy(url: str, *, budget: bool = False, **retry: Any) -> Any:
    target = openai_target(url, retry={**FAST, **retry})
    target["endpoints"].append({"path": "/v1/files", "methods": ["POST"]})
    budgets = {}
    if budget:
        applies = {"target": "openai"}
        budgets = {"day": {"limit_usd": 100.0, "window": "daily", "applies_to": applies}}
    return compile_policy({"openai": target}, prices=PRICES, budgets=budgets)


def _spent_usd(sc: Any) -> float:
    budgets = sc.gateway.pipeline.budgets
    [budget] = budgets.applying("openai", None, "test-agent")
    return float(budgets.ledger.spent(budget, time.time()) / NANO_USD)


@pytest.mark.parametrize("sdk_retries", [0, 2], ids=["sdk-retries-off", "sdk-retries-on"])
async def test_the_drop_in_route_gets_the_answer_after_a_reset_before_any_byte(
    upstream_factory: Any, sidecar_factory: Any, sdk_retries: int
) -> None:
    up = await upstream_factory(_reset_first(COMPLETION))
    sc = await sidecar_factory(_policy(up.url, budget=True))
    client = openai.AsyncOpenAI(
        base_url=f"{sc.url}/proxy/openai/v1", api_key=PLACEHOLDER, max_retries=sdk_retries
    )
    async with client:
        answer = await client.chat.completions.create(
            model="fake-model-1", messages=MESSAGES, max_tokens=10
        )
    assert answer.choices[0].message.content == "pong"
    assert answer.usage is not None
    assert answer.usage.total_tokens == 4
    assert up.hits == 2  # the sidecar resent it once; the SDK never had to
    assert up.seen[0].body == up.seen[1].body  # the same request, unchanged
    [record] = sc.audit_records()  # one call: the SDK sent it once
    assert record["api"] == "proxy"
    assert record["attempts"] == 2
    first, second = record["tried"]
    assert (first["outcome"], first["reason"], first["upstream_status"]) == (
        "DEPENDENCY_FAILED",
        "reset",
        None,
    )
    assert first["response_bytes"] is None
    assert (second["outcome"], second["upstream_status"]) == ("ok", 200)
    assert second["model"] == "fake-model-1"
    # The answer's usage is counted once; the lost attempt keeps only its reservation
    # (it reached the provider, which may have billed it), never a second usage.
    assert (record["tokens_used"], record["cost_usd"]) == (4, pytest.approx(ACTUAL_USD))
    assert _spent_usd(sc) == pytest.approx(ACTUAL_USD + RESERVED_USD)


async def test_the_switch_off_keeps_a_reset_chat_completion_unknown_and_unsent(
    upstream_factory: Any, sidecar_factory: Any
) -> None:
    up = await upstream_factory(_reset_first(COMPLETION))
    sc = await sidecar_factory(_policy(up.url, max_retries=2, resend_unanswered=False))
    status, answer = await sc.call(envelope(target_system="openai", max_retries=2))
    assert (status, answer["error"]["code"], answer["error"]["retryable"]) == (
        502,
        "OUTCOME_UNKNOWN",
        False,
    )
    assert up.hits == 1
    [record] = sc.audit_records()
    assert (record["attempts"], record["tried"]) == (1, None)  # not retried: no list


async def test_the_envelope_gets_the_answer_after_a_reset_with_the_switch_on_by_default(
    upstream_factory: Any, sidecar_factory: Any
) -> None:
    up = await upstream_factory(_reset_first(COMPLETION))
    sc = await sidecar_factory(_policy(up.url, max_retries=2))
    status, answer = await sc.call(envelope(target_system="openai", max_retries=2))
    assert (status, answer["success"], answer["tokens_used"]) == (200, True, 4)
    assert up.hits == 2


async def test_a_non_inference_endpoint_of_a_provider_stays_strict(
    upstream_factory: Any, sidecar_factory: Any
) -> None:
    up = await upstream_factory(_reset_first({"id": "file-1"}))
    sc = await sidecar_factory(_policy(up.url, max_retries=2))
    call = envelope(target_system="openai", endpoint="/v1/files", max_retries=2)
    call["parameters"] = {"purpose": "batch"}
    _, answer = await sc.call(call)
    assert answer["error"]["code"] == "OUTCOME_UNKNOWN"
    assert up.hits == 1  # an upload sent twice is two files


async def test_a_target_without_a_provider_dialect_stays_strict(
    upstream_factory: Any, sidecar_factory: Any
) -> None:
    up = await upstream_factory(_reset_first({"ok": True}))
    target = openai_target(up.url, usage="none", retry={**FAST, "max_retries": 2})
    sc = await sidecar_factory(compile_policy({"orders": target}))
    _, answer = await sc.call(envelope(target_system="orders", max_retries=2))
    assert answer["error"]["code"] == "OUTCOME_UNKNOWN"
    assert up.hits == 1  # a POST of a plain API may have acted: never resent unkeyed


async def test_an_answer_lost_after_its_head_stays_unknown(
    upstream_factory: Any, sidecar_factory: Any
) -> None:
    async def cut(request: web.Request) -> web.StreamResponse:
        await request.read()
        answer = web.StreamResponse(headers={"Content-Type": "application/json"})
        answer.content_length = 1000
        await answer.prepare(request)
        await answer.write(b'{"choices": [')  # the head and a part of the body
        assert request.transport is not None
        request.transport.close()
        return answer

    up = await upstream_factory(cut)
    sc = await sidecar_factory(_policy(up.url, max_retries=2))
    _, answer = await sc.call(envelope(target_system="openai", max_retries=2))
    assert answer["error"]["code"] == "OUTCOME_UNKNOWN"
    assert up.hits == 1  # the upstream had answered: this is not a lost request


def test_resend_unanswered_true_needs_a_provider_dialect(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(
        "version: 1\nagent_id: a\ntargets:\n  orders:\n"
        "    base_url: https://orders.example.com\n"
        "    endpoints: [{path: /v1/orders, methods: [POST]}]\n"
        "    retry: {resend_unanswered: true}\n"
    )
    assert main(["validate", "--no-env-check", str(path)]) == 1
    err = capsys.readouterr().err.replace(str(path), "P")
    assert err.startswith("P:7: targets.orders.retry.resend_unanswered: needs 'usage'"), err
    assert "'idempotency' block" in err


@pytest.mark.parametrize(
    ("provider", "endpoint", "parameters", "expected"),
    [
        ("openai", "/v1/chat/completions", {"model": "m"}, True),
        ("openai", "/v1/completions", {}, True),
        ("openai", "/v1/embeddings", {}, True),
        ("openai", "/v1/chat/completions", {"store": True}, False),  # kept on their side
        ("openai", "/v1/responses", {}, False),  # stored by default, remote tools
        ("openai", "/v1/files", {}, False),
        ("openai", "/v1/batches", {}, False),
        ("anthropic", "/v1/messages", {"model": "m"}, True),
        ("anthropic", "/v1/messages", {"mcp_servers": [{"url": "x"}]}, False),
        ("anthropic", "/v1/messages/batches", {}, False),
        ("gemini", "/v1beta/models/g:generateContent", {}, True),
        ("gemini", "/v1beta/models/g:streamGenerateContent", {}, True),
        ("gemini", "/v1beta/models/g:embedContent", {}, True),
        ("gemini", "/v1beta/files", {}, False),
        ("none", "/v1/chat/completions", {}, False),
    ],
)
def test_which_requests_cost_only_tokens_when_sent_twice(
    provider: str, endpoint: str, parameters: dict[str, Any], expected: bool
) -> None:
    assert resendable(provider, endpoint, parameters) is expected
    assert unanswered_resendable(None, provider, endpoint, parameters) is expected
    assert unanswered_resendable(False, provider, endpoint, parameters) is False


@pytest.mark.parametrize(
    ("kind", "answered", "allowed", "expected"),
    [
        ("reset", False, True, (True, False)),  # lost before the answer: resent
        ("reset", False, False, (False, True)),  # the switch off: unknown
        ("reset", True, True, (False, True)),  # lost after the answer began: unknown
        ("timeout", False, True, (False, True)),  # silent: a fallback, not a resend
    ],
)
def test_a_sent_post_without_a_key_is_resent_only_when_reset_unanswered_and_allowed(
    kind: str, answered: bool, allowed: bool, expected: tuple[bool, bool]
) -> None:
    got = transport_retryable(
        kind,  # type: ignore[arg-type]
        sent=True,
        method="POST",
        has_idempotency_key=False,
        retry_on=DEFAULT_RETRY_ON,
        answered=answered,
        resend_unanswered=allowed,
    )
    assert got == expected
