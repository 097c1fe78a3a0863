"""The sidecar as a real process: graceful shutdown on SIGTERM and policy hot reload."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.conftest import envelope, policy_yaml, wait_for
from tests.processes import Process
from tests.processes import item_target as _target


@pytest.fixture
async def serve() -> AsyncIterator[Any]:
    started: list[Process] = []

    async def start(policy_path: Path) -> Process:
        process = await Process.start(policy_path)
        started.append(process)
        assert process.calls_url, "the sidecar did not start"
        return process

    yield start
    for process in started:
        await process.kill()


def _item(target: str, name: str, **extra: Any) -> dict[str, Any]:
    return envelope(
        target_system=target,
        endpoint=f"/items/{name}",
        method="GET",
        api_key_ref=...,
        parameters={},
        **extra,
    )


async def _post(session: aiohttp.ClientSession, url: str, env: dict[str, Any]):
    async with session.post(url + "/v1/calls", json=env) as resp:
        return resp.status, await resp.json()


async def test_sigterm_drains_then_answers_the_rest(upstream_factory, serve, tmp_path):
    """Native-sidecar mode (``accept_new_calls: false``): new calls are refused at once.
    With new calls accepted (the default), see tests/test_shutdown.py."""
    release_fast = asyncio.Event()
    never = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        if request.path.endswith("/fast"):
            await release_fast.wait()
            return web.json_response({"item": "fast"})
        await never.wait()
        return web.json_response({})

    up = await upstream_factory(handler)
    policy = tmp_path / "policy.yaml"
    server = {"drain_s": 1.0, "shutdown": {"accept_new_calls": False}}
    policy.write_text(policy_yaml({"inv": _target(up.url)}, server=server))
    sidecar = await serve(policy)
    async with aiohttp.ClientSession() as session:
        fast = asyncio.create_task(
            _post(session, sidecar.calls_url, _item("inv", "fast", timeout=30))
        )
        slow = asyncio.create_task(
            _post(session, sidecar.calls_url, _item("inv", "slow", timeout=30))
        )
        await wait_for(lambda: up.hits == 2)
        sidecar.terminate()

        async def not_ready() -> bool:
            async with session.get(sidecar.ops_url + "/readyz") as resp:
                return resp.status == 503

        deadline = time.monotonic() + 5
        while not await not_ready():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        status, refused = await _post(session, sidecar.calls_url, _item("inv", "new"))
        assert status == 503
        assert refused["error"]["code"] == "SHUTTING_DOWN"
        assert refused["error"]["retryable"] is True

        release_fast.set()
        status, answer = await fast
        assert status == 200
        assert answer["data"] == {"item": "fast"}

        started = time.monotonic()
        status, answer = await slow
        assert time.monotonic() - started < 3
        assert status == 503
        assert answer["error"]["code"] == "SHUTTING_DOWN"
        assert answer["error"]["retryable"] is True
    assert await sidecar.stop() == 0
    assert up.hits == 2  # the refused call never went out
    codes = sorted(str(r["error_code"]) for r in sidecar.events("egress_call"))
    assert codes == ["None", "SHUTTING_DOWN", "SHUTTING_DOWN"]
    assert sidecar.events("drained")[0]["cancelled"] == 1


def _configmap_swap(directory: Path, version: int, text: str) -> None:
    """Update a mounted ConfigMap the way the kubelet does: new dir, atomic symlink swap."""
    data = directory / f"..{version}"
    data.mkdir()
    (data / "policy.yaml").write_text(text)
    link = directory / "..data_tmp"
    link.symlink_to(data.name)
    os.replace(link, directory / "..data")
    policy = directory / "policy.yaml"
    if not policy.is_symlink():
        policy.symlink_to("..data/policy.yaml")


async def test_hot_reload_on_configmap_swap(upstream_factory, serve, tmp_path):
    up = await upstream_factory()
    one = {"a": _target(up.url)}
    two = {"a": _target(up.url), "b": _target(up.url)}
    fast = {"reload_interval_s": 0.05}
    _configmap_swap(tmp_path, 1, policy_yaml(one, server=fast))
    sidecar = await serve(tmp_path / "policy.yaml")
    async with aiohttp.ClientSession() as session:
        status, answer = await _post(session, sidecar.calls_url, _item("b", "x"))
        assert answer["error"]["details"]["reason"] == "unknown_target"

        _configmap_swap(tmp_path, 2, policy_yaml(two, server=fast))
        await wait_for(lambda: bool(sidecar.events("policy_reload")), 10)
        status, answer = await _post(session, sidecar.calls_url, _item("b", "x"))
        assert status == 200, answer

        # An invalid policy is refused and the one in force stays.
        _configmap_swap(tmp_path, 3, policy_yaml(two, server=fast).replace('"GET"', '"FETCH"'))
        await wait_for(lambda: bool(sidecar.events("policy_reload_refused")), 10)
        status, _ = await _post(session, sidecar.calls_url, _item("b", "x"))
        assert status == 200
    refused = sidecar.events("policy_reload_refused")[0]
    assert refused["problems"]
    assert "targets.a.endpoints.0.methods.0" in refused["problems"][0]
    reload = sidecar.events("policy_reload")[0]
    assert reload["changed_targets"] == ["b"]
    assert await sidecar.stop() == 0


async def test_sighup_reloads(upstream_factory, serve, tmp_path):
    up = await upstream_factory()
    policy = tmp_path / "policy.yaml"
    manual = {"reload_interval_s": 0}
    policy.write_text(policy_yaml({"a": _target(up.url)}, server=manual))
    sidecar = await serve(policy)
    policy.write_text(policy_yaml({"a": _target(up.url), "b": _target(up.url)}, server=manual))
    sidecar.proc.send_signal(signal.SIGHUP)
    await wait_for(lambda: bool(sidecar.events("policy_reload")), 10)
    async with aiohttp.ClientSession() as session:
        status, _ = await _post(session, sidecar.calls_url, _item("b", "x"))
        assert status == 200
        async with session.get(sidecar.ops_url + "/metrics") as resp:
            text = await resp.text()
    assert 'egress_gateway_policy_reloads_total{result="ok"} 1.0' in text
    assert await sidecar.stop() == 0
