"""The drop-in provider routes with the providers' real SDKs.

The OpenAI, Anthropic and Google Gen AI SDKs are pointed at a real sidecar on loopback
(``base_url=.../proxy/{target}``) with a placeholder key; loopback stand-ins answer as the
providers do (JSON, event streams, binary, errors) and check the key the sidecar
injected. Sync clients run in a thread (they block), async ones in the test's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import openai
import pytest
from aiohttp import web
from google import genai
from google.genai import errors as genai_errors
from google.genai import types as genai_types

from tests.conftest import FakeUpstream, Sidecar, compile_policy

PLACEHOLDER = "sk-agent-placeholder-NOT-A-KEY"
KEYS = {
    "openai": "sk-fake-TEST-0001-NOTREAL",
    "anthropic": "ak-fake-TEST-0002-NOTREAL",
    "gemini": "gk-fake-TEST-0003-NOTREAL",
}
#: Bytes of every value, so that any decoding or re-encoding on the way would show.
AUDIO = bytes(range(256)) * 257
CHAT_USAGE = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}


def sse(*events: Any, newline: str = "\n") -> bytes:
    """An SSE body: each event a dict (its data), a str (raw data) or (event, data)."""
    out = []
    for item in events:
        name, data = item if isinstance(item, tuple) else (None, item)
        text = data if isinstance(data, str) else json.dumps(data)
        out.append((f"event: {name}{newline}" if name else "") + f"data: {text}{newline}{newline}")
    return "".join(out).encode()


def chat_chunk(content: str | None, finish: str | None = None) -> dict[str, Any]:
    delta = {"content": content} if content is not None else {}
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "gpt-test",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


CHAT_STREAM = sse(
    chat_chunk("Hel"),
    chat_chunk("lo"),
    chat_chunk(None, "stop"),
    {**chat_chunk(None), "choices": [], "usage": CHAT_USAGE},
    "[DONE]",
)
RESPONSE = {
    "id": "resp_1",
    "object": "response",
    "created_at": 1,
    "model": "gpt-test",
    "status": "completed",
    "output": [
        {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Hello", "annotations": []}],
        }
    ],
    "parallel_tool_calls": True,
    "tool_choice": "auto",
    "tools": [],
    "usage": {
        "input_tokens": 9,
        "output_tokens": 3,
        "total_tokens": 12,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": 0},
    },
}
RESPONSE_STREAM = sse(
    ("response.created", {"type": "response.created", "sequence_number": 0, "response": {
        **RESPONSE, "status": "in_progress", "output": [], "usage": None}}),
    ("response.output_text.delta", {"type": "response.output_text.delta", "sequence_number": 1,
     "item_id": "msg_1", "output_index": 0, "content_index": 0, "delta": "Hello",
     "logprobs": []}),
    ("response.completed", {"type": "response.completed", "sequence_number": 2,
     "response": RESPONSE}),
)  # fmt: skip
MESSAGE = {
    "id": "msg_01",
    "type": "message",
    "role": "assistant",
    "model": "claude-test",
    "content": [{"type": "text", "text": "Hello"}],
    "stop_reason": "end_turn",
    "stop_sequence": None,
    "usage": {"input_tokens": 20, "output_tokens": 4},
}
MESSAGE_EVENTS = (
    ("message_start", {"type": "message_start", "message": {
        **MESSAGE, "content": [], "stop_reason": None,
        "usage": {"input_tokens": 20, "output_tokens": 1}}}),
    ("content_block_start", {"type": "content_block_start", "index": 0,
     "content_block": {"type": "text", "text": ""}}),
    ("content_block_delta", {"type": "content_block_delta", "index": 0,
     "delta": {"type": "text_delta", "text": "Hel"}}),
    ("content_block_delta", {"type": "content_block_delta", "index": 0,
     "delta": {"type": "text_delta", "text": "lo"}}),
    ("content_block_stop", {"type": "content_block_stop", "index": 0}),
    ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn",
     "stop_sequence": None}, "usage": {"output_tokens": 4}}),
    ("message_stop", {"type": "message_stop"}),
)  # fmt: skip
GEMINI = {
    "candidates": [
        {"content": {"role": "model", "parts": [{"text": "Hello"}]}, "finishReason": "STOP"}
    ],
    "usageMetadata": {"promptTokenCount": 5, "candidatesTokenCount": 2, "totalTokenCount": 7},
}
GEMINI_STREAM = sse(
    {"candidates": [{"content": {"role": "model", "parts": [{"text": "Hel"}]}}]},
    GEMINI | {"candidates": [{**GEMINI["candidates"][0], "content": {
        "role": "model", "parts": [{"text": "lo"}]}}]},
    newline="\r\n",
)  # fmt: skip


def _unauthorized(provider: str, request: web.Request) -> web.Response | None:
    """The provider's 401 unless the request carries the key the sidecar injects."""
    got = {
        "openai": request.headers.get("Authorization"),
        "anthropic": request.headers.get("x-api-key"),
        "gemini": request.headers.get("x-goog-api-key"),
    }[provider]
    expected = KEYS[provider] if provider != "openai" else f"Bearer {KEYS['openai']}"
    if got == expected:
        return None
    return web.json_response({"error": {"message": "bad key", "type": "auth"}}, status=401)


async def _stream(request: web.Request, body: bytes) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for piece in body.split(b"\n\n"):  # event by event, as the providers send them
        if piece:
            await resp.write(piece + b"\n\n")
    await resp.write_eof()
    return resp


async def providers_handler(request: web.Request) -> web.StreamResponse:
    """Answers as OpenAI (``/openai``), Anthropic (``/anthropic``) and Gemini (``/gemini``)."""
    provider, _, path = request.path.removeprefix("/").partition("/")
    denied = _unauthorized(provider, request)
    if denied is not None:
        return denied
    path = "/" + path
    raw = await request.read()
    body = json.loads(raw) if request.content_type == "application/json" and raw else {}
    if path == "/v1/chat/completions":
        if body.get("stream"):
            return await _stream(request, CHAT_STREAM)
        return web.json_response(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 1,
                "model": body["model"],
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
    if path == "/v1/responses":
        if body.get("stream"):
            return await _stream(request, RESPONSE_STREAM)
        return web.json_response(RESPONSE)
    if path == "/v1/messages":
        if body.get("stream"):
            return await _stream(request, sse(*MESSAGE_EVENTS))
        return web.json_response(MESSAGE)
    if path.endswith(":generateContent"):
        return web.json_response(GEMINI)
    if path.endswith(":streamGenerateContent"):
        return await _stream(request, GEMINI_STREAM.replace(b"\r\n\r\n", b"\n\n"))
    if path == "/v1/audio/speech":
        return web.Response(body=AUDIO, content_type="audio/mpeg")
    if path == "/v1/files":
        return web.json_response(
            {
                "id": "file-1",
                "object": "file",
                "bytes": len(raw),
                "created_at": 1,
                "filename": "upload.bin",
                "purpose": "batch",
                "status": "processed",
            }
        )
    return web.json_response({"error": {"message": f"no route {path}"}}, status=404)


def targets(url: str, **overrides: Any) -> dict[str, Any]:
    """Policy targets for the three providers on the stand-in at ``url``."""
    fast = {"retry": {"backoff_base_s": 0.001, "backoff_max_s": 0.005}}
    found = {
        "openai": {
            "base_url": f"{url}/openai",
            "credential": {
                "header": "Authorization",
                "format": "Bearer {secret}",
                "default_ref": "env://TEST_OPENAI_KEY",
            },
            "endpoints": [{"path": "/v1/**", "methods": ["GET", "POST"]}],
            "usage": "openai",
            **fast,
        },
        "anthropic": {
            "base_url": f"{url}/anthropic",
            "credential": {"header": "x-api-key", "default_ref": "env://TEST_ANTHROPIC_KEY"},
            "endpoints": [{"path": "/v1/messages", "methods": ["POST"]}],
            "usage": "anthropic",
            **fast,
        },
        "gemini": {
            "base_url": f"{url}/gemini",
            "credential": {"header": "x-goog-api-key", "default_ref": "env://TEST_GEMINI_KEY"},
            "endpoints": [
                {"path": "/v1/models/gemini-test:generateContent", "methods": ["POST"]},
                {"path": "/v1/models/gemini-test:streamGenerateContent", "methods": ["POST"]},
            ],
            "usage": "gemini",
            **fast,
        },
    }
    for name, spec in overrides.items():
        found[name] = {**found[name], **spec}
    return found


@pytest.fixture(autouse=True)
def _provider_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_ANTHROPIC_KEY", KEYS["anthropic"])
    monkeypatch.setenv("TEST_GEMINI_KEY", KEYS["gemini"])


@pytest.fixture
async def stack(
    upstream_factory: Callable[..., Awaitable[FakeUpstream]],
    sidecar_factory: Callable[..., Awaitable[Sidecar]],
) -> tuple[FakeUpstream, Sidecar]:
    up = await upstream_factory(providers_handler)
    sc = await sidecar_factory(compile_policy(targets(up.url)))
    return up, sc


def assert_key_injected(up: FakeUpstream) -> None:
    """Every request the stand-in saw had the sidecar's key and none of the agent's."""
    assert up.seen
    for seen in up.seen:
        assert PLACEHOLDER not in json.dumps(seen.headers) + json.dumps(seen.query)
        assert not any(k.lower().startswith("x-stainless") for k in seen.headers)


def proxy_record(sc: Sidecar) -> dict[str, Any]:
    [record] = sc.audit_records()
    assert record["api"] == "proxy"
    return record


def oai(sc: Sidecar, mode: str, **kwargs: Any) -> Any:
    cls = openai.OpenAI if mode == "sync" else openai.AsyncOpenAI
    return cls(base_url=f"{sc.url}/proxy/openai/v1", api_key=PLACEHOLDER, **kwargs)


def claude(sc: Sidecar, mode: str, **kwargs: Any) -> Any:
    cls = anthropic.Anthropic if mode == "sync" else anthropic.AsyncAnthropic
    return cls(base_url=f"{sc.url}/proxy/anthropic", api_key=PLACEHOLDER, **kwargs)


async def run(mode: str, client: Any, call: Callable[[Any], Any]) -> Any:
    """``call(client)``: in a thread for a sync client, awaited for an async one."""
    if mode == "sync":
        with client:
            return await asyncio.to_thread(call, client)
    async with client:
        return await call(client)


MODES = pytest.mark.parametrize("mode", ["sync", "async"])
MESSAGES = [{"role": "user", "content": "ping"}]


@MODES
async def test_openai_chat_completion(stack, mode: str) -> None:
    up, sc = stack
    answer = await run(
        mode,
        oai(sc, mode),
        lambda c: c.chat.completions.create(model="gpt-test", messages=MESSAGES),
    )
    assert answer.choices[0].message.content == "Hello"
    assert answer.usage.total_tokens == 18
    assert_key_injected(up)
    assert up.seen[0].json() == {"model": "gpt-test", "messages": MESSAGES}
    record = proxy_record(sc)
    assert (record["endpoint"], record["tokens_used"], record["tokens_input"]) == (
        "/v1/chat/completions",
        18,
        11,
    )
    assert record["success"] is True


@MODES
async def test_openai_chat_completion_stream(stack, mode: str) -> None:
    up, sc = stack

    def sync(c: Any) -> str:
        stream = c.chat.completions.create(model="gpt-test", messages=MESSAGES, stream=True)
        return "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)

    async def async_(c: Any) -> str:
        stream = await c.chat.completions.create(model="gpt-test", messages=MESSAGES, stream=True)
        return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

    text = await run(mode, oai(sc, mode), sync if mode == "sync" else async_)
    assert text == "Hello"
    assert_key_injected(up)
    record = proxy_record(sc)
    assert record["stream"] is True
    assert record["stream_events"] == 5
    assert record["tokens_used"] == 18


@MODES
async def test_openai_responses_api(stack, mode: str) -> None:
    up, sc = stack
    answer = await run(
        mode, oai(sc, mode), lambda c: c.responses.create(model="gpt-test", input="ping")
    )
    assert answer.output_text == "Hello"
    assert proxy_record(sc)["tokens_used"] == 12
    assert_key_injected(up)


@MODES
async def test_openai_responses_api_stream(stack, mode: str) -> None:
    up, sc = stack

    def sync(c: Any) -> list[str]:
        return [e.type for e in c.responses.create(model="gpt-test", input="ping", stream=True)]

    async def async_(c: Any) -> list[str]:
        stream = await c.responses.create(model="gpt-test", input="ping", stream=True)
        return [e.type async for e in stream]

    kinds = await run(mode, oai(sc, mode), sync if mode == "sync" else async_)
    assert kinds == ["response.created", "response.output_text.delta", "response.completed"]
    record = proxy_record(sc)
    assert (record["stream"], record["tokens_used"]) == (True, 12)
    assert_key_injected(up)


@MODES
async def test_anthropic_messages(stack, mode: str) -> None:
    up, sc = stack
    answer = await run(
        mode,
        claude(sc, mode),
        lambda c: c.messages.create(model="claude-test", max_tokens=64, messages=MESSAGES),
    )
    assert answer.content[0].text == "Hello"
    assert_key_injected(up)
    assert up.seen[0].headers["anthropic-version"]  # the SDK's header passed
    record = proxy_record(sc)
    assert (record["tokens_input"], record["tokens_output"]) == (20, 4)


@MODES
async def test_anthropic_messages_stream(stack, mode: str) -> None:
    up, sc = stack

    def sync(c: Any) -> str:
        with c.messages.stream(model="claude-test", max_tokens=64, messages=MESSAGES) as s:
            return "".join(s.text_stream)

    async def async_(c: Any) -> str:
        async with c.messages.stream(model="claude-test", max_tokens=64, messages=MESSAGES) as s:
            return "".join([t async for t in s.text_stream])

    assert await run(mode, claude(sc, mode), sync if mode == "sync" else async_) == "Hello"
    record = proxy_record(sc)
    assert (record["stream"], record["tokens_used"]) == (True, 24)
    assert_key_injected(up)


@contextlib.asynccontextmanager
async def gemini_client(sc: Sidecar) -> AsyncIterator[genai.Client]:
    # Its async client over httpx2, the SDK's own option: with aiohttp installed it would
    # subclass aiohttp's ClientSession, which aiohttp warns about (an error here).
    transport = httpx2.AsyncClient()
    client = genai.Client(
        api_key=PLACEHOLDER,
        http_options=genai_types.HttpOptions(
            base_url=f"{sc.url}/proxy/gemini", httpx_async_client=transport
        ),
    )
    try:
        yield client
    finally:
        await asyncio.to_thread(client.close)
        await client.aio.aclose()
        await transport.aclose()


@MODES
async def test_gemini_generate_content(stack, mode: str) -> None:
    up, sc = stack
    async with gemini_client(sc) as client:
        if mode == "sync":
            answer = await asyncio.to_thread(
                client.models.generate_content, model="gemini-test", contents="ping"
            )
        else:
            answer = await client.aio.models.generate_content(model="gemini-test", contents="ping")
    assert answer.text == "Hello"
    assert up.seen[0].path == "/gemini/v1/models/gemini-test:generateContent"
    assert_key_injected(up)
    assert proxy_record(sc)["tokens_used"] == 7


@MODES
async def test_gemini_stream_generate_content(stack, mode: str) -> None:
    up, sc = stack
    async with gemini_client(sc) as client:
        if mode == "sync":

            def read() -> str:
                stream = client.models.generate_content_stream(model="gemini-test", contents="x")
                return "".join(chunk.text or "" for chunk in stream)

            text = await asyncio.to_thread(read)
        else:
            stream = await client.aio.models.generate_content_stream(
                model="gemini-test", contents="x"
            )
            text = "".join([chunk.text or "" async for chunk in stream])
    assert text == "Hello"
    assert up.seen[0].query == {"alt": "sse"}
    record = proxy_record(sc)
    assert (record["stream"], record["tokens_used"]) == (True, 7)
    assert_key_injected(up)


async def test_a_multipart_upload_arrives_byte_for_byte(stack) -> None:
    up, sc = stack
    async with oai(sc, "async") as client:
        made = await client.files.create(file=("upload.bin", AUDIO), purpose="batch")
    [seen] = up.seen
    assert seen.headers["Content-Type"].startswith("multipart/form-data; boundary=")
    assert AUDIO in seen.body  # the file's bytes, unchanged inside the multipart body
    assert made.bytes == len(seen.body)
    record = proxy_record(sc)
    assert record["request_bytes"] == len(seen.body)


async def test_an_audio_answer_comes_back_byte_for_byte(stack) -> None:
    up, sc = stack
    async with oai(sc, "async") as client:
        speech = await client.audio.speech.create(model="tts-test", voice="alloy", input="hi")
        assert speech.response.headers["content-type"] == "audio/mpeg"
        assert speech.content == AUDIO
    assert_key_injected(up)
    assert proxy_record(sc)["response_bytes"] == len(AUDIO)


# -- refusals and failures raise the SDK's own classes ------------------------------------


async def test_an_endpoint_outside_the_allowlist_is_the_sdks_permission_denied(stack) -> None:
    up, sc = stack
    async with claude(sc, "async") as client:
        with pytest.raises(anthropic.PermissionDeniedError) as caught:
            await client.models.list()
    assert "not allowed on target 'anthropic'" in str(caught.value)
    assert caught.value.response.headers["x-egress-error-code"] == "PERMISSION_DENIED"
    assert caught.value.response.headers["x-egress-retryable"] == "false"
    assert up.hits == 0
    assert proxy_record(sc)["decision"] == "denied"


async def test_an_openai_refusal_names_the_code_and_the_message(stack) -> None:
    up, sc = stack
    async with openai.AsyncOpenAI(
        base_url=f"{sc.url}/proxy/nowhere/v1", api_key=PLACEHOLDER, max_retries=0
    ) as client:
        with pytest.raises(openai.PermissionDeniedError) as caught:
            await client.chat.completions.create(model="gpt-test", messages=MESSAGES)
    assert caught.value.code == "PERMISSION_DENIED"
    assert "target_system 'nowhere' is not in this sidecar's policy" in caught.value.message
    assert up.hits == 0


async def test_a_spent_rate_limit_group_is_the_sdks_rate_limit_error(
    upstream_factory, sidecar_factory
) -> None:
    up = await upstream_factory(providers_handler)
    policy = compile_policy(
        targets(up.url, openai={"rate_limit_group": "llm"}),
        rate_limit_groups={"llm": {"requests_per_second": 0.01, "burst": 1, "max_queue_s": 0}},
    )
    sc = await sidecar_factory(policy)
    async with oai(sc, "async", max_retries=0) as client:
        await client.chat.completions.create(model="gpt-test", messages=MESSAGES)
        with pytest.raises(openai.RateLimitError) as caught:
            await client.chat.completions.create(model="gpt-test", messages=MESSAGES)
    headers = caught.value.response.headers
    assert headers["x-egress-error-code"] == "CAPACITY_EXCEEDED"
    assert int(headers["retry-after"]) >= 1
    assert caught.value.code == "CAPACITY_EXCEEDED"
    assert up.hits == 1


async def test_a_body_over_the_limit_is_an_api_status_error(upstream_factory, sidecar_factory):
    up = await upstream_factory(providers_handler)
    sc = await sidecar_factory(compile_policy(targets(up.url), server={"max_request_bytes": 4096}))
    async with oai(sc, "async", max_retries=0) as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.files.create(file=("big.bin", AUDIO), purpose="batch")
    assert type(caught.value) is openai.APIStatusError  # 413 has no class of its own
    assert caught.value.status_code == 413
    assert "server.max_request_bytes" in caught.value.message
    assert up.hits == 0
    assert proxy_record(sc)["error_code"] == "INVALID_PAYLOAD"


async def test_an_outcome_unknown_is_not_retried_by_the_sdk(upstream_factory, sidecar_factory):
    async def hang_up(request: web.Request) -> web.StreamResponse:
        await request.read()
        assert request.transport is not None
        request.transport.close()  # the request arrived; its answer never comes
        return web.Response()

    up = await upstream_factory(hang_up)
    strict = {"retry": {"backoff_base_s": 0.001, "resend_unanswered": False}}
    sc = await sidecar_factory(compile_policy(targets(up.url, openai=strict)))
    async with oai(sc, "async", max_retries=2) as client:
        with pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(model="gpt-test", messages=MESSAGES)
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert caught.value.code == "OUTCOME_UNKNOWN"
    assert up.hits == 1  # neither the sidecar nor the SDK sent it again


async def test_spent_quota_is_passed_on_and_the_sdk_does_not_resend_it(
    upstream_factory, sidecar_factory
):
    quota = {"message": "You exceeded your current quota", "type": "insufficient_quota"}

    async def spent(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {**quota, "code": "insufficient_quota"}}, status=429)

    up = await upstream_factory(spent)
    sc = await sidecar_factory(compile_policy(targets(up.url)))
    async with oai(sc, "async", max_retries=2) as client:
        with pytest.raises(openai.RateLimitError) as caught:
            await client.chat.completions.create(model="gpt-test", messages=MESSAGES)
    assert caught.value.code == "insufficient_quota"  # the provider's own answer
    headers = caught.value.response.headers
    assert (headers["x-egress-error-code"], headers["x-should-retry"]) == (
        "QUOTA_EXHAUSTED",
        "false",
    )
    assert up.hits == 1  # neither the sidecar nor the SDK resent it


async def test_the_sdks_own_retries_get_one_attempt_each(upstream_factory, sidecar_factory):
    async def busy(request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {"error": {"message": "busy", "type": "server_error"}},
            status=503,
            headers={"retry-after-ms": "1"},
        )

    up = await upstream_factory(busy)
    sc = await sidecar_factory(compile_policy(targets(up.url)))  # policy: 3 retries
    async with oai(sc, "async", max_retries=1) as client:
        with pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(model="gpt-test", messages=MESSAGES)
    assert caught.value.message == "Error code: 503 - busy"  # the upstream's own answer
    assert caught.value.response.headers["x-egress-error-code"] == "DEPENDENCY_FAILED"
    counts = [s.headers.get("x-stainless-retry-count") for s in up.seen]
    assert counts == [None] * 5  # SDK telemetry never reaches the upstream
    assert up.hits == 4 + 1  # the SDK's first attempt: 1 + 3 retries; its retry: 1
    first, second = sc.audit_records()
    assert (first["attempts"], second["attempts"]) == (4, 1)
    assert any("x-stainless-retry-count: 1" in w for w in second["warnings"])


async def _read_chat(stream: Any, got: list[str]) -> None:
    async for chunk in stream:
        got.append(chunk.choices[0].delta.content)


async def _read_message(client: Any, got: list[str]) -> None:
    async with client.messages.stream(
        model="claude-test", max_tokens=64, messages=MESSAGES
    ) as stream:
        async for text in stream.text_stream:
            got.append(text)


async def _read_gemini(client: genai.Client) -> None:
    stream = await client.aio.models.generate_content_stream(model="gemini-test", contents="x")
    async for _ in stream:
        pass


def _cut_after(body: bytes, *, abort: bool) -> Callable[[web.Request], Awaitable[Any]]:
    """A handler that streams ``body`` and then ends without the terminal marker: a clean
    end, or (``abort``) a connection dropped in the middle of an event."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(body)
        if abort:
            await resp.write(b'data: {"half an eve')
            assert request.transport is not None
            request.transport.close()
            return resp
        await resp.write_eof()
        return resp

    return handler


async def test_a_chat_stream_ended_without_its_marker_raises(upstream_factory, sidecar_factory):
    up = await upstream_factory(_cut_after(sse(chat_chunk("Hel")), abort=False))
    sc = await sidecar_factory(compile_policy(targets(up.url)))
    got: list[str] = []
    async with oai(sc, "async", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model="gpt-test", messages=MESSAGES, stream=True
        )
        with pytest.raises(openai.APIError) as caught:
            await _read_chat(stream, got)
    assert got == ["Hel"]  # what arrived was relayed, then the provider's error event
    assert caught.value.code == "STREAM_INTERRUPTED"
    assert "without its terminal marker" in caught.value.message
    assert proxy_record(sc)["error_code"] == "STREAM_INTERRUPTED"


async def test_an_anthropic_stream_cut_mid_event_raises(upstream_factory, sidecar_factory):
    up = await upstream_factory(_cut_after(sse(*MESSAGE_EVENTS[:3]), abort=True))
    sc = await sidecar_factory(compile_policy(targets(up.url)))
    got: list[str] = []
    async with claude(sc, "async", max_retries=0) as client:
        with pytest.raises(anthropic.APIStatusError) as caught:
            await _read_message(client, got)
    assert got == ["Hel"]
    assert "closed the stream mid-way" in str(caught.value)
    assert proxy_record(sc)["error_code"] == "STREAM_INTERRUPTED"


async def test_a_gemini_stream_cut_raises_and_a_refusal_is_a_client_error(
    upstream_factory, sidecar_factory
):
    first = sse({"candidates": [{"content": {"role": "model", "parts": [{"text": "Hel"}]}}]})
    up = await upstream_factory(_cut_after(first, abort=True))
    sc = await sidecar_factory(compile_policy(targets(up.url)))
    async with gemini_client(sc) as client:
        with pytest.raises(genai_errors.ServerError) as caught:
            await _read_gemini(client)
        with pytest.raises(genai_errors.ClientError) as refused:
            await client.aio.models.embed_content(model="gemini-test", contents="ping")
    assert caught.value.code == 502
    assert "closed the stream mid-way" in str(caught.value.message)
    assert refused.value.code == 403
    assert refused.value.status == "PERMISSION_DENIED"
    assert os.environ["TEST_GEMINI_KEY"] not in json.dumps(refused.value.details)


def test_the_sdk_example_runs_against_the_demo_stand_ins(tmp_path) -> None:
    example = Path(__file__).resolve().parent.parent / "examples" / "sdk_openai.py"
    done = subprocess.run(
        [sys.executable, str(example)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,  # it finds the policy beside itself, wherever it is run from
    )
    assert done.returncode == 0, done.stderr
    assert "chat:     '1. Freeze. 2. Test. 3. Tag and publish.'" in done.stdout
    assert "streamed: 'Hello!'" in done.stdout
    assert "refused:  PermissionDeniedError PERMISSION_DENIED" in done.stdout
    assert done.stdout.count("api=proxy") == 3
