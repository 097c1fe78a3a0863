"""The stop switch across real sidecar processes on a real Redis (docs, "Stopping an
agent"): a stop asked through one sidecar's ops listener cancels the calls in flight and
ends the open streams on every sidecar within 2 s (the OpenAI SDK's stream and the MCP
SDK's tool call end with their usual errors), a sidecar started afterwards refuses at
once, the agent cannot lift it without the operator token, ``egress-gateway resume``
lifts it; Redis killed under a stop: the last known state holds, a stop asked meanwhile
holds where it was asked and reaches the others when Redis is back."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import httpx2
import openai
import pytest
from aiohttp import web
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from tests.conftest import envelope, openai_target, policy_yaml, wait_for
from tests.mcp_server import RunningServer
from tests.processes import ROOT, Process
from tests.redis_fixtures import SHARED_URL, PrivateRedis, private_redis, redis_prefix

__all__ = ["private_redis", "redis_prefix"]  # fixtures, imported for pytest

TOKEN = "op-TEST-token-0007-NOTREAL"  # a test's fake operator token
AGENT = "planner"
#: The contract: every sidecar obeys a stop within 2 s (docs/features/stopping.md).
PROPAGATION_BOUND_S = 2.0
MESSAGES = [{"role": "user", "content": "hi"}]


class Upstream:
    """A loopback upstream: ``/items/hang`` and a streamed chat completion stay open
    until the test ends; ``/items/ok`` answers at once. Counts hits per path."""

    def __init__(self) -> None:
        self.hits: Counter[str] = Counter()
        self.release = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.hits[request.path] += 1
        if request.path == "/items/ok" or request.path.startswith("/v1/models/"):
            return web.json_response({"ok": True})
        if request.path == "/v1/chat/completions":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            chunk = {
                "id": "c1",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": "gpt-test",
                "choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}],
            }
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await self.release.wait()
            return resp
        await self.release.wait()
        return web.json_response({"late": True})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = "http://" + ":".join(map(str, site._server.sockets[0].getsockname()[:2]))  # type: ignore[union-attr]

    async def close(self) -> None:
        self.release.set()
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream()
    await up.start()
    yield up
    await up.close()


@pytest.fixture(scope="module")
def mcp_server() -> Any:
    running = RunningServer()
    yield running.start()
    running.stop()


StartSidecar = Callable[[str], Awaitable[Process]]


@pytest.fixture
async def sidecars(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[StartSidecar]:
    monkeypatch.setenv("EGRESS_TEST_OPERATOR_TOKEN", TOKEN)
    monkeypatch.setenv("TEST_MCP_TOKEN", "mcp-fake-TEST-0005-NOTREAL")
    started: list[Process] = []

    async def start(policy_text: str) -> Process:
        path = tmp_path / f"policy-{len(started)}.yaml"
        path.write_text(policy_text)
        process = await Process.start(path, drop_env=("REDIS_URL",), timeout_s=30)
        started.append(process)
        assert process.calls_url, "the sidecar did not start"
        return process

    yield start
    for process in started:  # all told at once: each drain takes its own second or so
        if process.proc.returncode is None and not process.terminated:
            process.terminate()
    for process in started:
        await process.stop()


def _policy(up: Upstream, mcp_url: str, redis: dict[str, Any], **stop_switch: Any) -> str:
    return policy_yaml(
        {
            "openai": openai_target(up.url, retry={"max_retries": 0}),
            "items": {
                "base_url": up.url,
                "endpoints": [{"path": "/items/*", "methods": ["GET"]}],
                "retry": {"max_retries": 0},
            },
            "tools": {
                "base_url": mcp_url,
                "credential": {
                    "header": "Authorization",
                    "format": "Bearer {secret}",
                    "default_ref": "env://TEST_MCP_TOKEN",
                },
                "mcp": {"tools": {"allow": ["hold", "echo"]}},
                "retry": {"max_retries": 0},
            },
        },
        agent_id=AGENT,
        redis=redis,
        controls={
            "operator_token_ref": "env://EGRESS_TEST_OPERATOR_TOKEN",
            "stop_switch": {"scope": "cluster", "poll_interval_s": 0.5, **stop_switch},
        },
        # Stopped at the end: no quiet period (default 1 s) to wait out once nothing is
        # in flight; the drain itself is tests/test_shutdown.py's.
        server={"shutdown": {"quiet_s": 0}},
    )


async def _envelope(http: aiohttp.ClientSession, sc: Process, name: str) -> tuple[int, Any]:
    env = envelope(
        target_system="items", endpoint=f"/items/{name}", method="GET", api_key_ref=..., timeout=30
    )
    env = {k: v for k, v in env.items() if v is not ...}
    env["parameters"] = {}
    async with http.post(sc.calls_url + "/v1/calls", json=env) as resp:
        return resp.status, await resp.json()


async def _ops(
    http: aiohttp.ClientSession, sc: Process, action: str, body: dict[str, Any], token: str | None
) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with http.post(f"{sc.ops_url}/v1/controls/{action}", json=body, headers=headers) as r:
        return r.status, await r.json()


async def _sdk_stream(sc: Process, first: asyncio.Event) -> BaseException | None:
    """An OpenAI SDK stream through the drop-in route: what it raised after its first
    chunk, or None if it ended cleanly."""
    client = openai.AsyncOpenAI(
        base_url=sc.calls_url + "/proxy/openai/v1", api_key="unused", max_retries=0, timeout=30
    )
    async with client:
        stream = await client.chat.completions.create(
            model="gpt-test", messages=MESSAGES, stream=True
        )
        try:
            async for _ in stream:
                first.set()
        except openai.APIError as exc:
            return exc
    return None


async def _mcp_hold(sc: Process, holding: asyncio.Event) -> BaseException | None:
    """The MCP SDK's ``tools/call`` of ``hold`` (open until the test ends): what it raised."""

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        holding.set()

    async with (
        httpx2.AsyncClient(timeout=30) as http,
        streamable_http_client(sc.calls_url + "/mcp/tools", http_client=http) as (read, write),
        ClientSession(read, write) as client,
    ):
        await client.initialize()
        try:
            await client.call_tool("hold", {"seconds": 20}, progress_callback=on_progress)
        except MCPError as exc:
            return exc
    return None


async def _cli(action: str, sc: Process, *args: str, token_file: Path | None) -> int:
    flags = ["--token-file", str(token_file)] if token_file else []
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", action, *args, "--ops-url", sc.ops_url, *flags,
        cwd=ROOT, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    return await asyncio.wait_for(proc.wait(), 30)


@pytest.mark.slow
async def test_a_stop_reaches_every_sidecar_and_only_the_operator_lifts_it(
    upstream: Upstream,
    mcp_server: Any,
    sidecars: StartSidecar,
    redis_prefix: str,
    tmp_path: Path,
) -> None:
    policy = _policy(upstream, mcp_server.url, {"url": SHARED_URL, "key_prefix": redis_prefix})
    a, b = await asyncio.gather(sidecars(policy), sidecars(policy))
    async with aiohttp.ClientSession() as http:
        assert (await _envelope(http, a, "ok"))[0] == 200
        calls = await _in_flight(http, upstream, (a, b))
        started = time.monotonic()
        status, answer = await _ops(
            http, a, "stop", {"scope": "agent", "name": AGENT, "reason": "looping on search"}, TOKEN
        )
        assert (status, answer["propagated"]) == (200, True), answer
        ended = await asyncio.wait_for(asyncio.gather(*calls), 10)
        elapsed = time.monotonic() - started
        assert elapsed < PROPAGATION_BOUND_S, f"the stop took {elapsed:.2f} s to end every call"
        _assert_ended_by_the_stop(ended, "looping on search")

        # A sidecar started after the stop refuses at once; nothing reaches the upstream.
        c = await sidecars(policy)
        before = upstream.hits["/items/ok"]
        status, body = await _envelope(http, c, "ok")
        assert (status, body["error"]["code"]) == (423, "AGENT_STOPPED")
        assert upstream.hits["/items/ok"] == before

        # The agent (same loopback, no operator token) cannot lift it.
        resume = {"scope": "agent", "name": AGENT, "reason": "let me out"}
        assert (await _ops(http, b, "resume", resume, None))[0] == 401
        assert (await _ops(http, b, "resume", resume, "guessed-token"))[0] == 401
        assert (await _envelope(http, b, "ok"))[0] == 423

        # The operator's CLI lifts it everywhere.
        token_file = tmp_path / "token"
        token_file.write_text(TOKEN + "\n")
        assert (
            await _cli("resume", b, "--agent", AGENT, "--reason", "fixed", token_file=token_file)
            == 0
        )
        for sc in (a, b, c):
            await _wait_ok(http, sc)

    stops = a.events("agent_stop")
    assert [(e["scope"], e["stopped"], e["why"], e["propagated"]) for e in stops] == [
        ("agent", AGENT, "looping on search", True)
    ]
    refused = b.events("agent_stop_refused")
    assert [e["reason"] for e in refused] == ["operator_token_missing", "operator_token_wrong"]
    assert [e["why"] for e in b.events("agent_resume")] == ["fixed"]
    for sc in (a, b, c):
        assert all(TOKEN not in line for line in sc.raw)


async def _in_flight(
    http: aiohttp.ClientSession, upstream: Upstream, sidecars: tuple[Process, ...]
) -> list[asyncio.Task[Any]]:
    """On each sidecar: an envelope call, an OpenAI SDK stream (its first chunk relayed)
    and an MCP SDK tool call (its progress relayed), all held open by the upstreams;
    returned once every one of them is in flight."""
    firsts = [asyncio.Event() for _ in sidecars]
    holds = [asyncio.Event() for _ in sidecars]
    tasks = [asyncio.create_task(_envelope(http, sc, "hang")) for sc in sidecars]
    tasks += [
        asyncio.create_task(_sdk_stream(sc, e)) for sc, e in zip(sidecars, firsts, strict=True)
    ]
    tasks += [asyncio.create_task(_mcp_hold(sc, e)) for sc, e in zip(sidecars, holds, strict=True)]
    await wait_for(
        lambda: (
            upstream.hits["/items/hang"] == len(sidecars)
            and all(e.is_set() for e in firsts + holds)
        ),
        20,
    )
    return tasks


def _assert_ended_by_the_stop(ended: list[Any], reason: str) -> None:
    """Each call of :func:`_in_flight` ended as its client expects a stop to end it."""
    for result in ended:
        if isinstance(result, tuple):  # the envelope's (status, answer)
            status, body = result
            assert status == 423
            assert body["error"]["code"] == "AGENT_STOPPED"
            assert body["error"]["retryable"] is False
            assert body["error"]["details"]["scope"] == "agent"
            assert body["error"]["details"]["reason"] == reason
        elif isinstance(result, openai.APIError):  # the SDK's stream raised
            assert result.code == "AGENT_STOPPED"
        else:
            assert isinstance(result, MCPError), result  # the MCP SDK's call raised
            assert reason in str(result)
    assert len(ended) == 6
    assert sum(isinstance(r, openai.APIError) for r in ended) == 2
    assert sum(isinstance(r, MCPError) for r in ended) == 2


async def _wait_ok(http: aiohttp.ClientSession, sc: Process) -> None:
    """Poll (bounded) until a call through ``sc`` succeeds again."""
    deadline = time.monotonic() + PROPAGATION_BOUND_S * 2
    while True:
        status, _ = await _envelope(http, sc, "ok")
        if status == 200:
            return
        assert time.monotonic() < deadline, "the resume did not reach the sidecar"
        await asyncio.sleep(0.05)


@pytest.mark.slow
async def test_redis_killed_during_a_stop(
    upstream: Upstream,
    mcp_server: Any,
    sidecars: StartSidecar,
    private_redis: PrivateRedis,
) -> None:
    redis = {"url": private_redis.url, "key_prefix": "egw", "socket_timeout_s": 0.2}
    policy = _policy(upstream, mcp_server.url, redis)
    closed = _policy(upstream, mcp_server.url, redis, on_redis_error="fail_closed")
    a, b = await asyncio.gather(sidecars(policy), sidecars(policy))
    strict = await sidecars(closed)
    async with aiohttp.ClientSession() as http:
        target_stop = {"scope": "target", "name": "items", "reason": "incident 12"}
        assert (await _ops(http, a, "stop", target_stop, TOKEN))[0] == 200
        for sc in (a, b, strict):
            await _wait_status(http, sc, 423)

        private_redis.kill()
        # The last known state holds: the stopped target stays stopped, the rest works.
        for sc in (a, b):
            status, body = await _envelope(http, sc, "ok")
            assert (status, body["error"]["details"]["scope"]) == (423, "target")
            assert (await _models(http, sc))[0] == 200  # not stopped: answered
        # fail_closed: every call is refused while the state cannot be read.
        await _wait_models(http, strict, "shared state cannot be read")
        agent_stop = {"scope": "agent", "name": AGENT, "reason": "asked while Redis is down"}
        status, answer = await _ops(http, a, "stop", agent_stop, TOKEN)
        assert (status, answer["propagated"]) == (200, False)
        resume_target = {"scope": "target", "name": "items", "reason": "over"}
        assert (await _ops(http, b, "resume", resume_target, TOKEN))[0] == 200

        private_redis.start()
        # When Redis answers again, each pending change is written and reaches the others.
        for sc in (a, b, strict):
            await _wait_reason(http, sc, "asked while Redis is down")


async def _models(http: aiohttp.ClientSession, sc: Process) -> tuple[int, dict[str, str]]:
    """A drop-in GET of a model (a target no stop names)."""
    async with http.get(sc.calls_url + "/proxy/openai/v1/models/gpt-test") as resp:
        await resp.read()
        return resp.status, dict(resp.headers)


async def _wait_models(http: aiohttp.ClientSession, sc: Process, message: str) -> None:
    deadline = time.monotonic() + 10
    while True:
        async with http.get(sc.calls_url + "/proxy/openai/v1/models/gpt-test") as resp:
            body = await resp.json()
        if resp.status == 423 and message in body["error"]["message"]:
            assert resp.headers["x-egress-error-code"] == "AGENT_STOPPED"
            return
        assert time.monotonic() < deadline, f"{sc.calls_url}: {resp.status} {body}"
        await asyncio.sleep(0.05)


async def _wait_status(http: aiohttp.ClientSession, sc: Process, status: int) -> None:
    deadline = time.monotonic() + PROPAGATION_BOUND_S * 2
    while (await _envelope(http, sc, "ok"))[0] != status:
        assert time.monotonic() < deadline, f"{sc.calls_url} never answered {status}"
        await asyncio.sleep(0.05)


async def _wait_reason(http: aiohttp.ClientSession, sc: Process, reason: str) -> None:
    deadline = time.monotonic() + 15
    while True:
        status, body = await _envelope(http, sc, "ok")
        details = (body.get("error") or {}).get("details") or {}
        if status == 423 and details.get("reason") == reason:
            return
        assert time.monotonic() < deadline, f"{sc.calls_url}: {status} {body}"
        await asyncio.sleep(0.05)
