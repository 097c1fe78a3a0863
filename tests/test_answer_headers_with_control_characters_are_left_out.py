"""An upstream answer header whose name or value holds a control character (``\\x01``,
NUL, ``\\x7f``...: RFC 9110 section 5.5 allows none but HTAB) is left out of the answer,
which is delivered: aiohttp's writer raises on such a header, and the agent got an empty
reply (connection closed) for a call audited as a success. Real sidecar, raw loopback
upstream (aiohttp's server would refuse to send such a header).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.api import answers
from gateway.api.answers import passback_headers, passback_reason
from tests.conftest import compile_policy, envelope, openai_target
from tests.rawhttp import read_message

BODY = b'{"id":"chatcmpl-1","object":"chat.completion","choices":[]}'
EVENTS = (
    b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'
    b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}\n\n'
    b"data: [DONE]\n\n"
)
#: The control characters aiohttp's client reads in a value (it refuses CR, LF and NUL).
CONTROL_HEADERS = b"X-C: a\x01b\r\nX-Esc: a\x1bb\r\nX-Del: a\x7fb\r\nX-Tab: a\tb\r\n"


@pytest.fixture
async def upstream() -> AsyncIterator[Callable[[bytes, bytes], int]]:
    servers: list[asyncio.Server] = []

    async def start(content_type: bytes, body: bytes) -> int:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_message(reader)
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\n%sX-Plain: ok\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (content_type, CONTROL_HEADERS, len(body), body)
            )
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        servers.append(server)
        return int(server.sockets[0].getsockname()[1])

    yield start  # type: ignore[misc]
    for server in servers:
        server.close()
        await server.wait_closed()


def _kept(headers: aiohttp.typedefs.LooseHeaders) -> None:
    names = {name.lower() for name in headers}  # type: ignore[union-attr]
    assert {"x-c", "x-esc", "x-del"}.isdisjoint(names)
    assert headers["X-Plain"] == "ok"  # type: ignore[index]
    assert headers["X-Tab"] == "a\tb"  # type: ignore[index]


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_control_character_in_an_answer_header_leaves_that_header_out(
    upstream, sidecar_factory, streamed: bool
):
    content_type, body = (b"text/event-stream", EVENTS) if streamed else (b"application/json", BODY)
    port = await upstream(content_type, body)
    sc = await sidecar_factory(
        compile_policy({"fake-openai": openai_target(f"http://127.0.0.1:{port}")})
    )
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": streamed}
    url = f"{sc.url}/proxy/fake-openai/v1/chat/completions"
    for _ in range(2):  # routed header by header, then by the plan of these names
        async with sc.session.post(url, json=chat) as resp:
            assert resp.status == 200
            assert await resp.read() == body
            _kept(resp.headers)
    records = sc.audit_records()
    assert [(r["success"], r["status_code"]) for r in records] == [(True, 200)] * 2


async def test_the_envelope_route_answers_such_an_upstream_as_usual(upstream, sidecar_factory):
    port = await upstream(b"application/json", BODY)
    sc = await sidecar_factory(
        compile_policy({"fake-openai": openai_target(f"http://127.0.0.1:{port}")})
    )
    status, answer = await sc.call(envelope())
    assert status == 200
    assert answer["error"] is None


@pytest.mark.parametrize("bad", ["a\x01b", "a\rb", "a\nb", "a\x00b", "a\x1fb", "a\x7fb"])
def test_both_header_routings_leave_out_a_value_holding_a_control_character(bad: str) -> None:
    names = ("X-Bad", "X-Tab", "X-Plain")
    plain = CIMultiDictProxy(CIMultiDict(zip(names, ("b", "c", "ok"), strict=True)))
    passback_headers(plain)  # routed header by header; these names are planned
    given = CIMultiDictProxy(CIMultiDict(zip(names, (bad, "a\tb", "ok"), strict=True)))
    assert passback_headers(given) == [("X-Tab", "a\tb"), ("X-Plain", "ok")]
    assert answers._routed(given, names) == [("X-Tab", "a\tb"), ("X-Plain", "ok")]
    assert passback_reason(f"OK {bad}") is None
    assert passback_reason("OK caf\u00e9") == "OK caf\u00e9"
