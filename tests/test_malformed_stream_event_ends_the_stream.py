"""A malformed event inside a provider stream (data that starts like JSON and is not):
the relay has already sent it (it never holds bytes back to parse them), so the stream
ends after the read that carried it with the provider's error event
(STREAM_INTERRUPTED, reason ``malformed_event``); never a success."""

from __future__ import annotations

import json

from aiohttp import web

from tests.conftest import compile_policy, envelope, openai_target


def _chunk(content: str) -> bytes:
    data = {
        "id": "c-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
    }
    return b"data: " + json.dumps(data).encode() + b"\n\n"


async def _malformed(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(_chunk("one "))
    await resp.write(b'data: {"id": "c-1", "choices": [\n\n')  # cut inside its JSON
    await resp.write(_chunk("two "))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def test_the_stream_ends_at_the_malformed_event_with_an_error_event(
    upstream_factory, sidecar_factory
):
    up = await upstream_factory(_malformed)
    sc = await sidecar_factory(compile_policy({"openai": openai_target(up.url)}))
    request = {"model": "m", "messages": [], "stream": True}
    async with sc.session.post(f"{sc.url}/proxy/openai/v1/chat/completions", json=request) as r:
        got = await r.read()
    assert got.startswith(_chunk("one ") + b'data: {"id": "c-1", "choices": [\n\n')
    last = got.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]  # the provider's error event ends it
    error = json.loads(last.removeprefix(b"data: "))
    assert error["error"]["code"] == "STREAM_INTERRUPTED"
    assert "malformed event" in error["error"]["message"]
    [record] = sc.audit_records()
    assert record["success"] is False
    assert record["error_code"] == "STREAM_INTERRUPTED"


async def test_an_assembled_stream_with_a_malformed_event_is_not_a_success(
    upstream_factory, sidecar_factory
):
    up = await upstream_factory(_malformed)
    sc = await sidecar_factory(compile_policy({"fake-openai": openai_target(up.url)}))
    env = envelope(parameters={"model": "m", "stream": True, "messages": []}, max_retries=0)
    _, body = await sc.call(env)
    assert body["success"] is False
    assert body["error"]["code"] == "STREAM_INTERRUPTED"
    assert body["error"]["details"]["reason"] == "malformed_event"
