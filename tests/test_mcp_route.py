"""The MCP route's HTTP behaviour against a recording loopback upstream: what
the sidecar itself answers (JSON-RPC errors), event streams relayed and filtered event by
event, a stream cut mid-way, GET and DELETE, rate-limit groups, metrics. The real SDK on
both ends is tests/test_mcp_sdk.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from gateway.providers import mcp as rpc
from tests.conftest import FakeUpstream, Sidecar, compile_policy, openai_target

Factory = Callable[..., Awaitable[Any]]
CALL = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "echo"}}


def target(url: str, **extra: Any) -> dict[str, Any]:
    return {
        "base_url": url + "/mcp",
        "mcp": {"tools": {"allow": ["echo", "slow"], "deny": []}},
        "retry": {"backoff_base_s": 0.01, "backoff_max_s": 0.02},
        **extra,
    }


async def post(sidecar: Sidecar, path: str, body: Any, **headers: str) -> tuple[int, Any, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", "Accept": rpc.ACCEPT, **headers}
    async with sidecar.session.post(sidecar.url + path, data=data, headers=hdrs) as resp:
        raw = await resp.read()
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        return resp.status, resp.headers, value


async def test_sidecar_answers_are_jsonrpc(
    upstream_factory: Factory, sidecar_factory: Factory
) -> None:
    upstream: FakeUpstream = await upstream_factory()
    policy = compile_policy({"mcp": target(upstream.url), "plain": openai_target(upstream.url)})
    sidecar: Sidecar = await sidecar_factory(policy)

    status, _, answer = await post(sidecar, "/mcp/mcp", b"{not json")
    assert status == 400
    assert answer["id"] is None
    assert answer["error"]["code"] == rpc.PARSE_ERROR
    assert answer["error"]["data"]["egress_code"] == "INVALID_PAYLOAD"

    status, _, answer = await post(sidecar, "/mcp/mcp", {"jsonrpc": "2.0", "id": 1})
    assert (status, answer["error"]["code"]) == (400, rpc.INVALID_REQUEST)

    status, _, answer = await post(sidecar, "/mcp/plain", CALL)
    assert status == 200  # the JSON-RPC error is the request's answer
    assert answer["id"] == 7
    assert answer["error"]["code"] == rpc.EGRESS_ERROR
    assert answer["error"]["data"]["reason"] == "not_an_mcp_target"

    status, _, answer = await post(sidecar, "/mcp/nowhere", CALL)
    assert answer["error"]["data"]["reason"] == "unknown_target"

    async with sidecar.session.put(sidecar.url + "/mcp/mcp", data=b"{}") as resp:
        assert resp.status == 405
        assert (await resp.json())["error"]["data"]["reason"] == "method"
    assert upstream.hits == 0

    # the upstream is down: a JSON-RPC error per request, retryable, nothing hangs
    await upstream.server.close()  # type: ignore[union-attr]
    status, headers, answer = await post(sidecar, "/mcp/mcp", CALL)
    assert status == 200
    assert answer["error"]["data"]["egress_code"] == "DEPENDENCY_FAILED"
    assert answer["error"]["data"]["retryable"] is True
    assert headers["x-egress-error-code"] == "DEPENDENCY_FAILED"
    records = [r for r in sidecar.audit_records() if r["api"] == "mcp"]
    assert len(records) == 6
    assert all(r["latency_ms"] >= 0 for r in records)


def sse(*messages: Any, ids: bool = True) -> list[bytes]:
    return [
        (f"id: e{i}\n" if ids else "").encode()
        + b"event: message\ndata: "
        + json.dumps(m).encode()
        + b"\n\n"
        for i, m in enumerate(messages)
    ]


async def test_streams_are_relayed_event_by_event_and_filtered(
    upstream_factory: Factory, sidecar_factory: Factory
) -> None:
    release = asyncio.Event()
    listing = {
        "jsonrpc": "2.0",
        "id": "L",
        "result": {"tools": [{"name": "echo"}, {"name": "rm_rf"}, {"name": "slow"}]},
    }
    progress = {"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progress": 1}}
    asked = {"jsonrpc": "2.0", "id": 0, "method": "sampling/createMessage", "params": {}}

    async def handler(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Mcp-Session-Id": "s1"}
        )
        await resp.prepare(request)
        if body["method"] == "tools/list":
            for event in sse(listing):
                await resp.write(event)
        else:
            first, second, last = sse(
                progress, asked, {"jsonrpc": "2.0", "id": 7, "result": {"isError": True}}
            )
            await resp.write(first)
            await resp.write(second)
            await release.wait()  # the agent must have the first events before the result
            await resp.write(last)
        await resp.write_eof()
        return resp

    upstream: FakeUpstream = await upstream_factory(handler)
    sidecar: Sidecar = await sidecar_factory(compile_policy({"mcp": target(upstream.url)}))

    hdrs = {"Content-Type": "application/json", "Accept": rpc.ACCEPT}
    listing_request = {"jsonrpc": "2.0", "id": "L", "method": "tools/list"}
    async with sidecar.session.post(
        sidecar.url + "/mcp/mcp", json=listing_request, headers=hdrs
    ) as resp:
        assert resp.headers["Mcp-Session-Id"] == "s1"
        text = (await resp.read()).decode()
    assert text.startswith("id: e0\nevent: message\ndata: ")
    data = json.loads(text.split("data: ", 1)[1])
    assert [t["name"] for t in data["result"]["tools"]] == ["echo", "slow"]

    async with sidecar.session.post(sidecar.url + "/mcp/mcp", json=CALL, headers=hdrs) as resp:
        got = b""
        while got.count(b"\n\n") < 2:
            got += await asyncio.wait_for(resp.content.readany(), 5)
        assert got == b"".join(sse(progress, asked)[:2])  # unchanged, in order, before the result
        release.set()
        got += await resp.read()
    assert b'"isError": true' in got
    call_record = [r for r in sidecar.audit_records() if r["mcp_tool"] == "echo"][-1]
    assert call_record["mcp_is_error"] is True
    assert call_record["stream"] is True
    assert call_record["stream_events"] == 3


async def test_a_stream_cut_mid_way_ends_with_an_error_event(
    upstream_factory: Factory, sidecar_factory: Factory
) -> None:
    stop = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(
            sse({"jsonrpc": "2.0", "method": "notifications/progress", "params": {}})[0]
        )
        await stop.wait()  # ... and nothing more until the sidecar's idle timeout
        return resp

    upstream: FakeUpstream = await upstream_factory(handler)
    spec = target(upstream.url, stream_idle_timeout_s=0.2)
    sidecar: Sidecar = await sidecar_factory(compile_policy({"mcp": spec}))
    status, _, raw = await post(sidecar, "/mcp/mcp", CALL)
    assert status == 200
    events = [e for e in raw.decode().split("\n\n") if e.strip()]
    assert len(events) == 2
    last = json.loads(events[-1].split("data: ", 1)[1])
    assert last["id"] == 7
    assert last["error"]["data"]["egress_code"] == "STREAM_INTERRUPTED"
    assert last["error"]["data"]["reason"] == "idle_timeout"
    stop.set()
    record = [r for r in sidecar.audit_records() if r["api"] == "mcp"][-1]
    assert record["error_code"] == "STREAM_INTERRUPTED"
    assert record["mcp_is_error"] is None


async def test_get_delete_and_the_servers_statuses_pass(
    upstream_factory: Factory, sidecar_factory: Factory
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        if request.method == "GET":
            return web.Response(status=405, headers={"Allow": "POST, DELETE"})
        if request.method == "DELETE":
            return web.Response(status=204)
        if request.headers.get("Mcp-Session-Id") == "gone":
            return web.json_response(
                {
                    "jsonrpc": "2.0",
                    "id": None,
                    "error": {"code": -32600, "message": "Session not found"},
                },
                status=404,
            )
        return web.Response(status=202)

    upstream: FakeUpstream = await upstream_factory(handler)
    spec = target(
        upstream.url,
        credential={
            "header": "Authorization",
            "format": "Bearer {secret}",
            "default_ref": "env://TEST_OPENAI_KEY",
        },
    )
    sidecar: Sidecar = await sidecar_factory(compile_policy({"mcp": spec}))
    own = {"Authorization": "Bearer agent-token-TEST-0007", "Mcp-Session-Id": "s1", "Cookie": "c=1"}
    async with sidecar.session.get(
        sidecar.url + "/mcp/mcp", headers={**own, "Accept": "text/event-stream"}
    ) as resp:
        assert resp.status == 405
        assert resp.headers["Allow"] == "POST, DELETE"
    async with sidecar.session.delete(sidecar.url + "/mcp/mcp", headers=own) as resp:
        assert resp.status == 204
    note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    status, _, _ = await post(sidecar, "/mcp/mcp", note, **own)
    assert status == 202
    status, _, answer = await post(sidecar, "/mcp/mcp", CALL, **{**own, "Mcp-Session-Id": "gone"})
    assert status == 404
    assert answer["error"]["message"] == "Session not found"
    assert [s.method for s in upstream.seen] == ["GET", "DELETE", "POST", "POST"]
    for seen in upstream.seen:
        assert seen.headers["Authorization"] == "Bearer sk-fake-TEST-0001-NOTREAL"
        assert "Cookie" not in seen.headers
        assert seen.path == "/mcp"
    assert {k.lower(): v for k, v in upstream.seen[0].headers.items()}["mcp-session-id"] == "s1"
    records = [r for r in sidecar.audit_records() if r["api"] == "mcp"]
    assert [r["mcp_method"] for r in records] == [
        None,
        None,
        "notifications/initialized",
        "tools/call",
    ]
    assert records[-1]["status_code"] == 404


async def test_tool_calls_queue_apart_and_are_counted(
    upstream_factory: Factory, sidecar_factory: Factory
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        return web.json_response({"jsonrpc": "2.0", "id": body["id"], "result": {"content": []}})

    upstream: FakeUpstream = await upstream_factory(handler)
    spec = target(upstream.url, rate_limit_group="chatter")
    spec["mcp"]["tools_rate_limit_group"] = "tools"
    groups = {
        "chatter": {"requests_per_second": 100, "burst": 100},
        "tools": {"requests_per_second": 0.01, "burst": 1, "max_queue_s": 0},
    }
    sidecar: Sidecar = await sidecar_factory(
        compile_policy({"mcp": spec}, rate_limit_groups=groups)
    )
    first = await post(sidecar, "/mcp/mcp", CALL)
    assert "result" in first[2]
    status, _, second = await post(sidecar, "/mcp/mcp", {**CALL, "id": 8})
    assert status == 200
    assert second["error"]["data"]["egress_code"] == "CAPACITY_EXCEEDED"
    assert second["error"]["data"]["suggested_retry_after"] > 0
    for n in range(3):  # the protocol's chatter is not held up by the tools' group
        _, _, listed = await post(
            sidecar, "/mcp/mcp", {"jsonrpc": "2.0", "id": n, "method": "tools/list"}
        )
        assert "result" in listed
    assert upstream.hits == 4
    records = [r for r in sidecar.audit_records() if r["api"] == "mcp"]
    assert [r["rate_limit_group"] for r in records] == [
        "tools",
        "tools",
        "chatter",
        "chatter",
        "chatter",
    ]
    async with sidecar.session.get(sidecar.url + "/metrics") as resp:
        metrics = await resp.text()
    series = "egress_gateway_mcp_requests_total"
    assert f'{series}{{method="tools/call",outcome="ok",target="mcp",tool="echo"}} 1.0' in metrics
    assert (
        f'{series}{{method="tools/call",outcome="failed",target="mcp",tool="echo"}} 1.0' in metrics
    )
    assert 'method="tools/list",outcome="ok",target="mcp",tool="_none"} 3.0' in metrics


async def test_no_way_around_the_rules(upstream_factory: Factory, sidecar_factory: Factory) -> None:
    """The drop-in route and an envelope's ``body`` would carry JSON-RPC the rules never
    read (a batch, a tools/list answer): both are refused for an MCP target."""
    upstream: FakeUpstream = await upstream_factory()
    sidecar: Sidecar = await sidecar_factory(compile_policy({"mcp": target(upstream.url)}))
    denied = [{**CALL, "params": {"name": "rm_rf"}}]
    async with sidecar.session.post(sidecar.url + "/proxy/mcp/mcp", json=denied) as resp:
        assert resp.status == 403
        assert resp.headers["x-egress-error-code"] == "PERMISSION_DENIED"
    body = {"content_type": "application/json", "base64": "W10="}
    envelope = {
        "trace_id": "t",
        "correlation_id": "c",
        "target_system": "mcp",
        "endpoint": "/mcp",
        "method": "POST",
        "body": body,
    }
    status, answer = await sidecar.call(envelope)
    assert status == 403
    assert answer["error"]["details"]["reason"] == "mcp_body"
    assert upstream.hits == 0
