"""An OpenAI chat stream whose agent did not ask for its usage: the sidecar asks for it
(``stream_options.include_usage``), books it (tokens, cost), and the agent gets the
stream it asked for, byte for byte: no usage chunk, no ``"usage":null`` members."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from gateway.providers.openai import asking_usage, unasked_usage_removed
from tests.conftest import compile_policy, openai_target

PRICES = {"m": {"input_usd_per_mtok": 1.0, "output_usd_per_mtok": 2.0}}
USAGE = {"prompt_tokens": 1000, "completion_tokens": 500, "total_tokens": 1500}


def _chunk(content: str | None, *, usage: Any = ..., finish: str | None = None) -> bytes:
    delta = {"content": content} if content is not None else {}
    data: dict[str, Any] = {
        "id": "c-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    if usage is not ...:
        data["usage"] = usage
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def _stream_body(with_usage: bool) -> bytes:
    """What OpenAI sends: with include_usage, ``"usage":null`` on each chunk and a last
    chunk of usage with no choices."""
    u: Any = None if with_usage else ...
    body = _chunk("Hel", usage=u) + _chunk("lo", usage=u) + _chunk(None, usage=u, finish="stop")
    if with_usage:
        last = {"id": "c-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
        body += b"data: " + json.dumps({**last, "choices": [], "usage": USAGE}).encode() + b"\n\n"
    return body + b"data: [DONE]\n\n"


async def _openai(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    asked = (body.get("stream_options") or {}).get("include_usage") is True
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for event in _stream_body(asked).split(b"\n\n")[:-1]:
        await resp.write(event + b"\n\n")
    await resp.write_eof()
    return resp


async def _stack(upstream_factory, sidecar_factory):
    up = await upstream_factory(_openai)
    sc = await sidecar_factory(compile_policy({"openai": openai_target(up.url)}, prices=PRICES))
    return up, sc


async def test_the_agent_gets_its_stream_and_the_books_get_the_usage(
    upstream_factory, sidecar_factory
):
    up, sc = await _stack(upstream_factory, sidecar_factory)
    request = {"model": "m", "messages": [], "stream": True, "stream_options": {"x": 1}}
    async with sc.session.post(f"{sc.url}/proxy/openai/v1/chat/completions", json=request) as r:
        got = await r.read()
    assert got == _stream_body(with_usage=False)  # exactly what it asked for
    sent = up.seen[0].json()
    assert sent["stream_options"] == {"x": 1, "include_usage": True}
    [record] = sc.audit_records()
    assert record["success"] is True
    assert record["tokens_used"] == 1500
    assert abs(record["cost_usd"] - 0.002) < 1e-9
    assert record["cost_reason"] is None


async def test_an_agent_that_asked_gets_the_usage_chunk_unchanged(
    upstream_factory, sidecar_factory
):
    up, sc = await _stack(upstream_factory, sidecar_factory)
    request = {
        "model": "m",
        "messages": [],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with sc.session.post(f"{sc.url}/proxy/openai/v1/chat/completions", json=request) as r:
        got = await r.read()
    assert got == _stream_body(with_usage=True)
    assert up.seen[0].json()["stream_options"] == {"include_usage": True}
    [record] = sc.audit_records()
    assert record["tokens_used"] == 1500


def test_asking_usage_touches_only_chat_streams_that_did_not_ask() -> None:
    chat = "/v1/chat/completions"
    assert asking_usage(chat, {"stream": True}) == {
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert asking_usage(chat, {"stream": False}) is None
    assert asking_usage(chat, {"stream": True, "stream_options": {"include_usage": True}}) is None
    assert asking_usage("/v1/responses", {"stream": True}) is None
    assert asking_usage(chat, {"stream": True, "stream_options": "odd"}) is None


def test_the_removal_keeps_every_other_event() -> None:
    assert unasked_usage_removed(_stream_body(with_usage=True)) == _stream_body(False)
    crlf = _stream_body(with_usage=True).replace(b"\n\n", b"\r\n\r\n")
    assert unasked_usage_removed(crlf) == _stream_body(False).replace(b"\n\n", b"\r\n\r\n")
    other = b'event: x\ndata: {"usage":{"a":1},"choices":[{"i":0}]}\n\n'
    assert unasked_usage_removed(other) == other


def test_the_removal_is_the_same_event_by_event() -> None:
    # The relay hands in one event at a time (paced upstreams): each alone is rewritten
    # as it is inside the whole stream, the usage chunk dropped, "usage":null removed.
    body = _stream_body(with_usage=True)
    events = [event + b"\n\n" for event in body.split(b"\n\n")[:-1]]
    assert len(events) > 2
    assert b"".join(events) == body
    rewritten = [unasked_usage_removed(event) for event in events]
    assert b"".join(rewritten) == unasked_usage_removed(body) == _stream_body(False)
    assert b"" in rewritten  # the usage chunk, alone, is dropped
    assert b'"usage":null' in events[0]  # compact, as _chunk writes it
    assert all(b'"usage":null' not in event for event in rewritten)
