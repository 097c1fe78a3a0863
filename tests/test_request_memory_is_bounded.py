"""The memory request bodies in flight may hold is bounded (docs/performance.md, "Memory ceiling").

A real ``gateway serve`` process takes concurrent 8 MB bodies on all three routes, its
upstream (real, on loopback) holding every request it got until each body was either
forwarded or refused: the bodies that fit ``server.max_inflight_request_bytes`` are
forwarded and answered, the others refused at once in their route's shape
(CAPACITY_EXCEEDED, 429, retryable), every call audited, and the process's peak RSS stays
under the stated ceiling (idle RSS + the budget). The accounting itself, chunked bodies
and the bytes one large body costs are checked in process.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import io
import json
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from multidict import CIMultiDict

from gateway.api.admission import COPIES, VALUE_BYTES, ByteBudget, held_bytes
from gateway.api.http import BUDGET_KEY
from gateway.errors import CapacityExceeded, InvalidPayload
from tests.conftest import FakeUpstream, Sidecar, compile_policy, policy_yaml, wait_for
from tests.processes import Process

MiB = 1024 * 1024
#: The idle RSS docs/performance.md states (a fresh sidecar measures ~62 MiB; the ceiling is this
#: plus the budget, ``server.max_inflight_request_bytes``).
STATED_IDLE_RSS = 64 * MiB
BODY_BYTES = 8_000_000
BUDGET = 160 * MiB  # the default: three such bodies (charged 6x each) fit, a fourth not


def _peak_rss(pid: int) -> int:
    """``VmHWM`` of ``pid`` in bytes (the peak resident set, /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def _prompt(n: int, size: int) -> str:
    return f"{n}:" + "x" * (size - 600)


def _requests(n: int) -> tuple[str, dict[str, str], bytes]:
    """Request ``n`` of the mix: an envelope, a drop-in call or an MCP tool call."""
    route = ("envelope", "proxy", "mcp")[n % 3]
    messages = [{"role": "user", "content": _prompt(n, BODY_BYTES)}]
    doc: dict[str, Any]
    if route == "envelope":
        path = "/v1/calls"
        doc = {
            "trace_id": f"tr-{n}",
            "correlation_id": f"c-{n}",
            "target_system": "t",
            "endpoint": "/v1/chat",
            "method": "POST",
            "parameters": {"model": "m", "messages": messages},
            "timeout": 120,
        }
    elif route == "proxy":
        path = "/proxy/t/v1/chat"
        doc = {"model": "m", "messages": messages}
    else:
        path = "/mcp/m"
        arguments = {"text": _prompt(n, BODY_BYTES)}
        params = {"name": "echo", "arguments": arguments}
        doc = {"jsonrpc": "2.0", "id": n, "method": "tools/call", "params": params}
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    return path, headers, json.dumps(doc).encode()


async def _held_upstream(
    upstream_factory: Callable[..., Awaitable[FakeUpstream]], release: asyncio.Event
) -> FakeUpstream:
    async def hold(request: web.Request) -> web.StreamResponse:
        await release.wait()
        return web.json_response({"jsonrpc": "2.0", "id": 1, "result": {"content": []}})

    return await upstream_factory(hold)


@pytest.fixture
async def sidecar_process(tmp_path: Path) -> AsyncIterator[Callable[[str], Awaitable[Process]]]:
    started: list[Process] = []

    async def start(policy: str) -> Process:
        path = tmp_path / "policy.yaml"
        path.write_text(policy)
        process = await Process.start(path, timeout_s=30)
        started.append(process)
        assert process.calls_url, "the sidecar did not start"
        return process

    yield start
    for process in started:
        await process.kill()


async def test_concurrent_large_bodies_stay_under_the_ceiling_and_the_rest_are_refused(
    upstream_factory: Callable[..., Awaitable[FakeUpstream]],
    sidecar_process: Callable[[str], Awaitable[Process]],
) -> None:
    release = asyncio.Event()
    upstream = await _held_upstream(upstream_factory, release)
    targets = {
        "t": {"base_url": upstream.url, "endpoints": [{"path": "/v1/*", "methods": ["POST"]}],
              "retry": {"max_retries": 0}, "usage": "openai"},
        "m": {"base_url": upstream.url + "/mcp", "mcp": {}},
    }  # fmt: skip
    sidecar = await sidecar_process(policy_yaml(targets))  # the default budget
    requests = [_requests(n) for n in range(9)]
    answers: list[tuple[str, int, CIMultiDict[str], Any]] = []

    async def send(session: aiohttp.ClientSession, n: int) -> None:
        path, headers, data = requests[n]
        url = sidecar.calls_url + path  # a BytesIO: aiohttp warns of large bytes bodies
        async with session.post(url, data=io.BytesIO(data), headers=headers) as resp:
            answers.append((path, resp.status, resp.headers.copy(), await resp.json()))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        tasks = [asyncio.create_task(send(session, n)) for n in range(len(requests))]
        # Every body is either with the upstream or refused: all are in flight at once.
        await wait_for(lambda: upstream.hits + len(answers) == len(requests), 40)
        held_peak = _peak_rss(sidecar.proc.pid)
        release.set()
        await asyncio.gather(*tasks)
    # The kernel updates its high-water mark lazily: the larger of the two readings.
    peak = max(held_peak, _peak_rss(sidecar.proc.pid))

    ok = [a for a in answers if a[1] == 200]
    refused = [a for a in answers if a[1] != 200]
    assert len(ok) == upstream.hits == 3  # 3 x 6 x 8 MB fit 160 MiB, a fourth does not
    assert len(refused) == 6
    for path, status, headers, body in refused:
        assert status == 429, (path, body)
        if path == "/v1/calls":
            error = body["error"]
            assert (error["code"], error["retryable"]) == ("CAPACITY_EXCEEDED", True)
            assert error["suggested_retry_after"] == 1.0
            assert error["details"]["reason"] == "request_bytes_in_flight"
        elif path.startswith("/proxy/"):
            assert headers["x-egress-error-code"] == "CAPACITY_EXCEEDED"
            assert headers["x-should-retry"] == "true"
            assert headers["retry-after"] == "1"
            assert body["error"]["type"]  # the OpenAI error shape
        else:
            assert body["error"]["data"]["egress_code"] == "CAPACITY_EXCEEDED"
            assert body["error"]["data"]["retryable"] is True
    # The admitted bodies reached the upstream whole (re-encoded, a few bytes apart).
    assert all(len(seen.body) >= BODY_BYTES - 1000 for seen in upstream.seen)
    assert await sidecar.stop() == 0
    records = sidecar.events("egress_call")
    codes = sorted((r.get("error_code") or "ok") for r in records)
    assert codes.count("CAPACITY_EXCEEDED") == 6, codes
    assert codes.count("ok") == 3, codes
    ceiling = STATED_IDLE_RSS + BUDGET
    assert peak <= ceiling, (peak / MiB, ceiling / MiB)


async def test_a_chunked_body_is_counted_as_it_arrives(
    upstream: FakeUpstream, sidecar_factory: Callable[..., Awaitable[Sidecar]]
) -> None:
    policy = compile_policy(
        {"t": {"base_url": upstream.url, "endpoints": [{"path": "/v1/*", "methods": ["POST"]}]}},
        server={"max_inflight_request_bytes": MiB},
    )
    sidecar = await sidecar_factory(policy)
    budget = sidecar.server.app[BUDGET_KEY]
    sent = 0

    async def chunks(pieces: int) -> AsyncIterator[bytes]:
        nonlocal sent
        sent = 0
        yield b'{"trace_id":"t","correlation_id":"c","target_system":"t","endpoint":"/v1/x",'
        yield b'"method":"POST","parameters":{"p":"'
        for _ in range(pieces):
            sent += 64 * 1024
            yield b"x" * (64 * 1024)
        yield b'"}}'

    async def post(pieces: int) -> tuple[int, dict[str, Any]]:
        url = sidecar.url + "/v1/calls"
        async with sidecar.session.post(url, data=chunks(pieces)) as resp:
            return resp.status, await resp.json()

    # 4 MiB (under max_request_bytes) would hold more than the whole budget: never.
    status, answer = await post(64)
    assert (status, answer["error"]["details"]["reason"]) == (413, "too_large_in_memory")
    # With 900 KiB held by other calls in flight, 64 KiB more cannot be read: not now.
    budget.take(900 * 1024)
    status, answer = await post(1)
    budget.give(900 * 1024)
    assert (status, answer["error"]["code"]) == (429, "CAPACITY_EXCEEDED")
    assert answer["error"]["retryable"] is True
    assert answer["error"]["details"]["limit_bytes"] == MiB
    assert upstream.hits == 0
    codes = [r["error_code"] for r in sidecar.audit_records()]
    assert codes == ["INVALID_PAYLOAD", "CAPACITY_EXCEEDED"]
    assert budget.held == 0  # each charge given back with its answer
    assert (await post(1))[0] == 200
    assert budget.held == 0


def test_a_charge_is_taken_whole_or_not_at_all_and_given_back() -> None:
    budget = ByteBudget(100)
    first, second = budget.charge(), budget.charge()
    first.grow_to(60)
    with pytest.raises(CapacityExceeded) as refused:
        second.grow_to(50)
    assert refused.value.details["held_bytes"] == 60
    assert (budget.held, second.bytes) == (60, 0)
    with pytest.raises(InvalidPayload) as too_large:
        second.grow_to(101)  # more than the whole budget: never admitted
    assert too_large.value.http_status == 413
    first.release()
    first.release()  # idempotent
    second.grow_to(100)
    assert (budget.held, budget.refused) == (100, 2)


@pytest.mark.parametrize(
    ("body", "values"),
    [(b'"' + b"x" * 998 + b'"', 0), (b"[" + b",".join([b"{}"] * 100) + b"]", 1 + 100 + 99)],
)
def test_the_charge_counts_bytes_and_json_values(body: bytes, values: int) -> None:
    assert held_bytes(body) == COPIES * len(body) + VALUE_BYTES * values


async def test_a_large_upload_costs_its_bytes_a_few_times_not_more(
    sidecar_factory: Callable[..., Awaitable[Sidecar]],
) -> None:
    """Bytes the sidecar holds for one 4 MiB upload (an envelope ``body``), counted by
    tracemalloc, at the peak and while the upstream reads it: its base64 text read and
    parsed, its bytes decoded for the upstream and written to it in slices (no copy of
    them for the writing)."""
    received = 0
    held: list[int] = []  # traced bytes when the upstream has the whole body

    async def drain(request: web.Request) -> web.StreamResponse:
        nonlocal received
        async for chunk in request.content.iter_any():  # nothing kept
            received += len(chunk)
        if tracemalloc.is_tracing():
            held.append(tracemalloc.get_traced_memory()[0])
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/{tail:.*}", drain)
    upstream = TestServer(app, host="127.0.0.1")  # keeps nothing of what it reads
    await upstream.start_server()
    url = f"http://127.0.0.1:{upstream.port}"
    policy = compile_policy(
        {"t": {"base_url": url, "endpoints": [{"path": "/up/*", "methods": ["POST"]}]}}
    )
    sidecar = await sidecar_factory(policy)
    upload = bytes(range(256)) * (4 * MiB // 256)
    envelope = {
        "trace_id": "t", "correlation_id": "c", "target_system": "t", "endpoint": "/up/a",
        "method": "POST", "body": {"content_type": "application/octet-stream",
                                   "base64": base64.b64encode(upload).decode()},
    }  # fmt: skip
    data = json.dumps(envelope).encode()
    del envelope

    def post() -> int:  # a blocking client in a thread: sendall copies nothing
        conn = http.client.HTTPConnection("127.0.0.1", sidecar.server.port or 0, timeout=60)
        conn.putrequest("POST", "/v1/calls")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(data)))
        conn.endheaders()
        conn.send(data)  # apart from the head: request(body=...) would join them in a copy
        status = conn.getresponse().status
        conn.close()
        return status

    assert await asyncio.to_thread(post) == 200  # warm: imports, pools, caches
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        assert await asyncio.to_thread(post) == 200
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert received == 2 * len(upload)
    # Read (the text, its pieces while joined), parsed (the base64 string), decoded to
    # check it and to send it: about 4.7 x the upload at the peak; one more copy for the
    # writing made it 5.7.
    await upstream.close()
    # While the upstream call runs: the envelope's text, its parsed base64 text, and the
    # decoded upload being written (3.7 x the upload; a copy of it for the writing made
    # it 4.7 x). The peak, at intake (the envelope read, checked and parsed, the base64
    # decoded to check it), is 5.0 x the upload: 3.8 x the envelope's text, charged 6 x.
    assert held[0] - base < 4.2 * len(upload), (held[0] - base) / len(upload)
    assert peak < COPIES * len(data), peak / len(data)
