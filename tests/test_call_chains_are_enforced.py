"""The call chain on real loopback calls (envelope, drop-in and MCP routes): what the
upstream receives, refusals before any upstream contact (audited, counted), the chain's
deadline bounding the call, signed chains across two sidecars, and a loop between two
agents stopped at its first repeat."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.agents.chain import CHAIN_HEADER, DEADLINE_HEADER, SIGNATURE_HEADER
from gateway.providers import mcp as rpc
from tests.conftest import FakeUpstream, Sidecar, compile_policy, envelope, openai_target

Factory = Callable[..., Awaitable[Any]]
ME = "test-agent"  # the agent_id of compile_policy's policies
CALL = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "echo"}}


def now_ms() -> int:
    return int(time.time() * 1000)


def agent_target(url: str) -> dict[str, Any]:
    """Another agent's server as a plain target (its task endpoint), no credential."""
    return {"base_url": url, "endpoints": [{"path": "/task", "methods": ["POST"]}]}


def mcp_target(url: str) -> dict[str, Any]:
    return {"base_url": url + "/mcp", "mcp": {"tools": {"allow": ["echo"], "deny": []}}}


async def mcp_ok(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    return web.json_response({"jsonrpc": "2.0", "id": body["id"], "result": {"content": []}})


def refusals(sidecar: Sidecar, reason: str) -> float:
    body, _ = sidecar.gateway.metrics.render()
    for line in body.decode().splitlines():
        if line.startswith(f'egress_gateway_call_chain_refusals_total{{reason="{reason}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_every_api_sends_the_chain_with_this_agent_appended(
    upstream_factory: Factory, sidecar_factory: Factory
) -> None:
    sent_lines: list[list[str]] = []

    async def ok(request: web.Request) -> web.StreamResponse:
        sent_lines.append(request.headers.getall(CHAIN_HEADER, []))
        return web.json_response({"ok": True})

    upstream: FakeUpstream = await upstream_factory(ok)
    mcp_upstream: FakeUpstream = await upstream_factory(mcp_ok)
    policy = compile_policy(
        {"fake-openai": openai_target(upstream.url), "mcp": mcp_target(mcp_upstream.url)}
    )
    sc: Sidecar = await sidecar_factory(policy)
    before = now_ms()

    # Envelope, no chain: this call starts one, deadline now + ttl_s (900 s).
    status, answer = await sc.call(envelope())
    assert (status, answer["success"]) == (200, True), answer
    origin = upstream.seen[-1].headers
    assert origin[CHAIN_HEADER] == ME
    assert before + 900_000 <= int(origin[DEADLINE_HEADER]) <= now_ms() + 900_000
    assert SIGNATURE_HEADER not in origin  # no signing key: unsigned

    # Envelope with the chain its agent received: extended, the deadline kept.
    deadline = now_ms() + 60_000
    chain = {"agents": ["planner", "router"], "deadline_ms": deadline}
    status, answer = await sc.call(envelope(call_chain=chain))
    assert status == 200, answer
    assert upstream.seen[-1].headers[CHAIN_HEADER] == f"planner,router,{ME}"
    assert upstream.seen[-1].headers[DEADLINE_HEADER] == str(deadline)

    # Drop-in route: the agent's headers are read, and replaced (never sent twice).
    headers = {CHAIN_HEADER: "planner", DEADLINE_HEADER: str(deadline)}
    url = sc.url + "/proxy/fake-openai/v1/chat/completions"
    async with sc.session.post(url, json={"model": "m"}, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
    sent = upstream.seen[-1].headers
    assert sent[CHAIN_HEADER] == f"planner,{ME}"
    assert sent_lines[-1] == [f"planner,{ME}"]

    # MCP route.
    async with sc.session.post(
        sc.url + "/mcp/mcp", json=CALL, headers={"Accept": rpc.ACCEPT, **headers}
    ) as resp:
        assert resp.status == 200
        assert "result" in await resp.json()
    assert mcp_upstream.seen[-1].headers[CHAIN_HEADER] == f"planner,{ME}"

    records = sc.audit_records()
    assert [(r["api"], r["call_chain"], r["call_chain_depth"]) for r in records] == [
        ("envelope", [ME], 1),
        ("envelope", ["planner", "router", ME], 3),
        ("proxy", ["planner", ME], 2),
        ("mcp", ["planner", ME], 2),
    ]


REFUSED = [
    ("circular", {"agents": ["planner", ME]}, {}, "circular_call_detected", ["planner", ME, ME]),
    ("too deep", {"agents": ["a", "b"]}, {"max_depth": 2}, "max_depth_exceeded", ["a", "b", ME]),
    ("stale", {"agents": ["a"], "deadline_ms": 1}, {}, "ttl_expired", ["a", ME]),
    ("bad id", {"agents": ["a b"]}, {}, "invalid_chain", None),
    ("far future", {"agents": ["a"], "deadline_ms": 10**15}, {}, "invalid_chain", None),
]


@pytest.mark.parametrize(
    ("chain", "spec", "reason", "refused"),
    [case[1:] for case in REFUSED],
    ids=[case[0] for case in REFUSED],
)
async def test_a_refused_chain_reaches_no_upstream_on_any_api(
    upstream_factory: Factory,
    sidecar_factory: Factory,
    chain: dict[str, Any],
    spec: dict[str, Any],
    reason: str,
    refused: list[str] | None,
) -> None:
    upstream: FakeUpstream = await upstream_factory(mcp_ok)
    policy = compile_policy(
        {"fake-openai": openai_target(upstream.url), "mcp": mcp_target(upstream.url)},
        chain=spec,
    )
    sc: Sidecar = await sidecar_factory(policy)
    headers = {CHAIN_HEADER: ",".join(chain["agents"])}
    if "deadline_ms" in chain:
        headers[DEADLINE_HEADER] = str(chain["deadline_ms"])

    status, answer = await sc.call(envelope(call_chain=chain))
    assert status == 409
    error = answer["error"]
    assert (error["code"], error["retryable"]) == ("CALL_CHAIN_REFUSED", False)
    assert error["details"] == {"reason": reason, "call_chain": refused}

    url = sc.url + "/proxy/fake-openai/v1/chat/completions"
    async with sc.session.post(url, json={"model": "m"}, headers=headers) as resp:
        assert resp.status == 409
        assert resp.headers["x-egress-error-code"] == "CALL_CHAIN_REFUSED"
        assert resp.headers["x-egress-retryable"] == "false"

    async with sc.session.post(
        sc.url + "/mcp/mcp", json=CALL, headers={"Accept": rpc.ACCEPT, **headers}
    ) as resp:
        data = (await resp.json())["error"]["data"]
        assert data["egress_code"] == "CALL_CHAIN_REFUSED"

    assert upstream.hits == 0
    records = sc.audit_records()
    assert [r["api"] for r in records] == ["envelope", "proxy", "mcp"]
    for record in records:
        assert record["error_code"] == "CALL_CHAIN_REFUSED"
        assert record["decision"] == "denied"
        assert record["attempts"] == 0
        assert record["call_chain"] == refused
        assert record["call_chain_depth"] == (len(refused) if refused else None)
    assert refusals(sc, reason) == 3


@pytest.mark.slow
async def test_the_chains_deadline_ends_the_call_before_its_own_timeout(
    upstream_factory: Factory, sidecar_factory: Factory
) -> None:
    release = asyncio.Event()

    async def stuck(_: web.Request) -> web.StreamResponse:
        await release.wait()
        return web.json_response({})

    upstream: FakeUpstream = await upstream_factory(stuck)
    sc: Sidecar = await sidecar_factory(
        compile_policy({"fake-openai": openai_target(upstream.url)})
    )
    chain = {"agents": ["planner"], "deadline_ms": now_ms() + 3000}
    try:
        status, answer = await sc.call(
            envelope(
                call_chain=chain,
                timeout=50,
                max_retries=0,
                method="GET",
                endpoint="/v1/models/m",
                parameters={},
            )
        )
    finally:
        release.set()
    assert status == 504
    assert answer["error"]["code"] == "AGENT_TIMEOUT"
    assert upstream.hits == 1
    # The envelope allowed 50 s; the chain's 3 s decided (a generous bound for a busy host).
    assert answer["latency_ms"] < 20_000


async def test_signed_chains_pass_between_sidecars_and_forgeries_do_not(
    upstream_factory: Factory, sidecar_factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHAIN_KEY_OLD", "fleet-chain-key-2025")
    monkeypatch.setenv("CHAIN_KEY_NEW", "fleet-chain-key-2026")
    upstream: FakeUpstream = await upstream_factory()
    targets = {"fake-openai": openai_target(upstream.url)}
    old = {"signing_key_ref": "env://CHAIN_KEY_OLD"}
    rotating = {
        "signing_key_ref": "env://CHAIN_KEY_NEW",
        "previous_signing_key_ref": "env://CHAIN_KEY_OLD",
        "require_signed_inbound": True,
    }
    first: Sidecar = await sidecar_factory(compile_policy(targets, chain=old))
    second: Sidecar = await sidecar_factory(
        compile_policy(targets, chain=rotating, agent_id="executor")
    )

    status, _ = await first.call(envelope())
    assert status == 200
    signed = {
        k: upstream.seen[-1].headers[k] for k in (CHAIN_HEADER, DEADLINE_HEADER, SIGNATURE_HEADER)
    }
    assert signed[CHAIN_HEADER] == ME
    assert signed[SIGNATURE_HEADER].startswith("v1=")

    async def through_second(headers: dict[str, str]) -> aiohttp.ClientResponse:
        url = second.url + "/proxy/fake-openai/v1/chat/completions"
        async with second.session.post(url, json={"model": "m"}, headers=headers) as resp:
            await resp.read()
            return resp

    resp = await through_second(signed)  # signed with the previous key: still accepted
    assert resp.status == 200
    relayed = upstream.seen[-1].headers
    assert relayed[CHAIN_HEADER] == f"{ME},executor"
    assert relayed[SIGNATURE_HEADER] != signed[SIGNATURE_HEADER]  # re-signed, new key
    hits = upstream.hits
    forgeries = [
        {**signed, CHAIN_HEADER: "someone-else"},  # forged
        {**signed, CHAIN_HEADER: f"origin,{ME}"},  # not the chain that was signed
        {**signed, DEADLINE_HEADER: str(int(signed[DEADLINE_HEADER]) + 1)},  # deadline moved
        {CHAIN_HEADER: ME, DEADLINE_HEADER: signed[DEADLINE_HEADER]},  # unsigned: required
    ]
    for headers in forgeries:
        resp = await through_second(headers)
        assert resp.status == 409
        assert resp.headers["x-egress-error-code"] == "CALL_CHAIN_REFUSED"
    assert upstream.hits == hits
    assert refusals(second, "invalid_chain") == len(forgeries)
    leaked = [r for r in second.lines() + first.lines() if "fleet-chain-key" in json.dumps(r)]
    assert leaked == []


async def test_a_loop_between_two_agents_stops_at_its_first_repeat(
    upstream_factory: Factory, sidecar_factory: Factory
) -> None:
    # planner (behind sidecar P) asks executor (behind sidecar E), which asks planner
    # back, which asks executor again: each agent passes on the chain it received.
    sidecars: dict[str, Sidecar] = {}

    def agent(name: str, calls: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handle(request: web.Request) -> web.Response:
            passed = {
                k: v
                for k, v in request.headers.items()
                if k.lower() in (CHAIN_HEADER, DEADLINE_HEADER)
            }
            own = sidecars[name]
            url = f"{own.url}/proxy/{calls}/task"
            async with own.session.post(url, json={}, headers=passed) as resp:
                return web.Response(status=resp.status, body=await resp.read())

        return handle

    planner_server: FakeUpstream = await upstream_factory(agent("planner", "executor"))
    executor_server: FakeUpstream = await upstream_factory(agent("executor", "planner"))
    sidecars["planner"] = await sidecar_factory(
        compile_policy({"executor": agent_target(executor_server.url)}, agent_id="planner")
    )
    sidecars["executor"] = await sidecar_factory(
        compile_policy({"planner": agent_target(planner_server.url)}, agent_id="executor")
    )

    # The planner's first call (no chain: it is the origin).
    url = sidecars["planner"].url + "/proxy/executor/task"
    async with sidecars["planner"].session.post(url, json={}) as resp:
        assert resp.status == 409
        body = await resp.read()
    assert b"CALL_CHAIN_REFUSED" in body
    # executor was called once, planner once; planner's second call never left.
    assert (executor_server.hits, planner_server.hits) == (1, 1)
    p_records = sidecars["planner"].audit_records()
    e_records = sidecars["executor"].audit_records()
    refused = [r for r in p_records if r["error_code"] == "CALL_CHAIN_REFUSED"]
    assert [r["call_chain"] for r in refused] == [["planner", "executor", "planner"]]
    assert refused[0]["attempts"] == 0
    assert [r["call_chain"] for r in e_records] == [["planner", "executor"]]
    assert e_records[0]["status_code"] == 409  # the refusal came back through executor
