"""Shared test fixtures: real loopback upstreams and a real sidecar in the test's loop.

``FakeUpstream`` is an aiohttp server on 127.0.0.1 (port 0) that records every request
it receives (arrival time, method, path, query, headers, body) and answers with a
handler the test gives. ``Sidecar`` runs the real application (``gateway.server``) on a
loopback port and captures everything the sidecar writes (audit records and logs).

Fixtures every test module may ask for by name, defined once: ``upstream_factory``,
``sidecar_factory``; ``switcher`` (an upstream answering 101); ``frozen_heap`` (the
collector sees only the test's objects); ``json_server`` (the MCP SDK's server,
stateless, answering JSON; one per session); ``chart`` (the Helm chart, loaded once per
session); ``redis_prefix`` and ``private_redis``
(:mod:`tests.redis_fixtures`); ``vault_lab`` (OpenBao, one per session:
:mod:`tests.vault_fixtures`).
"""

from __future__ import annotations

import asyncio
import gc
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.audit.schema import AuditRecord
from gateway.policy import PolicySet, parse_policy
from gateway.server import create_app
from gateway.server.runtime import Gateway
from tests.rawhttp import read_message
from tests.redis_fixtures import private_redis, redis_prefix
from tests.vault_fixtures import vault_lab

if TYPE_CHECKING:
    import helm_python as helm

    from tests.mcp_server import McpTestServer

__all__ = ["private_redis", "redis_prefix", "vault_lab"]  # fixtures, shared by every module

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class Seen:
    at: float
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class FakeUpstream:
    """A recording upstream. ``handler`` may be swapped at any time."""

    handler: Handler
    seen: list[Seen] = field(default_factory=list)
    server: TestServer | None = None

    @property
    def hits(self) -> int:
        return len(self.seen)

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.port}"

    @property
    def port(self) -> int:
        assert self.server is not None
        assert self.server.port is not None
        return self.server.port

    async def _record(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append(
            Seen(
                time.monotonic(),
                request.method,
                request.path,
                dict(request.query),
                dict(request.headers),
                body,
            )
        )
        return await self.handler(request)


async def _ok(_: web.Request) -> web.StreamResponse:
    return web.json_response({"ok": True})


@pytest.fixture
async def upstream_factory() -> AsyncIterator[Callable[..., Awaitable[FakeUpstream]]]:
    servers: list[TestServer] = []

    async def make(handler: Handler = _ok) -> FakeUpstream:
        fake = FakeUpstream(handler)
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", fake._record)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        fake.server = server
        servers.append(server)
        return fake

    yield make
    for server in servers:
        await server.close()


@pytest.fixture
async def upstream(upstream_factory: Callable[..., Awaitable[FakeUpstream]]) -> FakeUpstream:
    return await upstream_factory()


def policy_yaml(targets: dict[str, Any], **extra: Any) -> str:
    """A policy text with loopback egress allowed, for ``targets`` (a dict of specs)."""
    doc: dict[str, Any] = {
        "version": 1,
        "agent_id": "test-agent",
        "egress": {"allow_cidrs": ["127.0.0.0/8"]},
        "targets": targets,
    }
    doc.update(extra)
    return json.dumps(doc)  # JSON is YAML


def compile_policy(targets: dict[str, Any], **extra: Any) -> PolicySet:
    return PolicySet.compile(parse_policy(policy_yaml(targets, **extra), "test-policy.yaml"))


def openai_target(url: str, **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "base_url": url,
        "credential": {
            "header": "Authorization",
            "format": "Bearer {secret}",
            "default_ref": "env://TEST_OPENAI_KEY",
            "allowed_refs": ["env://TEST_OPENAI_KEY"],
        },
        "endpoints": [
            {"path": "/v1/chat/completions", "methods": ["POST"]},
            {"path": "/v1/models/*", "methods": ["GET"]},
        ],
        "usage": "openai",
        "retry": {"backoff_base_s": 0.01, "backoff_max_s": 0.05},
    }
    spec.update(overrides)
    return spec


def envelope(**overrides: Any) -> dict[str, Any]:
    """The base envelope of ../shared/cases.md, adapted to env:// refs."""
    env: dict[str, Any] = {
        "trace_id": "tr-test-0001",
        "correlation_id": "corr-test-0001",
        "target_system": "fake-openai",
        "endpoint": "/v1/chat/completions",
        "method": "POST",
        "parameters": {"model": "fake-model-1", "messages": [{"role": "user", "content": "ping"}]},
        "api_key_ref": "env://TEST_OPENAI_KEY",
        "timeout": 5,
        "max_retries": 2,
    }
    env.update(overrides)
    return {k: v for k, v in env.items() if v is not ...}


class SidecarServer(TestServer):
    """A test server run as ``gateway serve`` runs the calls listener: aiohttp's test
    server cancels a handler when its client hangs up, the sidecar never does."""

    async def _make_runner(self, **kwargs: Any) -> web.AppRunner:
        kwargs["handler_cancellation"] = False
        return web.AppRunner(self.app, **kwargs)


@dataclass
class Sidecar:
    gateway: Gateway
    server: TestServer
    session: aiohttp.ClientSession
    log: io.StringIO

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    async def call(self, env: dict[str, Any] | bytes) -> tuple[int, dict[str, Any]]:
        raw = env if isinstance(env, bytes) else json.dumps(env).encode()
        data = io.BytesIO(raw) if len(raw) > 512 * 1024 else raw
        async with self.session.post(
            self.url + "/v1/calls", data=data, headers={"Content-Type": "application/json"}
        ) as resp:
            assert resp.content_type == "application/json", await resp.text()
            return resp.status, await resp.json()

    def lines(self) -> list[dict[str, Any]]:
        # JSON lines end at "\n" only (str.splitlines would also split at U+0085, U+2028...).
        return [json.loads(line) for line in self.log.getvalue().split("\n") if line.strip()]

    def audit_records(self) -> list[dict[str, Any]]:
        records = [r for r in self.lines() if r.get("event") == "egress_call"]
        for record in records:  # every record the sidecar writes matches the schema
            AuditRecord.model_validate(record)
        return records


@pytest.fixture
async def sidecar_factory() -> AsyncIterator[Callable[..., Awaitable[Sidecar]]]:
    made: list[Sidecar] = []

    async def make(policy: PolicySet, **gateway_kwargs: Any) -> Sidecar:
        log = io.StringIO()
        gateway = Gateway(policy, log_stream=log, **gateway_kwargs)
        server = SidecarServer(create_app(gateway), host="127.0.0.1")
        await server.start_server()
        session = aiohttp.ClientSession()
        sidecar = Sidecar(gateway, server, session, log)
        made.append(sidecar)
        return sidecar

    yield make
    for sidecar in made:
        await sidecar.session.close()
        await sidecar.server.close()


async def openai_stack(
    upstream_factory: Callable[..., Awaitable[FakeUpstream]],
    sidecar_factory: Callable[..., Awaitable[Sidecar]],
    handler: Handler | None = None,
    **target: Any,
) -> tuple[FakeUpstream, Sidecar]:
    """A recording upstream (answering with ``handler``, else OK) behind a sidecar whose
    policy has one OpenAI-style target, ``openai``, with ``target``'s overrides."""
    up = await (upstream_factory(handler) if handler else upstream_factory())
    sc = await sidecar_factory(compile_policy({"openai": openai_target(up.url, **target)}))
    return up, sc


@pytest.fixture(autouse=True)
def _test_openai_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_OPENAI_KEY", "sk-fake-TEST-0001-NOTREAL")


@pytest.fixture(autouse=True)
def _operational_log_stream_restored() -> Iterator[None]:
    """A test that runs the CLI in-process (``capsys``) points the process-wide
    operational log at pytest's capture stream, which is closed after that test: the
    stream is put back, so that a later test's log lines do not hit a closed file."""
    from gateway.audit import log as audit_log

    sink = audit_log._ops_sink
    stream = sink.stream
    yield
    if sink.stream is not stream:
        sink.to_stream(stream)


async def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll ``predicate`` until true, failing the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


SWITCH = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"


class Switcher:
    """Answers every request with a 101 and then holds the connection open, silent."""

    def __init__(self) -> None:
        self.requests = 0
        self.port = 0
        self._held: list[asyncio.StreamWriter] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_message(reader)
        self.requests += 1
        writer.write(SWITCH)
        await writer.drain()
        self._held.append(writer)  # never closed by us: a body read would hang


@pytest.fixture
async def switcher() -> AsyncIterator[Switcher]:
    fake = Switcher()
    server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    fake.port = server.sockets[0].getsockname()[1]
    yield fake
    for writer in fake._held:
        writer.close()
    server.close()
    await server.wait_closed()


@pytest.fixture(scope="session")
def json_server() -> Iterator[McpTestServer]:
    """The MCP SDK's server, stateless, answering requests as JSON (tests count what it
    received relative to what it had before, so one serves the session)."""
    from tests.mcp_server import RunningServer  # the MCP SDK, only when asked for

    running = RunningServer(stateless=True, json_response=True)
    yield running.start()
    running.stop()


@pytest.fixture(scope="session")
def chart() -> Iterator[helm.Chart]:
    """The chart, loaded once (rendering never changes it)."""
    import helm_python as helm  # only the chart tests load Helm's engine

    from tests.helm_helpers import CHART

    helm.disable_logging()
    with helm.Chart.load(CHART) as loaded:
        yield loaded


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    """What the process held before the test is frozen (gc.freeze) until it ends: the
    test's gc.collect() and gc.get_objects() go over the objects it made, not over the
    heap of the whole suite's imports (about a second a collection)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class CountWaits:
    """Await ``awaitable`` through this, counting the times it suspended (waited for a
    timer, I/O or another task) in ``waits``: "answered at once" is ``waits == 0``,
    counted rather than timed, so a busy machine cannot fail it."""

    def __init__(self, awaitable: Awaitable[Any]) -> None:
        self._inner = awaitable
        self.waits = 0

    def __await__(self) -> Generator[Any, Any, Any]:
        inner = self._inner.__await__()
        sent: Any = None
        thrown: BaseException | None = None
        while True:
            try:
                yielded = inner.throw(thrown) if thrown is not None else inner.send(sent)
            except StopIteration as done:
                return done.value
            self.waits += 1
            sent, thrown = None, None
            try:
                sent = yield yielded
            except BaseException as exc:  # cancellation goes in, as with await
                thrown = exc


async def turns_until(predicate: Callable[[], bool], most: int = 50) -> int:
    """Let the event loop run one iteration at a time until ``predicate`` holds; the
    iterations it took (at most ``most``, else the test fails): "at once" counted in the
    loop's turns, not in seconds."""
    for turn in range(most + 1):
        if predicate():
            return turn
        await asyncio.sleep(0)
    raise AssertionError(f"not within {most} turns of the event loop")


@contextmanager
def calls_made() -> Iterator[list[str]]:
    """The names of the functions (Python and C, as :func:`sys.setprofile` sees them)
    called in this thread while inside, in order: work counted, not timed."""
    names: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            names.append(frame.f_code.co_name)
        elif event == "c_call":
            names.append(getattr(arg, "__name__", "?"))

    sys.setprofile(profile)
    try:
        yield names
    finally:
        sys.setprofile(None)


#: "Soon", for a test that rules out a long wait: far above what a loaded machine adds to
#: loopback calls, far below the timer ruled out, which such a test sets to RULED_OUT_S.
SOON_S = 10.0
#: The timer (a deadline, a lease) that a test using SOON_S shows was not waited for.
RULED_OUT_S = 45.0


@pytest.fixture
def demo_sidecar(tmp_path: Path) -> Iterator[str]:
    """``python -m gateway.demo.serve`` on free ports (stand-ins, OpenBao when installed,
    the sidecar with policies/demo.yaml): the sidecar's URL; it must stop cleanly."""
    demo = subprocess.Popen(
        [sys.executable, "-m", "gateway.demo.serve", "--port", "0", "--upstream-port", "0",
         "--audit", str(tmp_path / "audit.jsonl")],
        cwd=Path(__file__).resolve().parent.parent,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "VAULT_"))},
    )  # fmt: skip
    assert demo.stdout is not None
    try:
        url = ""
        for line in demo.stdout:  # bounded by the test's timeout
            found = re.search(r"sidecar on (http://127\.0\.0\.1:\d+)", line)
            if found:
                url = found[1]
                break
        assert url, "the demo did not start"
        yield url
    finally:
        demo.send_signal(signal.SIGTERM)
        try:
            demo.wait(timeout=15)
        except subprocess.TimeoutExpired:
            demo.kill()
            demo.wait()
        demo.stdout.close()
    assert demo.returncode == 0  # a clean shutdown on SIGTERM
