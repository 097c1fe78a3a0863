"""A call the stop switch cancels after its request reached the upstream is answered
AGENT_STOPPED as any stopped call, and says that the upstream may have acted
(``details.outcome: unknown``) when the request was not safe to send twice (a POST
without an idempotency key): the agent must not take it as not done, and the call is
kept as a dead letter for an operator to settle. A call stopped before anything was
sent, or an idempotent one, says nothing of the kind."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web

from gateway.agents.controls import Stop, now
from tests.conftest import compile_policy, envelope, openai_target

AGENT = "agent-under-test"


@pytest.mark.parametrize(
    ("method", "outcome", "kept"), [("POST", "unknown", 1), ("GET", None, 0)], ids=["post", "get"]
)
async def test_a_call_stopped_in_flight_says_whether_it_was_sent_unsafely(
    method: str, outcome: str | None, kept: int, upstream_factory: Any, sidecar_factory: Any
) -> None:
    arrived, release = asyncio.Event(), asyncio.Event()

    async def slow(request: web.Request) -> web.StreamResponse:
        await request.read()
        arrived.set()  # the upstream has the request: it may act on it
        await release.wait()
        return web.json_response({"ok": True})

    up = await upstream_factory(slow)
    endpoints = [{"path": "/v1/*", "methods": ["GET", "POST"]}]
    target = openai_target(up.url, endpoints=endpoints, dead_letter=True)
    sc = await sidecar_factory(compile_policy({"t": target}, agent_id=AGENT))
    parameters: dict[str, Any] = {"amount": 1} if method == "POST" else {}
    env = envelope(
        target_system="t", endpoint="/v1/charges", method=method, parameters=parameters,
        timeout=10, max_retries=0,
    )  # fmt: skip
    call = asyncio.create_task(sc.call(env))
    try:
        await asyncio.wait_for(arrived.wait(), 5)
        stop = Stop("agent", AGENT, "runaway", "alice", now())
        await sc.gateway.pipeline.controls.stops.stop(stop)
        status, answer = await asyncio.wait_for(call, 5)
    finally:
        release.set()
    assert (status, answer["error"]["code"]) == (423, "AGENT_STOPPED"), answer
    assert answer["error"]["details"].get("outcome") == outcome
    assert len(sc.gateway.pipeline.dead_letters.list()) == kept


async def test_a_call_stopped_before_sending_says_nothing_was_sent(
    upstream_factory: Any, sidecar_factory: Any
) -> None:
    up = await upstream_factory()
    target = openai_target(up.url, dead_letter=True)
    sc = await sidecar_factory(compile_policy({"t": target}, agent_id=AGENT))
    await sc.gateway.pipeline.controls.stops.stop(Stop("agent", AGENT, "runaway", "alice", now()))
    status, answer = await sc.call(envelope(target_system="t"))
    assert (status, answer["error"]["code"]) == (423, "AGENT_STOPPED")
    assert "outcome" not in answer["error"]["details"]
    assert (up.hits, len(sc.gateway.pipeline.dead_letters.list())) == (0, 0)
