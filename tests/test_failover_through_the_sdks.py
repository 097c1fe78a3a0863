"""Failover through the drop-in route with the real OpenAI and Anthropic SDKs (their own
retries left on), whole and streamed: a fallback serves what failed before any byte
reached the agent, ``x-egress-served-by`` says who; a stream cut or stalled after its
first event ends as the provider's error event, never spliced with a fallback's."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import openai
import pytest
from aiohttp import web

from tests.conftest import compile_policy, openai_target

AGENT = "sk-agent-placeholder-NOT-A-KEY"


def _chunk(content: str | None, model: str, finish: str | None = None) -> bytes:
    delta = {"content": content} if content is not None else {}
    data = {
        "id": "c-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(data).encode() + b"\n\n"


async def _serve(request: web.Request, events: int = 3, cut_after: int | None = None) -> Any:
    """A chat completion of ``events`` content chunks (whole, or streamed when asked),
    its connection dropped after ``cut_after`` of them."""
    body = await request.json()
    model = body["model"]
    if not body.get("stream"):
        return web.json_response(
            {
                "id": "c-1",
                "object": "chat.completion",
                "created": 1,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": f"from {model}"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
            }
        )
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for n in range(events):
        if cut_after is not None and n == cut_after:
            assert request.transport is not None
            request.transport.close()  # the connection lost mid-stream
            return resp
        await resp.write(_chunk(f"{model}:{n} ", model))
    await resp.write(_chunk(None, model, "stop") + b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _unavailable(_: web.Request) -> web.StreamResponse:
    return web.json_response({"error": {"message": "down", "type": "server_error"}}, status=503)


async def _stack(upstream_factory, sidecar_factory, primary_handler, **primary: Any):
    primary_up = await upstream_factory(primary_handler)
    backup_up = await upstream_factory(_serve)
    spec = openai_target(primary_up.url, **primary)
    spec["fallbacks"] = [{"target": "backup", "model": "backup-model"}]
    policy = compile_policy({"primary": spec, "backup": openai_target(backup_up.url)})
    sc = await sidecar_factory(policy)
    return primary_up, backup_up, sc


async def test_openai_sdk_gets_the_fallbacks_answer_and_who_served_it(
    upstream_factory, sidecar_factory
):
    primary, backup, sc = await _stack(upstream_factory, sidecar_factory, _unavailable)
    async with openai.AsyncOpenAI(base_url=f"{sc.url}/proxy/primary/v1", api_key=AGENT) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="primary-model", messages=[{"role": "user", "content": "hi"}]
        )
    completion = raw.parse()
    assert completion.choices[0].message.content == "from backup-model"
    assert raw.headers["x-egress-served-by"] == "target=backup; model=backup-model"
    assert primary.hits == 4  # the policy's 3 retries, once: the SDK saw a success
    assert backup.hits == 1
    [record] = sc.audit_records()
    assert record["api"] == "proxy"
    assert record["served_by"] == {"target": "backup", "model": "backup-model"}


async def test_openai_sdk_stream_that_stalls_before_its_first_event_is_served_elsewhere(
    upstream_factory, sidecar_factory
):
    release = asyncio.Event()

    async def stalls(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await release.wait()  # headers sent, then nothing while the call runs
        return resp

    primary, backup, sc = await _stack(
        upstream_factory, sidecar_factory, stalls, first_byte_timeout_s=0.3
    )
    try:
        async with openai.AsyncOpenAI(
            base_url=f"{sc.url}/proxy/primary/v1", api_key=AGENT
        ) as client:
            raw = await client.chat.completions.with_raw_response.create(
                model="primary-model", messages=[], stream=True
            )
            text = "".join([c.choices[0].delta.content or "" async for c in raw.parse()])
    finally:
        release.set()
    assert text == "backup-model:0 backup-model:1 backup-model:2 "
    assert raw.headers["x-egress-served-by"] == "target=backup; model=backup-model"
    assert primary.hits == 1  # a POST answered 200 then silent: not resent to the primary
    assert backup.hits == 1
    [record] = sc.audit_records()
    assert record["success"] is True
    assert record["tried"][0]["outcome"] == "STREAM_INTERRUPTED"


@pytest.mark.parametrize("cut", ["connection", "stall"])
async def test_a_stream_cut_after_its_first_events_is_never_spliced(
    upstream_factory, sidecar_factory, cut: str
):
    release = asyncio.Event()

    async def partial(request: web.Request) -> web.StreamResponse:
        if cut == "connection":
            return await _serve(request, events=60, cut_after=40)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for n in range(40):
            await resp.write(_chunk(f"primary-model:{n} ", "primary-model"))
        await release.wait()  # stalls with the connection open
        return resp

    _, backup, sc = await _stack(
        upstream_factory, sidecar_factory, partial, stream_idle_timeout_s=0.3
    )
    got: list[str] = []
    try:
        async with openai.AsyncOpenAI(
            base_url=f"{sc.url}/proxy/primary/v1", api_key=AGENT, max_retries=2
        ) as client:
            stream = await client.chat.completions.create(
                model="primary-model", messages=[], stream=True
            )
            with pytest.raises(openai.APIError):  # noqa: PT012 - the events come first
                async for chunk in stream:
                    got.append(chunk.choices[0].delta.content or "")
    finally:
        release.set()
    # The primary's prefix, nothing after it.
    assert got == [f"primary-model:{n} " for n in range(40)]
    assert backup.hits == 0
    [record] = sc.audit_records()
    assert record["error_code"] == "STREAM_INTERRUPTED"
    assert record["served_by"] is None


MESSAGE_EVENTS = [
    ("message_start", {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-backup",
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 20, "output_tokens": 1}}}),
    ("content_block_start", {"type": "content_block_start", "index": 0,
     "content_block": {"type": "text", "text": ""}}),
    ("content_block_delta", {"type": "content_block_delta", "index": 0,
     "delta": {"type": "text_delta", "text": "Hello"}}),
    ("content_block_stop", {"type": "content_block_stop", "index": 0}),
    ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn",
     "stop_sequence": None}, "usage": {"output_tokens": 4}}),
    ("message_stop", {"type": "message_stop"}),
]  # fmt: skip


def _anthropic_target(url: str) -> dict[str, Any]:
    return {
        "base_url": url,
        "credential": {"header": "x-api-key", "default_ref": "env://TEST_OPENAI_KEY"},
        "endpoints": [{"path": "/v1/messages", "methods": ["POST"]}],
        "usage": "anthropic",
        "retry": {"backoff_base_s": 0.01, "backoff_max_s": 0.05},
    }


async def test_anthropic_sdk_stream_is_served_by_the_fallback_after_529s(
    upstream_factory, sidecar_factory
):
    async def overloaded(_: web.Request) -> web.StreamResponse:
        error = {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}
        return web.json_response(error, status=529)

    async def streams(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for name, data in MESSAGE_EVENTS:
            await resp.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())
        await resp.write_eof()
        return resp

    primary = await upstream_factory(overloaded)
    backup = await upstream_factory(streams)
    spec = _anthropic_target(primary.url)
    spec["fallbacks"] = [{"target": "backup", "model": "claude-backup"}]
    sc = await sidecar_factory(
        compile_policy({"primary": spec, "backup": _anthropic_target(backup.url)})
    )
    async with (
        anthropic.AsyncAnthropic(base_url=f"{sc.url}/proxy/primary", api_key=AGENT) as client,
        client.messages.stream(
            model="claude-primary", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
        ) as stream,
    ):
        text = "".join([t async for t in stream.text_stream])
        message = await stream.get_final_message()
    assert text == "Hello"
    assert message.model == "claude-backup"
    assert primary.hits == 4  # the policy's own 3 retries of the 529
    assert backup.hits == 1
    assert backup.seen[0].json()["model"] == "claude-backup"
    [record] = sc.audit_records()
    assert record["served_by"] == {"target": "backup", "model": "claude-backup"}
    assert record["tokens_output"] == 4
