"""The drop-in routes and the stream relay against failure classes seen in similar systems
(../shared/cases.md; review of issue 15): credentials in any query spelling, encodings
the sidecar cannot undo, a stalled agent, path tricks, refusal shapes. Real servers on
loopback, raw sockets where an HTTP client would tidy the request up."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
from typing import Any

import openai
import pytest
from aiohttp import web

from gateway.call.sse import EventTooLarge, SseDecoder, complete_events
from tests.conftest import compile_policy, openai_target, wait_for

KEY = "sk-fake-TEST-0001-NOTREAL"
AGENT = "sk-agent-placeholder-NOT-A-KEY"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def _stack(upstream_factory: Any, sidecar_factory: Any, handler: Any = None, **target: Any):
    up = await (upstream_factory(handler) if handler else upstream_factory())
    sc = await sidecar_factory(compile_policy({"openai": openai_target(up.url, **target)}))
    return up, sc


async def _raw(port: int, head: bytes, *, read: bool = True) -> bytes:
    """Write ``head`` as it is on a new connection; what came back until the close."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10) if read else b""
    finally:
        writer.close()


# -- the agent's credentials, whatever they are called ---------------------------------


@pytest.mark.parametrize(
    "name", ["api_key", "apikey", "API-Key", "token", "access_token", "Key", "x-api-key"]
)
async def test_a_credential_in_the_query_is_never_forwarded(
    upstream_factory, sidecar_factory, name: str
):
    up, sc = await _stack(upstream_factory, sidecar_factory)
    url = f"{sc.url}/proxy/openai/v1/chat/completions"
    async with sc.session.post(url, json=CHAT, params={name: AGENT, "v": "1"}) as resp:
        assert resp.status == 200
    [seen] = up.seen
    assert AGENT not in json.dumps(seen.query) + json.dumps(seen.headers)
    assert seen.query == {"v": "1"}
    assert seen.headers["Authorization"] == f"Bearer {KEY}"


# -- a slow agent: backpressure, and a deadline that holds -------------------------------


def _endless_stream(closed: asyncio.Event) -> Any:
    """An upstream that streams 64 KiB events until its connection is closed."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = b'data: {"choices":[{"delta":{"content":"' + b"A" * 65536 + b'"}}]}\n\n'
        try:
            while True:
                await resp.write(chunk)
        except (ConnectionError, RuntimeError):
            pass
        finally:
            closed.set()
        return resp

    return handler


@pytest.mark.parametrize("route", ["proxy", "envelope"])
async def test_an_agent_that_stops_reading_is_cut_at_the_deadline(
    upstream_factory, sidecar_factory, route: str
):
    closed = asyncio.Event()
    _, sc = await _stack(upstream_factory, sidecar_factory, _endless_stream(closed))
    body = json.dumps({**CHAT, "stream": True}).encode()
    if route == "proxy":
        head = (
            b"POST /proxy/openai/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nx-egress-timeout: 1\r\n"
        )
    else:
        env = {"target_system": "openai", "endpoint": "/v1/chat/completions", "method": "POST"}
        ids = {"trace_id": "t-1", "correlation_id": "c-1", "timeout": 1}
        body = json.dumps({**env, **ids, "parameters": {**CHAT, "stream": True}}).encode()
        head = (
            b"POST /v1/calls HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Accept: text/event-stream\r\n"
        )
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", sc.server.port))
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        writer.write(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        status = await reader.readuntil(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 200"), status + await reader.read(2000)
        # ...and the agent reads nothing more: the sidecar's writes block on its window.
        await wait_for(lambda: bool(sc.audit_records()), timeout_s=8)
        await asyncio.wait_for(closed.wait(), 5)  # the upstream request was closed
    finally:
        writer.close()
    [record] = sc.audit_records()
    assert record["success"] is False
    assert record["error_code"] == "AGENT_TIMEOUT"
    assert record["latency_ms"] < 5000
    assert not [line for line in sc.lines() if line.get("level") == "error"]


# -- encodings ------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["x-gzip", "gzip, gzip", "compress"])
async def test_an_encoding_the_sidecar_did_not_undo_is_passed_back_with_its_header(
    upstream_factory, sidecar_factory, encoding: str
):
    plain = json.dumps({"ok": True}).encode()
    encoded = gzip.compress(gzip.compress(plain)) if "," in encoding else gzip.compress(plain)

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(
            body=encoded,
            headers={"Content-Type": "application/json", "Content-Encoding": encoding},
        )

    _, sc = await _stack(upstream_factory, sidecar_factory, handler)
    url = f"{sc.url}/proxy/openai/v1/chat/completions"
    async with sc.session.post(url, json=CHAT, auto_decompress=False) as resp:
        assert resp.status == 200
        got = await resp.read()
    # Either the body comes back decoded, or as it was sent with the header that says how.
    assert (got, resp.headers.get("Content-Encoding")) in {(plain, None), (encoded, encoding)}


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_an_encoding_the_sidecar_undid_comes_back_decoded(
    upstream_factory, sidecar_factory, encoding: str
):
    plain = json.dumps({"ok": True}).encode()

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.Response(body=plain, content_type="application/json")
        resp.enable_compression(web.ContentCoding(encoding))
        return resp

    _, sc = await _stack(upstream_factory, sidecar_factory, handler)
    url = f"{sc.url}/proxy/openai/v1/chat/completions"
    async with sc.session.post(url, json=CHAT, auto_decompress=False) as resp:
        assert (await resp.read(), resp.headers.get("Content-Encoding")) == (plain, None)


# -- refusals in the target's shape -------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "body", "status"),
    [
        ({"x-egress-timeout": "soon"}, b"{}", 400),
        ({"x-egress-timeout": "0"}, b"{}", 400),
        ({"x-egress-secret-ref": "env://HOME"}, b"{}", 403),
        ({}, b"x" * 8192, 413),
    ],
)
async def test_a_refusal_before_the_decision_has_the_targets_error_shape(
    upstream_factory, sidecar_factory, headers: dict[str, str], body: bytes, status: int
):
    up = await upstream_factory()
    spec = {
        "base_url": up.url,
        "credential": {"header": "x-api-key", "default_ref": "env://TEST_OPENAI_KEY"},
        "endpoints": [{"path": "/v1/messages", "methods": ["POST"]}],
        "usage": "anthropic",
    }
    sc = await sidecar_factory(compile_policy({"claude": spec}, server={"max_request_bytes": 4096}))
    url = f"{sc.url}/proxy/claude/v1/messages"  # no anthropic-version: curl, not the SDK
    headers = {"Content-Type": "application/json", **headers}
    async with sc.session.post(url, data=body, headers=headers) as resp:
        assert resp.status == status
        answer = await resp.json()
    assert answer["type"] == "error"  # Anthropic's shape, not OpenAI's
    assert answer["error"]["details"]["error_code"] == resp.headers["x-egress-error-code"]
    assert up.hits == 0


# -- only the sidecar speaks x-egress-* -------------------------------------------------


@pytest.mark.parametrize("status", [200, 503])
async def test_an_upstream_cannot_send_the_sidecars_own_headers(
    upstream_factory, sidecar_factory, status: int
):
    spoofed = {
        "x-egress-error-code": "SPOOFED",
        "X-Egress-Retryable": "true",
        "x-egress-trace-id": "not-this-call",
        "x-egress-replayed": "true",
    }

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "busy"}}, status=status, headers=spoofed)

    _, sc = await _stack(upstream_factory, sidecar_factory, handler, retry={"max_retries": 0})
    url = f"{sc.url}/proxy/openai/v1/chat/completions"
    async with sc.session.post(url, json=CHAT) as resp:
        assert resp.status == status
        headers = resp.headers
    [record] = sc.audit_records()
    assert headers.getall("x-egress-trace-id") == [record["trace_id"]]
    assert "x-egress-replayed" not in headers
    assert headers.get("x-upstream-egress-replayed") == "true"  # kept, under its own name
    if status == 200:
        assert "x-egress-error-code" not in headers
        assert "x-egress-retryable" not in headers
    else:
        assert headers.getall("x-egress-error-code") == ["DEPENDENCY_FAILED"]
        assert headers.getall("x-egress-retryable") == ["true"]


# -- the SDK's read timeout bounds each gap of a stream, not the whole stream ----------


async def test_a_stream_longer_than_the_sdks_read_timeout_is_not_cut(
    upstream_factory, sidecar_factory
):
    def chunk(delta: dict[str, str], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        data = {"id": "c-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
        return b"data: " + json.dumps({**data, "choices": [choice]}).encode() + b"\n\n"

    async def slow(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for n in range(8):  # 8 x 0.25 s: longer than the SDK's 1.5 s read timeout in all
            await resp.write(chunk({"content": str(n)}))
            await asyncio.sleep(0.25)  # the upstream's pace, not a synchronisation
        await resp.write(chunk({}, "stop") + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    _, sc = await _stack(upstream_factory, sidecar_factory, slow)
    async with openai.AsyncOpenAI(
        base_url=f"{sc.url}/proxy/openai/v1", api_key=AGENT, timeout=1.5, max_retries=0
    ) as client:
        stream = await client.chat.completions.create(model="m", messages=[], stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert text == "01234567"
    [record] = sc.audit_records()
    assert record["success"] is True


# -- one big event costs its length once, not its length per chunk ----------------------


class _Counted(bytearray):
    """A buffer that counts the bytes each ``rfind`` may look at."""

    looked = 0

    def rfind(self, sub: Any, start: Any = None, end: Any = None) -> int:  # type: ignore[override]
        _Counted.looked += len(self) - (start or 0)
        return super().rfind(sub, start, end)


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
def test_finding_whole_events_searches_each_byte_about_once(newline: bytes) -> None:
    big = b"data: " + b"A" * 200_000 + newline + newline
    stream = big + b"data: x" + newline + newline + big
    chunk = 1000
    held, cuts, sent = _Counted(), [], 0
    _Counted.looked = 0
    for at in range(0, len(stream), chunk):
        searched = len(held)
        held += stream[at : at + chunk]
        cut = complete_events(held, searched)
        assert cut == complete_events(bytes(held))  # the same answer as a full search
        if cut:
            cuts.append(sent + cut)
            sent += cut
            held = _Counted(held[cut:])
    assert cuts == [len(big) + len(newline) * 2 + 7, len(stream)]
    # 5 end marks, each searching the new bytes plus a few before: linear, not quadratic.
    assert _Counted.looked < 5 * (len(stream) + 4 * len(stream) // chunk)


def test_decoding_one_long_line_joins_it_once() -> None:
    decoder = SseDecoder(10_000_000)
    line = b"data: " + b"B" * 100_000
    for at in range(0, len(line), 100):
        assert decoder.feed(line[at : at + 100]) == []
    [event] = decoder.feed(b"\n\n")
    assert event.data == "B" * 100_000
    bounded = SseDecoder(1000)
    assert bounded.feed(b"data: " + b"C" * 600) == []
    with pytest.raises(EventTooLarge):  # a line growing in pieces is still bounded
        bounded.feed(b"C" * 600)


# -- an SDK's idempotency key reaches an upstream the sidecar does not dedupe for ---------


async def test_an_idempotency_key_goes_upstream_when_the_target_keeps_none(
    upstream_factory, sidecar_factory
):
    async def busy_once(request: web.Request) -> web.StreamResponse:
        if up.hits == 1:  # the first attempt fails; the SDK sends it again
            busy = {"error": {"message": "busy"}}
            return web.json_response(busy, status=503, headers={"retry-after-ms": "1"})
        return web.json_response({"id": "ch_1", "object": "charge"})

    up, sc = await _stack(upstream_factory, sidecar_factory, busy_once, retry={"max_retries": 0})
    async with openai.AsyncOpenAI(
        base_url=f"{sc.url}/proxy/openai/v1", api_key=AGENT, max_retries=1
    ) as client:
        answer = await client.post(
            "/chat/completions",
            body=CHAT,
            cast_to=object,
            options={"headers": {"Idempotency-Key": "idem-charge-1"}},
        )
    assert answer == {"id": "ch_1", "object": "charge"}
    # Stripe-like upstreams dedupe on the key the SDK sent: it must arrive, the same twice.
    keys = [{k.lower(): v for k, v in s.headers.items()}.get("idempotency-key") for s in up.seen]
    assert keys == ["idem-charge-1"] * 2


async def test_a_targets_own_idempotency_keeps_the_key_in_its_header(
    upstream_factory, sidecar_factory
):
    up, sc = await _stack(
        upstream_factory, sidecar_factory, idempotency={"header": "X-Request-Key"}
    )
    url = f"{sc.url}/proxy/openai/v1/chat/completions"
    for _ in range(2):
        async with sc.session.post(url, json=CHAT, headers={"Idempotency-Key": "k-7"}) as resp:
            assert resp.status == 200
    [seen] = up.seen  # the second was a replay
    assert seen.headers["X-Request-Key"] == "k-7"
    assert "idempotency-key" not in {k.lower() for k in seen.headers}


async def test_a_second_content_encoding_header_stays_with_the_layer_left(
    upstream_factory, sidecar_factory
):
    plain = json.dumps({"ok": True}).encode()

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.Response(body=gzip.compress(gzip.compress(plain)))
        resp.headers["Content-Type"] = "application/json"
        resp.headers.add("Content-Encoding", "gzip")
        resp.headers.add("Content-Encoding", "gzip")  # aiohttp undoes the first only
        return resp

    _, sc = await _stack(upstream_factory, sidecar_factory, handler)
    url = f"{sc.url}/proxy/openai/v1/chat/completions"
    async with sc.session.post(url, json=CHAT, auto_decompress=False) as resp:
        assert resp.headers.getall("Content-Encoding") == ["gzip"]
        assert gzip.decompress(await resp.read()) == plain
