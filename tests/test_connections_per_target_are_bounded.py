"""Each target holds at most its ``max_connections`` at once; a call that finds all busy
waits up to ``connection_wait_s`` and is then refused with CAPACITY_EXCEEDED (counted in
the metrics), never queued silently. The default does not cap streams at aiohttp's old
100 per host.

A real sidecar and a loopback upstream that holds its answers until the test releases
them (events, never sleeps); counts of requests, not timings, are asserted.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web

from tests.conftest import compile_policy, envelope, openai_target


class Holding:
    """An upstream that answers (a JSON body, or the head of an event stream) only after
    ``release``, counting the requests it has received."""

    def __init__(self, *, stream: bool, expect: int) -> None:
        self.stream = stream
        self.expect = expect
        self.seen = 0
        self.all_seen = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        self.seen += 1
        if self.seen >= self.expect:
            self.all_seen.set()
        if not self.stream:
            await self.release.wait()
            return web.json_response({"id": "x", "choices": []})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"id":"x","choices":[]}\n\n')  # the first byte at once
        await self.release.wait()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def test_a_call_past_the_target_s_connections_is_refused_after_its_wait(
    upstream_factory: Any, sidecar_factory: Any
) -> None:
    held = Holding(stream=False, expect=2)
    up = await upstream_factory(held)
    target = openai_target(up.url, max_connections=2, connection_wait_s=0.2)
    sc = await sidecar_factory(compile_policy({"fake-openai": target}))
    priced = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "ping"}]}
    env = envelope(max_retries=0, timeout=30, parameters=priced)
    first = [asyncio.create_task(sc.call(env)) for _ in range(2)]
    await asyncio.wait_for(held.all_seen.wait(), 30)

    status, body = await sc.call(env)

    assert status == 429, body
    assert body["error"]["code"] == "CAPACITY_EXCEEDED"
    assert body["error"]["retryable"] is True
    assert body["error"]["details"]["reason"] == "connection_pool_full"
    assert body["error"]["details"]["max_connections"] == 2
    assert held.seen == 2  # the third never reached the upstream
    # Nothing was sent: the call's spend is released, not kept as possibly billed.
    refused = [r for r in sc.audit_records() if r["error_code"] == "CAPACITY_EXCEEDED"]
    assert [r["cost_reason"] for r in refused] == ["not_sent"]
    held.release.set()
    for status, body in await asyncio.gather(*first):
        assert status == 200, body
    metrics, _ = sc.gateway.metrics.render()
    text = metrics.decode()
    assert 'egress_gateway_upstream_pool_rejections_total{target="fake-openai"} 1.0' in text
    assert 'egress_gateway_upstream_pool_wait_seconds_count{target="fake-openai"} 1.0' in text
    # A freed connection serves the next call.
    status, body = await sc.call(env)
    assert status == 200, body


async def test_a_call_that_gets_a_freed_connection_in_time_goes_through(
    upstream_factory: Any, sidecar_factory: Any
) -> None:
    held = Holding(stream=False, expect=1)
    up = await upstream_factory(held)
    target = openai_target(up.url, max_connections=1, connection_wait_s=30)
    sc = await sidecar_factory(compile_policy({"fake-openai": target}))
    env = envelope(max_retries=0, timeout=60)
    first = asyncio.create_task(sc.call(env))
    await asyncio.wait_for(held.all_seen.wait(), 30)
    second = asyncio.create_task(sc.call(env))
    slots = sc.gateway._parts.upstream._slots["fake-openai"][1]
    for _ in range(10_000):  # until the second call waits for the connection (bounded)
        if slots._waiters:
            break
        await asyncio.sleep(0.001)
    assert slots._waiters, "the second call never waited for the connection"
    assert held.seen == 1
    held.release.set()
    assert (await first)[0] == 200
    status, body = await second
    assert status == 200, body
    assert held.seen == 2
    metrics, _ = sc.gateway.metrics.render()
    text = metrics.decode()
    assert 'egress_gateway_upstream_pool_wait_seconds_count{target="fake-openai"} 1.0' in text
    assert 'egress_gateway_upstream_pool_rejections_total{target="fake-openai"} 0.0' in text


async def test_300_concurrent_streams_to_one_target_all_get_their_first_byte(
    upstream_factory: Any, sidecar_factory: Any
) -> None:
    streams = 300
    held = Holding(stream=True, expect=streams)
    up = await upstream_factory(held)
    sc = await sidecar_factory(compile_policy({"fake-openai": openai_target(up.url)}))
    env = envelope(parameters={"model": "m", "stream": True, "messages": []}, timeout=120)
    raw = json.dumps(env).encode()
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    first_bytes = 0
    all_first = asyncio.Event()

    async def one(session: aiohttp.ClientSession) -> bytes:
        nonlocal first_bytes
        async with session.post(sc.url + "/v1/calls", data=raw, headers=headers) as resp:
            assert resp.status == 200
            head = await resp.content.readany()
            first_bytes += 1
            if first_bytes == streams:
                all_first.set()
            return head + await resp.read()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as agent:
        tasks = [asyncio.create_task(one(agent)) for _ in range(streams)]
        # Every stream is open upstream and has relayed its first chunk while none has
        # ended: none waited for a connection another stream held.
        await asyncio.wait_for(asyncio.gather(held.all_seen.wait(), all_first.wait()), 120)
        assert held.seen == streams
        held.release.set()
        bodies = await asyncio.gather(*tasks)
    assert all(b"[DONE]" in body for body in bodies)
    metrics, _ = sc.gateway.metrics.render()
    assert 'upstream_pool_wait_seconds_count{target="fake-openai"}' not in metrics.decode()
