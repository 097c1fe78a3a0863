"""A header line aiohttp refuses to write is left out, and the answer is still written
whole, well framed, and audited once.

aiohttp's writer refuses a head holding a control character (other than HTAB) in a
header name or value: it raises while the answer is prepared, before anything is sent.
Every API filters what it passes back, but the one answer writer (gateway.api.writer)
must not depend on it: such a line is left out, the rest of the answer goes out (a
stream's head too, the stream then relayed), the call's one audit record notes it, and
nothing crashes. The API here is the envelope API with one more header line on its
answers and stream heads, on the real calls application, behind a real upstream.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from gateway.api import http
from gateway.api.envelope import _Exchange
from gateway.api.http import Answer, Head, Incoming
from gateway.envelope import ExternalCallResponse
from gateway.server.app import create_app
from gateway.server.runtime import Gateway
from tests.conftest import SidecarServer, compile_policy, envelope, openai_target
from tests.rawhttp import LineSink, exchange, request

Factory = Callable[..., Awaitable[Any]]
BAD = ("X-Unwritable", "a\x01b")  # a control character: aiohttp's writer raises on it
PATH = "/test/calls"


class _Careless(_Exchange):
    """The envelope API, adding :data:`BAD` to every answer and stream head."""

    def answer(self, status: int, response: ExternalCallResponse) -> Answer:
        whole = super().answer(status, response)
        whole.headers = [*whole.headers, BAD]
        return whole

    def head(self) -> Head:
        head = super().head()
        return Head(head.status, [*dict(head.headers).items(), BAD], head.reason)


async def _sidecar(url: str) -> tuple[SidecarServer, LineSink]:
    log = LineSink()
    gateway = Gateway(compile_policy({"fake-openai": openai_target(url)}), log_stream=log)
    app = create_app(gateway)

    def begin(incoming: Incoming) -> _Careless:
        return _Careless(gateway, incoming)

    app.router.add_post(PATH, http.handler(begin, "handler_error"))
    server = SidecarServer(app, host="127.0.0.1")
    await server.start_server()
    return server, log


async def _chat_stream(request_: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request_)
    chunk = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}
    await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n")
    await resp.write_eof()
    return resp


def _no_crash(caplog: pytest.LogCaptureFixture, log: LineSink) -> None:
    crashed = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not crashed, crashed
    lines = [json.loads(line) for line in log.lines]
    assert not [line for line in lines if line.get("level") == "error"], lines


async def test_a_whole_answer_goes_out_without_the_line(
    upstream_factory: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    up = await upstream_factory()
    server, log = await _sidecar(up.url)
    try:
        body = json.dumps(envelope()).encode()
        one = request(body, ("Content-Type", "application/json"), path=PATH)
        got = await exchange(server.port, one + one, answers=2)  # two on one connection
        assert [a.status for a in got.answers] == [200, 200]
        for answer in got.answers:
            assert answer.envelope().success is True
            assert "x-unwritable" not in answer.headers
        assert got.rest == b""  # nothing more: each answer framed by its Content-Length
        records = log.records()
        assert len(records) == 2
        assert all(r["success"] is True for r in records)
        assert all(any("X-Unwritable" in w for w in r["warnings"]) for r in records)
        _no_crash(caplog, log)
    finally:
        await server.close()


async def test_a_stream_is_opened_without_the_line(
    upstream_factory: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    up = await upstream_factory(_chat_stream)
    server, log = await _sidecar(up.url)
    try:
        one = request(
            json.dumps(envelope()).encode(),
            ("Content-Type", "application/json"),
            ("Accept", "text/event-stream"),
            ("Connection", "close"),
            path=PATH,
        )
        got = await _read_all(server.port, one)
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK")
        assert b"x-unwritable" not in head.lower()
        assert b"transfer-encoding: chunked" in head.lower()
        events = _unchunked(body)
        assert b"data: [DONE]" in events
        final = events.rsplit(b"event: egress.response\ndata: ", 1)[1]
        assert json.loads(final)["success"] is True
        [record] = log.records()
        assert record["success"] is True
        assert record["stream"] is True
        assert any("X-Unwritable" in w for w in record["warnings"])
        _no_crash(caplog, log)
    finally:
        await server.close()


async def _read_all(port: int, raw: bytes) -> bytes:
    """What the sidecar writes on a connection that sent ``raw``, until it closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    async with asyncio.timeout(5):
        data = await reader.read()
    writer.close()
    return data


def _unchunked(body: bytes) -> bytes:
    """A chunked body's content; fails on a body that is not well framed."""
    out = b""
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            assert body == b"\r\n", body
            return out
        out += body[:size]
        assert body[size : size + 2] == b"\r\n", body[: size + 2]
        body = body[size + 2 :]
