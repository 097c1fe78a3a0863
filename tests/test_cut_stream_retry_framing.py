"""An assembled stream (the agent asked for none) that ends before its terminal marker
is retried alike whatever ended it: a connection close (no length, no chunks), a chunked
body whose connection breaks, either cut by a reset. Nothing reached the agent, so a
keyed call with retries left sends it again and answers the second, complete stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from tests.conftest import compile_policy, envelope, openai_target
from tests.rawhttp import read_message


def _chunk(content: str, finish: str | None) -> bytes:
    delta = {"index": 0, "delta": {"content": content}, "finish_reason": finish}
    data = {"object": "chat.completion.chunk", "choices": [delta]}
    return b"data: " + json.dumps(data).encode() + b"\n\n"


PART = _chunk("Hel", None)
WHOLE = PART + _chunk("lo", "stop") + b"data: [DONE]\n\n"
SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"


@dataclass
class RawStreams:
    """A raw upstream: the first request gets ``PART`` (``-empty``: not even that, only
    the head) and its connection ends as ``framing`` says (``close``: the body ends
    where the connection does; ``chunked``: the last chunk never comes; ``-reset``: the
    connection is aborted, not closed); later requests get the whole stream with a
    Content-Length."""

    framing: str
    port: int = 0
    hits: int = 0
    keys: list[str] = field(default_factory=list)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await read_message(reader)
        self.hits += 1
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"idempotency-key:"):
                self.keys.append(line.split(b":", 1)[1].strip().decode())
        part = b"" if self.framing.endswith("-empty") else PART
        if self.hits > 1:
            writer.write(SSE_HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(WHOLE), WHOLE))
        elif self.framing.startswith("close"):
            writer.write(SSE_HEAD + b"Connection: close\r\n\r\n" + part)
        else:
            chunk = b"%x\r\n%s\r\n" % (len(part), part) if part else b""
            writer.write(SSE_HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunk)
        await writer.drain()
        if self.framing.endswith("-reset") and self.hits == 1:
            writer.transport.abort()
            return
        writer.close()


@pytest.fixture
async def raw_streams(request: pytest.FixtureRequest) -> AsyncIterator[RawStreams]:
    fake = RawStreams(request.param)
    server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    fake.port = server.sockets[0].getsockname()[1]
    yield fake
    server.close()
    await server.wait_closed()


@pytest.mark.parametrize(
    "raw_streams",
    ["close", "close-reset", "chunked", "chunked-reset", "close-empty", "chunked-empty"],
    indirect=True,
)
async def test_a_keyed_call_retries_a_stream_cut_before_its_marker(raw_streams, sidecar_factory):
    target = openai_target(
        f"http://127.0.0.1:{raw_streams.port}", idempotency={"methods": ["POST"]}
    )
    sc = await sidecar_factory(compile_policy({"fake-openai": target}))
    status, answer = await sc.call(
        envelope(parameters={"model": "m", "stream": True}, max_retries=1)
    )
    assert status == 200, json.dumps(answer)[:600]
    assert answer["success"] is True
    assert answer["data"]["content"] == "Hello"
    assert raw_streams.hits == 2
    assert len(raw_streams.keys) == 2
    assert raw_streams.keys[0] == raw_streams.keys[1]
    [record] = sc.audit_records()
    assert record["attempts"] == 2


@pytest.mark.parametrize(
    ("provider", "status", "head", "expected"),
    [
        ("openai", 200, False, "STREAM_INTERRUPTED"),  # closed before its first byte
        ("anthropic", 200, False, "STREAM_INTERRUPTED"),
        ("openai", 200, True, None),  # a HEAD answer has no body by definition
        ("openai", 204, False, None),
        ("none", 200, False, None),  # no dialect: judged by its framing, which held
    ],
)
def test_an_event_stream_that_ended_before_its_first_byte_is_judged(
    provider: str, status: int, head: bool, expected: str | None
) -> None:
    """As the relay judges it: no bytes is no marker (pure)."""
    from gateway.call.stream import judge_body

    error, _ = judge_body(provider, "t", "text/event-stream", b"", status, head=head)
    assert (error.code.value if error else None) == expected
    if error is not None:
        assert error.retryable is True
        assert error.details["reason"] == "no_terminal_marker"
