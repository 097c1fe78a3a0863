"""A stop on a target holds every call to it, a call that reaches it as a fallback too:
a stopped fallback is passed over (nothing sent, listed in the record as AGENT_STOPPED),
and a call being served by a fallback when that target is stopped is cancelled and
answered AGENT_STOPPED, as any call to the target is."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from gateway.agents.controls import Stop, now
from tests.conftest import compile_policy, envelope, openai_target


async def _unavailable(_: web.Request) -> web.StreamResponse:
    return web.json_response(
        {"error": {"message": "overloaded", "type": "server_error"}}, status=503
    )


def _policy(primary_url: str, backup_url: str) -> Any:
    spec = openai_target(primary_url, fallbacks=[{"target": "backup", "model": "backup-model"}])
    return compile_policy({"primary": spec, "backup": openai_target(backup_url)})


def _call() -> dict[str, Any]:
    parameters = {"model": "primary-model", "messages": [{"role": "user", "content": "ping"}]}
    return envelope(
        target_system="primary", api_key_ref=None, parameters=parameters, max_retries=0, timeout=5
    )


async def test_a_stopped_fallback_is_passed_over(upstream_factory, sidecar_factory) -> None:
    primary = await upstream_factory(_unavailable)
    backup = await upstream_factory()
    sc = await sidecar_factory(_policy(primary.url, backup.url))
    stops = sc.gateway.pipeline.controls.stops
    await stops.stop(Stop("target", "backup", "backup is misbehaving", "alice", now()))

    status, body = await sc.call(_call())
    assert (status, body["error"]["code"]) == (502, "DEPENDENCY_FAILED"), body
    assert body["served_by"] is None
    assert (primary.hits, backup.hits) == (1, 0)
    [record] = sc.audit_records()
    assert [(t["target"], t["outcome"], t["attempts"]) for t in record["tried"]] == [
        ("primary", "DEPENDENCY_FAILED", 1),
        ("backup", "AGENT_STOPPED", 0),
    ]


async def test_a_call_served_by_a_fallback_stops_when_the_fallback_is_stopped(
    upstream_factory, sidecar_factory
) -> None:
    arrived, release = asyncio.Event(), asyncio.Event()

    async def slow(_: web.Request) -> web.StreamResponse:
        arrived.set()
        await release.wait()
        return web.json_response({"ok": True})

    primary = await upstream_factory(_unavailable)
    backup = await upstream_factory(slow)
    sc = await sidecar_factory(_policy(primary.url, backup.url))
    call = asyncio.create_task(sc.call(_call()))
    try:
        await asyncio.wait_for(arrived.wait(), 5)
        stops = sc.gateway.pipeline.controls.stops
        await stops.stop(Stop("target", "backup", "backup is misbehaving", "alice", now()))
        status, body = await asyncio.wait_for(call, 5)
    finally:
        release.set()
    assert (status, body["error"]["code"]) == (423, "AGENT_STOPPED"), body
    assert body["error"]["details"]["scope"] == "target"
    assert body["error"]["details"]["name"] == "backup"
