"""Raw HTTP for the framing and fuzz tests: a client that writes bytes as given and
parses the answers, and a sidecar listener built as ``gateway serve`` builds it
(``create_app`` behind ``make_runner``, on 127.0.0.1 port 0) with its log kept as lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from gateway.audit.schema import AuditRecord
from gateway.envelope import ExternalCallResponse
from gateway.policy import PolicySet
from gateway.server.app import (
    BODY_TIMEOUT_S,
    KEEPALIVE_TIMEOUT_S,
    LINGERING_TIME_S,
    create_app,
    create_ops_app,
    make_runner,
)
from gateway.server.runtime import Gateway

# -- reading one message, for raw upstreams -----------------------------------------------


async def read_message(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One HTTP/1.1 message from ``reader``: its head (through the blank line) and its
    body, framed by ``Content-Length`` (none: no body)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    return head, await reader.readexactly(length)


# -- a raw HTTP/1.1 client --------------------------------------------------------------


@dataclass
class RawAnswer:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    @property
    def is_json(self) -> bool:
        return self.headers.get("content-type", "").startswith("application/json")

    def envelope(self) -> ExternalCallResponse:
        """The answer as the wire contract (raises if it is not one)."""
        assert self.is_json, (self.status, self.headers, self.body[:300])
        return ExternalCallResponse.model_validate_json(self.body)


@dataclass
class Exchange:
    answers: list[RawAnswer]
    closed: bool  # the sidecar closed the connection
    rest: bytes  # bytes after the last complete answer


def parse_answers(data: bytes) -> tuple[list[RawAnswer], bytes]:
    """The complete HTTP/1.x responses at the start of ``data`` (aiohttp always sends a
    Content-Length on the answers these tests get), and what follows them."""
    answers = []
    while b"\r\n\r\n" in data:
        head, rest = data.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        match = re.match(r"HTTP/\d\.\d (\d{3})", lines[0])
        assert match, lines[0]
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        if len(rest) < length:
            break
        answers.append(RawAnswer(int(match[1]), headers, rest[:length]))
        data = rest[length:]
    return answers, data


async def exchange(port: int, *parts: bytes, answers: int = 1, timeout_s: float = 5.0) -> Exchange:
    """Write ``parts`` (each on its own write) and read until the sidecar closes the
    connection or ``answers`` complete answers have arrived; fails past ``timeout_s``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = b""
    closed = False
    try:
        for part in parts:
            writer.write(part)
            try:
                await writer.drain()
            except ConnectionError:
                break  # the sidecar already answered and closed
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    chunk = await reader.read(65536)
                except ConnectionError:
                    chunk = b""
                if not chunk:
                    closed = True
                    break
                data += chunk
                if len(parse_answers(data)[0]) >= answers:
                    break
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    got, rest = parse_answers(data)
    return Exchange(got, closed, rest)


async def closed_within(port: int, send: bytes, *, timeout_s: float) -> bool:
    """True if the sidecar closes a connection (after ``send``) within ``timeout_s``,
    without answering anything."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if send:
            writer.write(send)
            await writer.drain()
        try:
            async with asyncio.timeout(timeout_s):
                return await reader.read(65536) == b""
        except TimeoutError:
            return False
    finally:
        writer.close()


def request(
    body: bytes,
    *headers: tuple[str, str],
    method: str = "POST",
    path: str = "/v1/calls",
    version: str = "HTTP/1.1",
    length: bool = True,
) -> bytes:
    """One request as bytes; ``length`` adds a correct Content-Length first."""
    lines = [f"{method} {path} {version}", "Host: 127.0.0.1"]
    if length:
        lines.append(f"Content-Length: {len(body)}")
    lines += [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def chunked(*chunks: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"


# -- a listener as `gateway serve` builds it ---------------------------------------------


class LineSink(io.TextIOBase):
    """A log stream that keeps complete lines (cheap to read incrementally)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._partial = ""

    def write(self, text: str) -> int:
        # JSON lines end at "\n" only (str.splitlines would split at U+2028 and others).
        *complete, self._partial = (self._partial + text).split("\n")
        self.lines.extend(line for line in complete if line.strip())
        return len(text)

    def records(self, start: int = 0) -> list[dict[str, Any]]:
        """The audit records from line ``start`` on, each checked against the schema."""
        found = []
        for line in self.lines[start:]:
            value = json.loads(line)
            if value.get("event") == "egress_call":
                AuditRecord.model_validate(value)
                found.append(value)
        return found


@dataclass
class Listener:
    gateway: Gateway
    runner: web.AppRunner
    port: int
    log: LineSink = field(repr=False)


@contextlib.asynccontextmanager
async def listening(
    policy: PolicySet,
    *,
    body_timeout_s: float = BODY_TIMEOUT_S,
    keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S,
    lingering_time_s: float = LINGERING_TIME_S,
    ops: bool = False,
) -> AsyncIterator[Listener]:
    """A started sidecar listener (the ops app with ``ops``), cleaned up on exit."""
    log = LineSink()
    gateway = Gateway(policy, log_stream=log)
    app = create_ops_app(gateway) if ops else create_app(gateway, body_timeout_s=body_timeout_s)
    runner = make_runner(
        app,
        keepalive_timeout_s=keepalive_timeout_s,
        lingering_time_s=lingering_time_s,
        handler_cancellation=False,
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        yield Listener(gateway, runner, port, log)
    finally:
        await runner.cleanup()
