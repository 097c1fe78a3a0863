"""The stop switch on one sidecar (local scope), through its ops listener: bad requests
change nothing (401 without or with a wrong token, audited; 400 for an unknown agent or
target, a bad scope, a reason with control characters), a stop refuses new calls before
any upstream contact, ends an envelope's open stream with its ``egress.response`` event,
keeps ``/readyz`` ready, shows in the metrics; resume lifts it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.server.app import create_ops_app
from tests.conftest import FakeUpstream, Sidecar, compile_policy, envelope, openai_target, wait_for

TOKEN = "op-TEST-token-0008-NOTREAL"  # a test's fake operator token
AGENT = "planner"


@pytest.fixture(autouse=True)
def _token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EGRESS_TEST_OPERATOR_TOKEN", TOKEN)


class Ops:
    def __init__(self, server: TestServer, session: aiohttp.ClientSession) -> None:
        self.server, self.session = server, session

    async def post(
        self, action: str, body: Any, token: str | None = TOKEN
    ) -> tuple[int, dict[str, Any]]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        url = f"http://127.0.0.1:{self.server.port}/v1/controls/{action}"
        async with self.session.post(url, json=body, headers=headers) as resp:
            return resp.status, await resp.json()

    async def get(self, path: str, token: str | None = TOKEN) -> tuple[int, str]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        url = f"http://127.0.0.1:{self.server.port}{path}"
        async with self.session.get(url, headers=headers) as resp:
            return resp.status, await resp.text()


Make = Callable[..., Awaitable[tuple[Sidecar, Ops]]]


@pytest.fixture
async def make(sidecar_factory: Callable[..., Awaitable[Sidecar]]) -> AsyncIterator[Make]:
    servers: list[TestServer] = []

    async def build(up: FakeUpstream, **controls: Any) -> tuple[Sidecar, Ops]:
        controls.setdefault("operator_token_ref", "env://EGRESS_TEST_OPERATOR_TOKEN")
        policy = compile_policy(
            {"fake-openai": openai_target(up.url), "other": openai_target(up.url)},
            agent_id=AGENT,
            controls={k: v for k, v in controls.items() if v is not None},
        )
        sc = await sidecar_factory(policy)
        server = TestServer(create_ops_app(sc.gateway), host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        return sc, Ops(server, sc.session)

    yield build
    for server in servers:
        await server.close()


def _events(sc: Sidecar, name: str) -> list[dict[str, Any]]:
    return [line for line in sc.lines() if line.get("event") == name]


STOP = {"scope": "agent", "name": AGENT, "reason": "looping"}


@pytest.mark.parametrize(
    ("token", "reason"),
    [(None, "operator_token_missing"), ("not-the-token", "operator_token_wrong")],
)
async def test_without_the_operator_token_nothing_changes(
    upstream: FakeUpstream, make: Make, token: str | None, reason: str
) -> None:
    sc, ops = await make(upstream)
    status, body = await ops.post("stop", STOP, token=token)
    assert (status, body["error"]["details"]["reason"]) == (401, reason)
    assert (await sc.call(envelope()))[0] == 200
    [refused] = _events(sc, "agent_stop_refused")
    assert (refused["reason"], refused["status"]) == (reason, 401)
    assert _events(sc, "agent_stop") == []
    assert (await ops.get("/v1/controls/stops", token=token))[0] == 401


async def test_without_a_token_in_the_policy_the_routes_are_off(
    upstream: FakeUpstream, make: Make
) -> None:
    sc, ops = await make(upstream, operator_token_ref=None)
    status, body = await ops.post("stop", STOP)
    assert (status, body["error"]["details"]["reason"]) == (401, "operator_token_not_configured")
    assert (await sc.call(envelope()))[0] == 200


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"scope": "agent", "name": "someone-else", "reason": "x"}, "no agent 'someone-else'"),
        ({"scope": "target", "name": "nope", "reason": "x"}, "no target 'nope'"),
        ({"scope": "fleet", "reason": "x"}, "scope must be one of agent, target, all"),
        ({"scope": "all", "name": AGENT, "reason": "x"}, "scope all takes no name"),
        ({"scope": "agent", "name": AGENT, "reason": "a\nb"}, "control character"),
        ({"scope": "agent", "name": AGENT, "reason": "\x1b[31mred"}, "control character"),
        ({"scope": "agent", "name": AGENT}, "a reason is required"),
        ([1, 2], "not a JSON object"),
    ],
)
async def test_bad_requests_are_refused_and_change_nothing(
    upstream: FakeUpstream, make: Make, body: Any, expected: str
) -> None:
    sc, ops = await make(upstream)
    status, answer = await ops.post("stop", body)
    assert status == 400
    assert expected in answer["error"]["message"]
    assert (await sc.call(envelope()))[0] == 200


async def test_a_stop_refuses_before_any_upstream_contact_and_resume_lifts_it(
    upstream: FakeUpstream, make: Make
) -> None:
    sc, ops = await make(upstream)
    status, answer = await ops.post(
        "stop", {"scope": "target", "name": "fake-openai", "reason": "incident 7", "by": "ana"}
    )
    assert status == 200
    assert answer["stop"]["scope"] == "target"
    hits = upstream.hits
    status, refused = await sc.call(envelope())
    assert status == 423
    assert refused["error"]["code"] == "AGENT_STOPPED"
    assert refused["error"]["retryable"] is False
    assert refused["error"]["details"] == {
        "scope": "target",
        "name": "fake-openai",
        "reason": "incident 7",
    }
    assert upstream.hits == hits
    assert (await sc.call(envelope(target_system="other")))[0] == 200  # another target
    ready = await sc.session.get(sc.url + "/readyz")
    assert ready.status == 200  # a stopped agent's pod must not be restarted
    listed = json.loads((await ops.get("/v1/controls/stops"))[1])
    assert [(s["scope"], s["name"], s["by"]) for s in listed["stops"]] == [
        ("target", "fake-openai", "ana")
    ]
    metrics = (await ops.get("/metrics", token=None))[1]
    assert 'egress_gateway_agent_stops{scope="target"} 1.0' in metrics
    assert 'egress_gateway_agent_stop_changes_total{action="stop",scope="target"} 1.0' in metrics
    [record] = [r for r in sc.audit_records() if r.get("error_code") == "AGENT_STOPPED"]
    assert record["target_system"] == "fake-openai"

    status, answer = await ops.post("resume", {"scope": "target", "name": "fake-openai"})
    assert (status, answer["resumed"]) == (200, True)
    assert (await sc.call(envelope()))[0] == 200
    [event] = _events(sc, "agent_stop")
    assert (event["by"], event["why"], event["scope"]) == ("ana", "incident 7", "target")
    [event] = _events(sc, "agent_resume")
    assert event["stopped"] == "fake-openai"


async def _hanging_stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    chunk = {"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]}
    await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await asyncio.Event().wait()  # open until the sidecar hangs up
    return resp


async def test_an_open_envelope_stream_ends_with_its_final_event(
    upstream_factory: Callable[..., Awaitable[FakeUpstream]], make: Make
) -> None:
    up = await upstream_factory(_hanging_stream)
    sc, ops = await make(up)
    env = envelope(parameters={"model": "m", "messages": [], "stream": True}, timeout=30)
    async with sc.session.post(
        sc.url + "/v1/calls", json=env, headers={"Accept": "text/event-stream"}
    ) as resp:
        assert resp.status == 200
        first = await resp.content.readuntil(b"\n\n")
        assert b"Hel" in first
        assert sc.gateway.pipeline is not None
        await wait_for(lambda: sc.gateway.pipeline.controls.stops.inflight == 1)  # type: ignore[union-attr]
        assert (await ops.post("stop", {"scope": "all", "reason": "fleet-wide halt"}))[0] == 200
        rest = await asyncio.wait_for(resp.content.read(), 10)
    event, _, data = rest.strip().partition(b"\n")
    assert event == b"event: egress.response"
    final = json.loads(data.removeprefix(b"data: "))
    assert final["error"]["code"] == "AGENT_STOPPED"
    assert final["error"]["details"]["scope"] == "all"
    assert final["error"]["details"]["reason"] == "fleet-wide halt"
