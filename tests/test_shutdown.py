"""SIGTERM beside a live agent, with real ``gateway serve`` processes.

In the chart's regular-container mode the agent and the sidecar get SIGTERM at the same
moment: the sidecar keeps serving new calls while it drains (readiness false all the
same) and exits once nothing has been in flight for ``server.shutdown.quiet_s``, long
before ``server.drain_s`` when the agent is done. A native sidecar
(``accept_new_calls: false``, as the chart sets it) refuses new calls at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.audit.schema import AuditRecord
from gateway.policy import PolicyError, PolicySet, parse_policy
from gateway.server.runtime import _server_hot_only
from tests.conftest import envelope, policy_yaml, wait_for
from tests.processes import Process
from tests.processes import item_target as _target

Start = Callable[..., Awaitable[Process]]


@pytest.fixture
async def serve() -> AsyncIterator[Start]:
    started: list[Process] = []

    async def start(policy_path: Path, *, listening: bool = True, **kwargs: Any) -> Process:
        process = await Process.start(policy_path, **kwargs)
        started.append(process)
        assert bool(process.calls_url) is listening, process.raw
        return process

    yield start
    for process in started:
        await process.kill()


def _item(name: str, *, method: str = "GET") -> dict[str, Any]:
    return envelope(
        target_system="inv",
        endpoint=f"/items/{name}",
        method=method,
        api_key_ref=...,
        parameters={},
        correlation_id=f"corr-{name}",
        timeout=60,
    )


async def _post(session: aiohttp.ClientSession, url: str, env: dict[str, Any]):
    async with session.post(url + "/v1/calls", json=env) as resp:
        return resp.status, await resp.json()


async def _readyz(session: aiohttp.ClientSession, sidecar: Process) -> int:
    async with session.get(sidecar.ops_url + "/readyz") as resp:
        return resp.status


def _when(line: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(line["timestamp"])


def _calls(sidecar: Process) -> dict[str, dict[str, Any]]:
    """The audit records by correlation id, each valid against the schema."""
    records = sidecar.events("egress_call")
    for record in records:
        AuditRecord.model_validate(record)
    return {r["correlation_id"]: r for r in records}


def _policy(tmp_path: Path, url: str, **server: Any) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(policy_yaml({"inv": _target(url)}, server=server))
    return path


class Gate:
    """Upstream paths that wait until the test releases them (``/items/hold-*``)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def handler(self, request: web.Request) -> web.StreamResponse:
        name = request.path.rsplit("/", 1)[-1]
        if name.startswith("hold"):
            await self.release.wait()
        if name.startswith("never"):
            await asyncio.Event().wait()
        return web.json_response({"item": name})


async def test_a_new_call_during_drain_is_served_and_the_exit_follows_the_quiet_period(
    upstream_factory, serve, tmp_path
):
    gate = Gate()
    up = await upstream_factory(gate.handler)
    # drain_s far above what the test waits: the exit must come from the quiet period.
    sidecar = await serve(_policy(tmp_path, up.url, drain_s=30, shutdown={"quiet_s": 0.5}))
    async with aiohttp.ClientSession() as session:
        held = asyncio.create_task(_post(session, sidecar.calls_url, _item("hold-1")))
        await wait_for(lambda: up.hits == 1)
        sidecar.terminate()
        await wait_for(lambda: bool(sidecar.events("draining")), 10)
        # Not ready from the signal on (the flag is set in the signal's own callback,
        # before the "draining" line is written): no polling needed.
        assert await _readyz(session, sidecar) == 503
        status, answer = await _post(session, sidecar.calls_url, _item("new-1"))
        assert (status, answer["success"], answer["data"]) == (200, True, {"item": "new-1"})
        assert up.hits == 2  # it went out
        assert await _readyz(session, sidecar) == 503
        assert sidecar.proc.returncode is None  # the held call keeps it alive
        gate.release.set()
        status, answer = await held
        assert (status, answer["data"]) == (200, {"item": "hold-1"})
        idle_since = time.monotonic()
        assert await sidecar.stop() == 0
        assert time.monotonic() - idle_since < 10  # well before drain_s (30 s)
    draining = sidecar.events("draining")[0]
    assert draining["accept_new_calls"] is True
    assert draining["quiet_s"] == 0.5
    drained = sidecar.events("drained")[0]
    assert drained["cancelled"] == 0
    assert drained["served_while_draining"] == 1
    assert drained["waited_s"] < 10
    calls = _calls(sidecar)
    assert sorted(calls) == ["corr-hold-1", "corr-new-1"]
    assert all(r["success"] and r["error_code"] is None for r in calls.values())
    # The quiet period ran from the last call's end to the exit.
    last_end = max(_when(r) for r in calls.values())
    assert (_when(drained) - last_end).total_seconds() >= 0.5 * 0.9


async def test_an_idle_sidecar_exits_after_the_quiet_period_not_drain_s(
    upstream_factory, serve, tmp_path
):
    up = await upstream_factory()
    sidecar = await serve(_policy(tmp_path, up.url, drain_s=30))  # quiet_s default: 1 s
    sidecar.terminate()
    signalled = time.monotonic()
    assert await sidecar.stop() == 0
    assert time.monotonic() - signalled < 10
    drained = sidecar.events("drained")[0]
    assert sidecar.events("draining")[0]["quiet_s"] == 1.0
    # An agent stopping at the same moment had the quiet period to send its last call.
    assert 1.0 * 0.9 <= drained["waited_s"] < 10
    assert (drained["cancelled"], drained["served_while_draining"]) == (0, 0)


async def test_a_call_during_the_quiet_period_restarts_it(upstream_factory, serve, tmp_path):
    up = await upstream_factory()
    sidecar = await serve(_policy(tmp_path, up.url, drain_s=30, shutdown={"quiet_s": 1.0}))
    async with aiohttp.ClientSession() as session:
        sidecar.terminate()
        await wait_for(lambda: bool(sidecar.events("draining")), 10)
        for n in range(3):
            status, answer = await _post(session, sidecar.calls_url, _item(f"late-{n}"))
            assert status == 200, answer
    assert await sidecar.stop() == 0
    drained = sidecar.events("drained")[0]
    assert drained["served_while_draining"] == 3
    last_end = max(_when(r) for r in _calls(sidecar).values())
    assert (_when(drained) - last_end).total_seconds() >= 1.0 * 0.9
    assert up.hits == 3


@pytest.mark.parametrize(
    ("server", "env"),
    [
        ({"shutdown": {"accept_new_calls": False}}, {}),
        # The chart's native-sidecar setting wins over the policy's default.
        ({}, {"GATEWAY_SHUTDOWN_ACCEPT_NEW_CALLS": "false"}),
    ],
    ids=["policy", "env"],
)
async def test_native_sidecar_mode_refuses_new_calls_and_exits_when_idle(
    upstream_factory, serve, tmp_path, server, env
):
    gate = Gate()
    up = await upstream_factory(gate.handler)
    sidecar = await serve(_policy(tmp_path, up.url, drain_s=30, **server), env=env)
    async with aiohttp.ClientSession() as session:
        held = asyncio.create_task(_post(session, sidecar.calls_url, _item("hold-1")))
        await wait_for(lambda: up.hits == 1)
        sidecar.terminate()
        await wait_for(lambda: bool(sidecar.events("draining")), 10)
        assert await _readyz(session, sidecar) == 503
        status, refused = await _post(session, sidecar.calls_url, _item("new-1"))
        assert status == 503
        assert refused["error"]["code"] == "SHUTTING_DOWN"
        assert refused["error"]["retryable"] is True
        assert up.hits == 1  # never forwarded
        gate.release.set()
        status, _ = await held
        assert status == 200
        released = time.monotonic()
        assert await sidecar.stop() == 0
        assert time.monotonic() - released < 10
    assert sidecar.events("draining")[0]["accept_new_calls"] is False
    calls = _calls(sidecar)
    assert calls["corr-new-1"]["error_code"] == "SHUTTING_DOWN"
    assert calls["corr-hold-1"]["success"] is True
    assert sidecar.events("drained")[0]["served_while_draining"] == 0


async def test_calls_still_running_at_drain_s_are_answered_and_audited(
    upstream_factory, serve, tmp_path
):
    gate = Gate()
    up = await upstream_factory(gate.handler)
    sidecar = await serve(_policy(tmp_path, up.url, drain_s=1.5))
    async with aiohttp.ClientSession() as session:
        before = asyncio.create_task(_post(session, sidecar.calls_url, _item("never-get")))
        await wait_for(lambda: up.hits == 1)
        sidecar.terminate()
        await wait_for(lambda: bool(sidecar.events("draining")), 10)
        # Accepted during the drain, then still with the upstream at drain_s.
        during = asyncio.create_task(
            _post(session, sidecar.calls_url, _item("never-post", method="POST"))
        )
        status, answer = await before
        assert (status, answer["error"]["code"], answer["error"]["retryable"]) == (
            503,
            "SHUTTING_DOWN",
            True,
        )
        status, answer = await during
        # A non-idempotent request that reached the upstream: its outcome is unknown.
        assert (status, answer["error"]["code"], answer["error"]["retryable"]) == (
            502,
            "OUTCOME_UNKNOWN",
            False,
        )
    assert await sidecar.stop() == 0
    assert up.hits == 2
    calls = _calls(sidecar)
    assert calls["corr-never-get"]["error_code"] == "SHUTTING_DOWN"
    assert calls["corr-never-post"]["error_code"] == "OUTCOME_UNKNOWN"
    drained = sidecar.events("drained")[0]
    assert (drained["cancelled"], drained["served_while_draining"]) == (2, 1)


async def test_an_invalid_env_setting_stops_the_start(serve, tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_yaml({}))
    sidecar = await serve(
        policy,
        env={"GATEWAY_SHUTDOWN_ACCEPT_NEW_CALLS": "sometimes"},
        stderr=asyncio.subprocess.PIPE,
        listening=False,
    )
    assert await asyncio.wait_for(sidecar.proc.wait(), 15) == 2
    assert sidecar.proc.stderr is not None
    err = (await sidecar.proc.stderr.read()).decode()
    assert "GATEWAY_SHUTDOWN_ACCEPT_NEW_CALLS must be true or false, not 'sometimes'" in err


@pytest.mark.parametrize(
    ("server", "problem"),
    [
        ("{shutdown: {accept_new_calls: 'yes'}}", "server.shutdown.accept_new_calls"),
        ("{shutdown: {quiet_s: -1}}", "server.shutdown.quiet_s"),
        ("{shutdown: {quiet_s: .inf}}", "server.shutdown.quiet_s"),
        ("{shutdown: {quiet: 1}}", "server.shutdown.quiet"),
    ],
)
def test_the_shutdown_block_is_checked(server: str, problem: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(f"version: 1\nagent_id: a\nserver: {server}\n", "p.yaml")
    assert any(problem in p for p in info.value.problems), info.value.problems


def test_the_shutdown_block_defaults_and_applies_without_a_restart() -> None:
    default = parse_policy("version: 1\nagent_id: a\n", "p.yaml")
    assert default.server.shutdown.accept_new_calls is True
    assert default.server.shutdown.quiet_s == 1.0
    changed = parse_policy(
        "version: 1\nagent_id: a\nserver: {shutdown: {accept_new_calls: false, quiet_s: 0}}\n",
        "p.yaml",
    )
    # Read at SIGTERM, so a reload that changes it needs no restart.
    assert _server_hot_only(PolicySet.compile(default), PolicySet.compile(changed))
