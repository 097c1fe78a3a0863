"""An answer the caller never received is audited as such, on every route.

The audit record is what operators and auditors read: it says what the caller got. An
agent that hangs up before its answer is written gets nothing, whatever the upstream
said; its call's one audit record says so (``success: false``, STREAM_INTERRUPTED, the
outcome of an agent that hung up mid-stream, with the reason in ``warnings``), and
nothing crashes. A stream whose last event (the envelope's verdict) could not be written
is audited the same way.
The agent that hung up is a real socket closed before reading; the upstream holds its
answer until the sidecar has seen the connection go.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from gateway.providers import mcp as rpc
from tests.conftest import FakeUpstream, Sidecar, compile_policy, envelope, wait_for
from tests.rawhttp import request

Factory = Callable[..., Awaitable[Any]]
MESSAGE = {"jsonrpc": "2.0", "id": 3, "result": {"content": [{"type": "text", "text": "hi"}]}}
CALL = {"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": "echo"}}
TARGETS: dict[str, Any] = {
    "plant": {
        "base_url": "{url}",
        "endpoints": [{"path": "/v1/*", "methods": ["POST"]}],
        "retry": {"max_retries": 0},
    },
    "tools": {"base_url": "{url}/mcp", "mcp": {"tools": {"allow": ["echo"], "deny": []}}},
    "agent": {"base_url": "{url}/a2a", "a2a": {"agent_id": "other-agent"}},
}


def _targets(url: str) -> dict[str, Any]:
    return json.loads(json.dumps(TARGETS).replace("{url}", url))


def _request(api: str) -> bytes:
    """One request of ``api`` as bytes, to write on a raw socket."""
    headers: list[tuple[str, str]] = [("Content-Type", "application/json")]
    body: dict[str, Any] = CALL
    if api == "envelope":
        path = "/v1/calls"
        body = envelope(target_system="plant", endpoint="/v1/x", parameters=CALL, max_retries=0)
        body.pop("api_key_ref")
    elif api == "proxy":
        path = "/proxy/plant/v1/x"
    elif api == "a2a":
        path = "/a2a/agent"
        body = {"jsonrpc": "2.0", "id": 3, "method": "tasks/get", "params": {"id": "task-1"}}
    else:
        path = "/mcp/tools"
        headers.append(("Accept", rpc.ACCEPT))
    return request(json.dumps(body).encode(), *headers, path=path)


def _held(release: asyncio.Event) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """An upstream that answers well, once ``release`` is set."""

    async def handler(_: web.Request) -> web.StreamResponse:
        await release.wait()
        return web.json_response(MESSAGE)

    return handler


async def _hang_up(sidecar: Sidecar, upstream: FakeUpstream, raw: bytes) -> None:
    """Send ``raw`` on a new connection, and close it unread once the upstream has the
    call; returns when the sidecar has seen the connection go (aiohttp keeps a connection
    listed until its handler ends, its transport gone)."""
    server = sidecar.server.runner.server  # type: ignore[union-attr]
    _, writer = await asyncio.open_connection("127.0.0.1", sidecar.server.port)
    writer.write(raw)
    await writer.drain()
    await wait_for(lambda: upstream.hits == 1)
    writer.close()
    await writer.wait_closed()
    await wait_for(lambda: all(c.transport is None for c in server.connections))


async def _one_record_after_a_call_that_ended(sidecar: Sidecar) -> dict[str, Any]:
    """The one audit record of the call whose agent hung up: waited for, then a second
    call made and answered, after which the sidecar still holds exactly two records."""
    await wait_for(lambda: len(sidecar.audit_records()) == 1)
    status, _ = await sidecar.call(envelope(target_system="nowhere"))
    assert status == 403
    records = sidecar.audit_records()
    assert len(records) == 2, records
    return records[0]


def _assert_no_crash(caplog: pytest.LogCaptureFixture, sidecar: Sidecar) -> None:
    crashed = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not crashed, [r.getMessage() for r in crashed]
    assert not [line for line in sidecar.lines() if line.get("level") == "error"]


@pytest.mark.parametrize("api", ["envelope", "proxy", "mcp", "a2a"])
async def test_an_agent_that_hung_up_before_its_answer_is_audited_as_not_answered(
    api: str,
    upstream_factory: Factory,
    sidecar_factory: Factory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = asyncio.Event()
    upstream: FakeUpstream = await upstream_factory(_held(release))
    sidecar: Sidecar = await sidecar_factory(compile_policy(_targets(upstream.url)))
    caplog.set_level(logging.WARNING)

    await _hang_up(sidecar, upstream, _request(api))
    release.set()

    record = await _one_record_after_a_call_that_ended(sidecar)
    assert record["api"] == api, record
    assert record["status_code"] == 200, json.dumps(record)  # the upstream answered, and was heard
    assert record["attempts"] == 1
    assert record["success"] is False  # the agent got nothing
    assert record["error_code"] == "STREAM_INTERRUPTED"
    assert record["retryable"] is True
    assert record["level"] == "warning"
    assert any("agent_disconnected" in w for w in record["warnings"]), record["warnings"]
    _assert_no_crash(caplog, sidecar)


def _stream_then_wait(
    release: asyncio.Event,
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """An upstream that streams a whole chat completion, then holds the stream open (its
    end not sent) until ``release`` is set."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n")
        await release.wait()
        await resp.write_eof()
        return resp

    return handler


@pytest.mark.parametrize("api", ["envelope", "proxy"])
async def test_a_stream_whose_last_event_the_agent_never_received_is_audited_as_cut(
    api: str,
    upstream_factory: Factory,
    sidecar_factory: Factory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The envelope's stream ends with the sidecar's ``egress.response`` event (the call's
    verdict): an agent gone before it is audited as cut. A drop-in stream ends with the
    upstream's own last event: an agent that read it and left (as an SDK does after
    ``[DONE]``) had every byte, and the call stays a success."""
    release = asyncio.Event()
    upstream: FakeUpstream = await upstream_factory(_stream_then_wait(release))
    target = {**_targets(upstream.url)["plant"], "usage": "openai"}
    sidecar: Sidecar = await sidecar_factory(compile_policy({"plant": target}))
    caplog.set_level(logging.WARNING)
    chat = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    if api == "envelope":
        env = envelope(target_system="plant", endpoint="/v1/x", parameters=chat)
        env.pop("api_key_ref")
        path, body = "/v1/calls", env
    else:
        path, body = "/proxy/plant/v1/x", chat
    raw = request(
        json.dumps(body).encode(),
        ("Content-Type", "application/json"),
        ("Accept", "text/event-stream"),
        path=path,
    )
    server = sidecar.server.runner.server  # type: ignore[union-attr]
    reader, writer = await asyncio.open_connection("127.0.0.1", sidecar.server.port)
    writer.write(raw)
    await writer.drain()
    got = b""
    async with asyncio.timeout(5):
        while b"[DONE]" not in got:  # the upstream's events, all of them, relayed
            got += await reader.read(65536)
    writer.close()
    await writer.wait_closed()
    await wait_for(lambda: all(c.transport is None for c in server.connections))
    release.set()  # the stream ends well: only the sidecar's last bytes are left to write

    record = await _one_record_after_a_call_that_ended(sidecar)
    assert record["stream"] is True
    if api == "envelope":
        assert record["success"] is False
        assert record["error_code"] == "STREAM_INTERRUPTED"
        assert any("agent_disconnected" in w for w in record["warnings"]), record["warnings"]
    else:
        assert record["success"] is True
        assert record["warnings"] == []
    _assert_no_crash(caplog, sidecar)
