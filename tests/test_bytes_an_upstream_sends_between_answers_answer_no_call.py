"""Bytes an upstream sends on an idle keep-alive connection (after its answer ended,
before the next request) answer no call: a pooled connection holding such bytes is
closed, never reused, and the next call is sent on a fresh one and gets its own answer.

HTTP/1.1 has no way to tie an answer to a request but their order on the connection
(RFC 9112 section 9.3), so an unsolicited message read as the next call's answer shifts
every later answer on that connection by one: a call gets another call's body, or a
``408 Request Timeout`` that some servers send before closing an idle connection, while
its own request was carried out (a caller told 408 sends a charge again). Go's HTTP
client closes such a connection ("Unsolicited response received on idle HTTP channel").

A raw loopback upstream numbers its answers by the request they answer; the test waits
until the sidecar has read the stray bytes (the pooled connection holds them), then calls
again, on both the envelope route and the drop-in route.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.conftest import compile_policy, envelope, openai_target, wait_for
from tests.rawhttp import read_message


def _answer(body: bytes, status: str = "200 OK") -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    return head.encode() + b"\r\n\r\n" + body


def _numbered(n: int) -> bytes:
    return _answer(json.dumps({"answers_request": n, "choices": []}).encode())


STRAY = {
    "a-whole-answer": _numbered(99),
    "a-408-before-closing": _answer(b"", "408 Request Timeout"),
}


class Numbering:
    """Answers request n with ``{"answers_request": n}``; after the first answer, sends
    ``stray`` on the same connection once ``send_stray`` is set."""

    def __init__(self, stray: bytes) -> None:
        self.stray = stray
        self.requests = 0
        self.connections = 0
        self.send_stray = asyncio.Event()
        self.stray_sent = asyncio.Event()
        self.port = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                await read_message(reader)
                self.requests += 1
                writer.write(_numbered(self.requests))
                await writer.drain()
                if self.requests == 1:
                    await self.send_stray.wait()
                    writer.write(self.stray)
                    await writer.drain()
                    self.stray_sent.set()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the sidecar closed the connection
        finally:
            writer.close()


def _pooled_holding_bytes(sc: Any) -> bool:
    """The sidecar's pool has a connection with bytes read and not yet answering anything."""
    connector = sc.gateway._parts.upstream._session.connector
    return any(proto.should_close for conns in connector._conns.values() for proto, _ in conns)


async def _call(sc: Any, route: str) -> Any:
    if route == "envelope":
        status, answer = await sc.call(envelope(max_retries=0))
        assert status == 200, answer
        return answer["data"]
    url = f"{sc.url}/proxy/fake-openai/v1/chat/completions"
    async with sc.session.post(url, json=envelope()["parameters"]) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


@pytest.mark.parametrize("stray", list(STRAY), ids=list(STRAY))
@pytest.mark.parametrize("route", ["envelope", "proxy"])
async def test_bytes_sent_on_an_idle_connection_never_answer_the_next_call(
    sidecar_factory: Any, route: str, stray: str
) -> None:
    fake = Numbering(STRAY[stray])
    server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    fake.port = server.sockets[0].getsockname()[1]
    try:
        target = openai_target(f"http://127.0.0.1:{fake.port}")
        sc = await sidecar_factory(compile_policy({"fake-openai": target}))
        assert (await _call(sc, route))["answers_request"] == 1
        fake.send_stray.set()
        await asyncio.wait_for(fake.stray_sent.wait(), 5)
        await wait_for(lambda: _pooled_holding_bytes(sc))
        assert (await _call(sc, route))["answers_request"] == 2
        assert (await _call(sc, route))["answers_request"] == 3
        assert fake.connections == 2  # the one that carried stray bytes was not reused
        records = sc.audit_records()
        assert [r["status_code"] for r in records] == [200, 200, 200]
    finally:
        server.close()
        await server.wait_closed()
