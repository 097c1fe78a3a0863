"""Upstream header values that are not ASCII, passed back by the drop-in route.

UTF-8 values go back byte for byte. A value holding bytes that are not UTF-8 (RFC 9110
section 5.5's obs-text, e.g. Latin-1) cannot be written back unchanged by the sidecar's
HTTP writer (it writes UTF-8): it is not passed back, rather than passed altered (it
lost its non-UTF-8 bytes before: ``caf\\xe9`` arrived as ``caf``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gateway.api.answers import passback_headers
from tests.conftest import compile_policy, openai_target
from tests.rawhttp import read_message

BODY = b'{"id":"chatcmpl-1","object":"chat.completion","choices":[]}'
HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
    b"X-Latin: caf\xe9 cr\xe8me\r\nX-Utf8: cr\xc3\xa8me br\xc3\xbbl\xc3\xa9e\r\nX-Plain: ok\r\n"
)


@pytest.fixture
async def upstream() -> AsyncIterator[int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_message(reader)
        writer.write(HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


async def test_utf8_values_pass_unchanged_and_others_are_not_altered(upstream, sidecar_factory):
    sc = await sidecar_factory(
        compile_policy({"fake-openai": openai_target(f"http://127.0.0.1:{upstream}")})
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", sc.server.port)
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    writer.write(
        b"POST /proxy/fake-openai/v1/chat/completions HTTP/1.1\r\nHost: sidecar\r\n"
        b"Content-Type: application/json\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    raw = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, answer = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 200 OK"
    assert b"X-Utf8: cr\xc3\xa8me br\xc3\xbbl\xc3\xa9e" in lines
    assert b"X-Plain: ok" in lines
    assert not any(line.lower().startswith(b"x-latin") for line in lines)
    assert answer == BODY


def test_passback_keeps_text_and_drops_surrogate_escapes() -> None:
    given = {"X-A": "caf\udce9", "X-B": "crème", "X-C": "plain"}
    assert passback_headers(given) == [("X-B", "crème"), ("X-C", "plain")]
