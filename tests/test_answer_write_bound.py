"""A large answer to an agent that stops reading is written within a bound.

aiohttp waits for a socket to drain without a bound, so an agent that sends an envelope
and never reads its (large) answer would hold the handler, the answer's bytes and the
connection for as long as it likes. The sidecar writes an answer larger than the
transport's buffer within ``body_timeout_s``, then drops the connection, logs
``answer_undelivered`` and audits the call as not answered (AGENT_TIMEOUT); an agent
that reads gets every byte, as before. Small answers to pipelined requests that the
agent never reads are bounded the same way once they fill the transport; pipelined
answers that the agent reads all arrive, whole and in order.
"""

from __future__ import annotations

import asyncio
import io
import json
import socket
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.server.app import create_app
from gateway.server.runtime import Gateway
from tests.conftest import (
    SidecarServer,
    compile_policy,
    envelope,
    openai_stack,
    openai_target,
    wait_for,
)
from tests.rawhttp import read_message

BIG = {"object": "blob", "text": "x" * (4 * 1024 * 1024)}  # ~4 MiB of JSON


async def _big(_: web.Request) -> web.StreamResponse:
    return web.json_response(BIG)


async def _sidecar(upstream_url: str, body_timeout_s: float) -> tuple[SidecarServer, io.StringIO]:
    log = io.StringIO()
    policy = compile_policy({"fake-openai": openai_target(upstream_url, usage="none")})
    gateway = Gateway(policy, log_stream=log)
    server = SidecarServer(create_app(gateway, body_timeout_s=body_timeout_s), host="127.0.0.1")
    await server.start_server()
    return server, log


def _lines(log: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(x) for x in log.getvalue().split("\n") if x.strip()]


@pytest.mark.parametrize("route", ["envelope", "proxy"])
async def test_a_stalled_agent_is_dropped_after_the_bound(upstream_factory, route):
    up = await upstream_factory(_big)
    server, log = await _sidecar(up.url, body_timeout_s=0.5)
    agent = socket.socket()
    agent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once
    try:
        agent.connect(("127.0.0.1", server.port))
        if route == "envelope":
            path, body = b"/v1/calls", json.dumps(envelope()).encode()
        else:
            path = b"/proxy/fake-openai/v1/chat/completions"
            body = json.dumps(envelope()["parameters"]).encode()
        agent.sendall(
            b"POST %s HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (path, len(body), body)
        )
        started = time.monotonic()
        await wait_for(
            lambda: any(x.get("event") == "answer_undelivered" for x in _lines(log)), 10.0
        )
        assert time.monotonic() - started < 8.0
        line = next(x for x in _lines(log) if x.get("event") == "answer_undelivered")
        assert line["reason"] == "agent_stalled"
        assert line["timeout_s"] == 0.5
        assert line["bytes"] > 4 * 1024 * 1024
        # The call's one audit record says the agent did not take its answer.
        await wait_for(lambda: any(x.get("event") == "egress_call" for x in _lines(log)))
        records = [x for x in _lines(log) if x.get("event") == "egress_call"]
        assert len(records) == 1
        assert records[0]["status_code"] == 200  # the upstream answered well
        assert records[0]["success"] is False
        assert records[0]["error_code"] == "AGENT_TIMEOUT"
        assert any("agent_stalled" in w for w in records[0]["warnings"])
        # The log line names the call by its record's ids (an envelope answer carries its
        # ids in its body, a drop-in answer in its headers).
        assert (line["trace_id"], line["correlation_id"]) == (
            records[0]["trace_id"],
            records[0]["correlation_id"],
        )
        assert line["trace_id"]
        # The connection is gone: reading now ends (EOF or reset) before the whole answer.
        agent.setblocking(False)
        got, closed = 0, False
        loop = asyncio.get_running_loop()
        give_up = time.monotonic() + 10
        while time.monotonic() < give_up:
            try:
                chunk = await asyncio.wait_for(loop.sock_recv(agent, 65536), 5)
            except ConnectionResetError:
                closed = True
                break
            if not chunk:
                closed = True
                break
            got += len(chunk)
        assert closed
        assert got < 4 * 1024 * 1024
    finally:
        agent.close()
        await server.close()


async def test_an_agent_that_reads_gets_the_whole_large_answer(upstream_factory):
    up = await upstream_factory(_big)
    server, log = await _sidecar(up.url, body_timeout_s=5.0)
    try:
        async with aiohttp.ClientSession() as session:
            body = envelope()
            async with session.post(f"http://127.0.0.1:{server.port}/v1/calls", json=body) as r:
                assert r.status == 200
                answer = await r.json()
        assert answer["success"] is True
        assert answer["data"] == BIG
        assert not any(x.get("event") == "answer_undelivered" for x in _lines(log))
    finally:
        await server.close()


MEDIUM = {"object": "blob", "text": "x" * (60 * 1024)}


async def _medium(_: web.Request) -> web.StreamResponse:
    return web.json_response(MEDIUM)


async def test_small_answers_to_an_agent_that_stopped_reading_are_bounded_too(upstream_factory):
    """An agent that sends requests on one connection (pipelined) and reads none of the
    answers, each under 64 KiB: each is handed to the transport at once, but once the
    earlier ones fill it the next one waits for the socket to drain, without a bound
    (aiohttp's ``write_eof`` drains). That answer must be written within
    ``body_timeout_s`` as a large one is, the connection dropped and ``answer_undelivered``
    logged."""

    up = await upstream_factory(_medium)
    server, log = await _sidecar(up.url, body_timeout_s=0.5)
    agent = socket.socket()
    agent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        agent.connect(("127.0.0.1", server.port))
        body = json.dumps(envelope()).encode()
        one = (
            b"POST /v1/calls HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        agent.sendall(one * 200)  # ~12 MiB of answers, more than any socket buffers
        await wait_for(
            lambda: any(x.get("event") == "answer_undelivered" for x in _lines(log)), 15.0
        )
        line = next(x for x in _lines(log) if x.get("event") == "answer_undelivered")
        assert line["reason"] == "agent_stalled"
    finally:
        agent.close()
        await server.close()


async def test_pipelined_answers_to_an_agent_that_reads_all_arrive(upstream_factory):
    """The other side of the bound above: an agent that pipelines its requests and reads
    gets every answer whole, in order, and nothing is logged undelivered."""

    up = await upstream_factory(_medium)
    server, log = await _sidecar(up.url, body_timeout_s=5.0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        body = json.dumps(envelope()).encode()
        one = (
            b"POST /v1/calls HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        writer.write(one * 40)
        await writer.drain()
        for _ in range(40):
            head, raw = await asyncio.wait_for(read_message(reader), 10)
            assert head.startswith(b"HTTP/1.1 200 OK")
            answer = json.loads(raw)
            assert answer["data"] == MEDIUM
        writer.close()
        assert up.hits == 40
        assert not any(x.get("event") == "answer_undelivered" for x in _lines(log))
    finally:
        await server.close()


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


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
    _, sc = await openai_stack(upstream_factory, sidecar_factory, _endless_stream(closed))
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
