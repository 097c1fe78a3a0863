"""MCP targets with the real ``mcp`` Python SDK.

A real MCP server (:mod:`tests.mcp_server`: the SDK's ``MCPServer`` over streamable HTTP,
in a thread) is the upstream; the SDK's own streamable-HTTP client talks to
``/mcp/{target}`` on a real sidecar, with a token of its own that must never reach the
server. Asserted: what the server received (requests, headers, side effects), what the
client got (results, filtered lists, JSON-RPC errors with ``data.egress_code``, progress
in order), and the sidecar's audit records (one per JSON-RPC request).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx2
import pytest
from mcp import ClientSession
from mcp.client import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from gateway.providers import mcp as rpc
from tests.conftest import Sidecar, compile_policy
from tests.mcp_server import McpTestServer, RunningServer

SERVER_TOKEN = "mcp-fake-TEST-0005-NOTREAL"  # what the sidecar injects (env://)
AGENT_TOKEN = "agent-own-TEST-0006-NOTREAL"  # what the agent's client sends: never forwarded
JSON_URL = "{}/mcp/tools-json"
SSE_URL = "{}/mcp/tools"
ALLOWED = ["echo", "headers", "create_issue", "progress", "fail", "delete_*"]


@pytest.fixture(scope="module")
def sse_server() -> Iterator[McpTestServer]:
    """Stateful (sessions), answering requests as event streams (the SDK's default)."""
    running = RunningServer()
    yield running.start()
    running.stop()


@pytest.fixture(autouse=True)
def _mcp_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_MCP_TOKEN", SERVER_TOKEN)


def mcp_target(url: str, **mcp: Any) -> dict[str, Any]:
    rules: dict[str, Any] = {
        "tools": {"allow": ALLOWED, "deny": ["delete_*"]},
        "arguments": {"create_issue": {"repo": {"pattern": "acme/[a-z-]+"}}},
    }
    rules.update(mcp)
    return {
        "base_url": url,
        "credential": {
            "header": "Authorization",
            "format": "Bearer {secret}",
            "default_ref": "env://TEST_MCP_TOKEN",
        },
        "mcp": rules,
        "retry": {"backoff_base_s": 0.01, "backoff_max_s": 0.05},
    }


@pytest.fixture
async def sidecar(
    sidecar_factory: Callable[..., Awaitable[Sidecar]],
    sse_server: McpTestServer,
    json_server: McpTestServer,
) -> Sidecar:
    policy = compile_policy(
        {"tools": mcp_target(sse_server.url), "tools-json": mcp_target(json_server.url)}
    )
    return await sidecar_factory(policy)


@asynccontextmanager
async def session(url: str) -> AsyncIterator[ClientSession]:
    """The SDK's client with a token of its own (as an agent configured for the real
    server would have), handshake mode (2025-11-25: initialize, Mcp-Session-Id)."""
    headers = {"Authorization": f"Bearer {AGENT_TOKEN}"}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=10) as http,
        streamable_http_client(url, http_client=http) as (read, write),
        ClientSession(read, write) as client,
    ):
        await client.initialize()
        yield client


async def post(
    sidecar: Sidecar, url: str, body: Any, headers: dict[str, str]
) -> tuple[int, dict[str, str], Any]:
    """POST a JSON-RPC body to the sidecar's MCP route: (status, headers, JSON or text)."""
    async with sidecar.session.post(url.format(sidecar.url), json=body, headers=headers) as resp:
        text = await resp.text()
        try:
            value: Any = json.loads(text)
        except ValueError:
            value = text
        return resp.status, dict(resp.headers), value


def mcp_records(sidecar: Sidecar) -> list[dict[str, Any]]:
    return [r for r in sidecar.audit_records() if r["api"] == "mcp"]


def tool_calls(server: McpTestServer) -> list[str]:
    calls = []
    for r in server.posts():
        try:
            body = json.loads(r.body)
        except ValueError:
            continue
        for m in body if isinstance(body, list) else [body]:
            if isinstance(m, dict) and m.get("method") == "tools/call":
                calls.append(m["params"]["name"])
    return calls


async def test_the_sdk_through_the_sidecar(sidecar: Sidecar, sse_server: McpTestServer) -> None:
    before = len(sse_server.requests)
    async with session(sidecar.url + "/mcp/tools") as client:
        listed = await client.list_tools()
        names = sorted(t.name for t in listed.tools)
        # filtered: delete_repo is denied, internal_admin is not allowed
        assert names == ["create_issue", "echo", "fail", "headers", "progress"]

        echoed = await client.call_tool("echo", {"text": "hello"})
        assert echoed.is_error is False
        assert echoed.content[0].text == "hello"  # type: ignore[union-attr]

        # The server got the injected credential (it says so; the sidecar scrubs the
        # secret's value from the answer, as from every answer) and never the agent's.
        seen = await client.call_tool("headers", {})
        assert seen.structured_content == {"authorization": "Bearer [REDACTED]"}

        with pytest.raises(MCPError) as denied:
            await client.call_tool("delete_repo", {"repo": "acme/web"})
        assert denied.value.error.code == rpc.EGRESS_ERROR
        assert denied.value.error.data["egress_code"] == "PERMISSION_DENIED"
        assert denied.value.error.data["rule"] == "mcp.tools.deny"
        assert "delete_repo" in denied.value.error.message
        assert "'delete_*'" in denied.value.error.message

        with pytest.raises(MCPError) as bad_argument:
            await client.call_tool("create_issue", {"repo": "evil/web", "title": "x"})
        data = bad_argument.value.error.data
        assert data["rule"] == "mcp.arguments.create_issue.repo"
        assert data["argument"] == "repo"

        created = await client.call_tool("create_issue", {"repo": "acme/web", "title": "x"})
        assert created.is_error is False

        failed = await client.call_tool("fail", {})
        assert failed.is_error is True

        seen_progress: list[tuple[float, str | None]] = []

        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            seen_progress.append((progress, message))

        done = await client.call_tool("progress", {"steps": 3}, progress_callback=on_progress)
        assert done.content[0].text == "done after 3"  # type: ignore[union-attr]
        assert seen_progress == [(1, "step 1"), (2, "step 2"), (3, "step 3")]
        # The SDK opens its GET stream in a background task: wait (bounded) until it did.
        for _ in range(500):
            if any(r.method == "GET" for r in sse_server.requests[before:]):
                break
            await asyncio.sleep(0.01)

    # Nothing refused reached the server; what was allowed did, once.
    assert sse_server.side_effects.count("create_issue acme/web x") == 1
    assert not [s for s in sse_server.side_effects if s.startswith("delete_repo")]
    calls = tool_calls(McpTestServer(sse_server.url, sse_server.requests[before:]))
    assert calls == ["echo", "headers", "create_issue", "fail", "progress"]
    mine = sse_server.requests[before:]
    # the agent's token never, the injected credential on every request (GET, DELETE too)
    assert all(AGENT_TOKEN not in json.dumps(r.headers) for r in mine)
    assert all(r.headers.get("authorization") == f"Bearer {SERVER_TOKEN}" for r in mine)
    methods = {r.method for r in mine}
    assert {"POST", "GET", "DELETE"} <= methods  # the GET stream and the session's end
    assert all(r.headers.get("mcp-session-id") for r in mine[1:])  # after initialize

    for _ in range(500):  # the GET's record is written when its stream ends: after the client
        if any(r["method"] == "GET" for r in mcp_records(sidecar)):
            break
        await asyncio.sleep(0.01)
    records = mcp_records(sidecar)
    by_tool = {(r["mcp_method"], r["mcp_tool"]): r for r in records if r["mcp_method"]}
    assert by_tool[("tools/call", "echo")]["mcp_is_error"] is False
    assert by_tool[("tools/call", "fail")]["mcp_is_error"] is True
    refused = by_tool[("tools/call", "delete_repo")]
    assert refused["decision"] == "denied"
    assert refused["error_code"] == "PERMISSION_DENIED"
    assert refused["attempts"] == 0
    assert {r["method"] for r in records} >= {"POST", "GET", "DELETE"}  # each audited too
    # In the order the client sent them (the SDK numbers its requests), not the order the
    # records were written: a call's record may follow its answer, so under load the next
    # call's record can be written first.
    calls_audited = [
        (r["mcp_tool"], r["decision"], r["error_code"], r["mcp_is_error"])
        for r in sorted(records, key=lambda r: int(r["mcp_request_id"] or -1))
        if r["mcp_method"] == "tools/call"
    ]
    assert calls_audited == [
        ("echo", "allowed", None, False),
        ("headers", "allowed", None, False),
        ("delete_repo", "denied", "PERMISSION_DENIED", None),
        ("create_issue", "denied", "PERMISSION_DENIED", None),
        ("create_issue", "allowed", None, False),
        ("fail", "allowed", None, True),
        ("progress", "allowed", None, False),
    ]
    allowed = [r for r in records if r["decision"] == "allowed"]
    assert all(r["api_key_ref"] == "env://TEST_MCP_TOKEN" for r in allowed)
    assert ("tools/list", None) in by_tool
    assert ("initialize", None) in by_tool
    assert all(r["mcp_request_id"] is not None for r in records if r["mcp_method"] == "tools/call")
    assert AGENT_TOKEN not in sidecar.log.getvalue()
    assert SERVER_TOKEN not in sidecar.log.getvalue()


async def test_headers_that_do_not_match_the_body_are_refused(
    sidecar: Sidecar, json_server: McpTestServer
) -> None:
    before = len(json_server.posts())
    body = {
        "jsonrpc": "2.0",
        "id": 5,
        "method": "tools/call",
        "params": {"name": "create_issue", "arguments": {"repo": "acme/web", "title": "t"}},
    }
    headers = {
        "Accept": rpc.ACCEPT,
        "Content-Type": "application/json",
        "Mcp-Method": "tools/call",
        "Mcp-Name": "echo",  # an intermediary authorising on headers would see echo
    }
    async with sidecar.session.post(
        sidecar.url + "/mcp/tools-json", json=body, headers=headers
    ) as resp:
        assert resp.status == 400
        answer = await resp.json()
    assert answer["id"] == 5
    assert answer["error"]["code"] == rpc.HEADER_MISMATCH
    assert answer["error"]["data"]["egress_code"] == "INVALID_PAYLOAD"
    assert answer["error"]["data"]["reason"] == "mcp_header_mismatch"
    assert len(json_server.posts()) == before  # nothing forwarded

    headers["Mcp-Name"] = "create_issue"  # matching headers pass
    async with sidecar.session.post(
        sidecar.url + "/mcp/tools-json", json=body, headers=headers
    ) as resp:
        assert resp.status == 200
        answer = await resp.json()
    assert answer["result"]["isError"] is False
    assert len(json_server.posts()) == before + 1


async def test_a_batch_with_one_refused_request_is_refused_whole(
    sidecar: Sidecar, json_server: McpTestServer
) -> None:
    before = len(json_server.posts())
    echo = {"name": "echo", "arguments": {"text": "a"}}
    batch = [
        {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": echo},
        {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 0}},
        {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "internal_admin"}},
    ]
    headers = {"Accept": rpc.ACCEPT}
    status, _, answer = await post(sidecar, JSON_URL, batch, headers)
    assert status == 200
    assert [a["id"] for a in answer] == [1, 2]
    assert answer[0]["error"]["data"]["reason"] == "batch_refused"
    assert answer[1]["error"]["data"]["reason"] == "tool_not_allowed"
    assert len(json_server.posts()) == before
    records = [r for r in mcp_records(sidecar) if r["mcp_method"]]
    assert [(r["mcp_method"], r["mcp_tool"], r["decision"]) for r in records] == [
        ("tools/call", "echo", "denied"),
        ("tools/call", "internal_admin", "denied"),
    ]


async def test_json_answers_are_filtered_and_sessions_pass_back(
    sidecar: Sidecar, json_server: McpTestServer, sse_server: McpTestServer
) -> None:
    headers = {"Accept": rpc.ACCEPT, "Authorization": f"Bearer {AGENT_TOKEN}"}
    listing = {"jsonrpc": "2.0", "id": "l1", "method": "tools/list", "params": {}}
    status, got, answer = await post(sidecar, JSON_URL, listing, headers)
    assert status == 200
    assert got["Content-Type"].startswith("application/json")
    names = {t["name"] for t in answer["result"]["tools"]}
    assert names == {"create_issue", "echo", "fail", "headers", "progress"}

    # A session the server does not know: its 404 goes back as it is (the SDK then knows
    # the session ended), not as a sidecar error.
    stale = {**headers, "Mcp-Session-Id": "0" * 32, "Mcp-Protocol-Version": "2025-11-25"}
    status, got, _ = await post(sidecar, SSE_URL, listing, stale)
    assert status == 404
    assert got["x-egress-error-code"] == "UPSTREAM_REJECTED"
    assert all(AGENT_TOKEN not in json.dumps(r.headers) for r in sse_server.requests)


async def test_an_envelope_to_an_mcp_target_gets_the_same_checks(
    sidecar: Sidecar, json_server: McpTestServer
) -> None:
    def envelope(params: dict[str, Any]) -> dict[str, Any]:
        return {
            "trace_id": "tr-mcp-1",
            "correlation_id": "c-1",
            "target_system": "tools-json",
            "endpoint": "/mcp",
            "method": "POST",
            "parameters": {"jsonrpc": "2.0", "id": 1, **params},
        }

    before = len(json_server.posts())
    status, denied = await sidecar.call(
        envelope({"method": "tools/call", "params": {"name": "delete_repo", "arguments": {}}})
    )
    assert status == 403
    assert denied["error"]["code"] == "PERMISSION_DENIED"
    assert denied["error"]["details"]["rule"] == "mcp.tools.deny"
    assert len(json_server.posts()) == before

    status, listed = await sidecar.call(envelope({"method": "tools/list", "params": {}}))
    assert status == 200, listed
    assert "delete_repo" not in {t["name"] for t in listed["data"]["result"]["tools"]}
    status, echoed = await sidecar.call(
        envelope({"method": "tools/call", "params": {"name": "echo", "arguments": {"text": "e"}}})
    )
    assert echoed["data"]["result"]["content"][0]["text"] == "e"
    record = [r for r in sidecar.audit_records() if r["mcp_tool"] == "echo"][-1]
    assert record["api"] == "envelope"
    assert record["mcp_is_error"] is False


async def test_the_2026_client_names_its_calls_in_headers(
    sidecar: Sidecar, sse_server: McpTestServer
) -> None:
    """The SDK's high-level client in its default mode negotiates MCP 2026-07-28
    (``server/discover``, per-request ``Mcp-Method`` / ``Mcp-Name``): the headers match
    the body, so the sidecar passes them on, and the rules hold as in 2025-11-25."""
    before = len(sse_server.requests)
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {AGENT_TOKEN}"}, timeout=10)
    transport = streamable_http_client(sidecar.url + "/mcp/tools", http_client=http)
    async with http, Client(transport, mode="auto") as client:
        assert client.session.protocol_version == "2026-07-28"
        listed = await client.list_tools()
        assert "delete_repo" not in {t.name for t in listed.tools}
        echoed = await client.call_tool("echo", {"text": "modern"})
        assert echoed.content[0].text == "modern"  # type: ignore[union-attr]
        with pytest.raises(MCPError) as denied:
            await client.call_tool("delete_repo", {"repo": "acme/web"})
        assert denied.value.error.data["egress_code"] == "PERMISSION_DENIED"
    mine = sse_server.requests[before:]
    calls = [r for r in mine if r.headers.get("mcp-method") == "tools/call"]
    assert [r.headers.get("mcp-name") for r in calls] == ["echo"]  # the denied one never came
    assert all(AGENT_TOKEN not in json.dumps(r.headers) for r in mine)
    records = [r for r in mcp_records(sidecar) if r["mcp_method"] == "tools/call"]
    assert [(r["mcp_tool"], r["decision"]) for r in records] == [
        ("echo", "allowed"),
        ("delete_repo", "denied"),
    ]
