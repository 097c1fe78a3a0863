"""Each route family answers in its own shape, always: a request under ``/proxy`` or
``/mcp`` that none of their routes matches (no target, no path, a path past the MCP
endpoint, ``CONNECT``) is answered as the drop-in route answers (the provider's error
shape, of the target the path names when it names one) or as the MCP route answers (a
JSON-RPC error), with the ``x-egress-*`` ids of its audit record; what is under neither
keeps the envelope's shape. A refused ``tools/call`` sent as a notification (no id to
answer) is an HTTP error with a JSON-RPC error of id null, as the MCP transport says
for input a server does not accept."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp import web

from gateway.providers import mcp as rpc
from tests.conftest import compile_policy, openai_target
from tests.rawhttp import exchange

# (method, request target, extra header lines) -> (status, shape)
# shapes: "openai" / "anthropic" error body, "jsonrpc" error, "envelope" ExternalCallResponse
ROWS = [
    ("GET", "/proxy", "", 404, "openai"),
    ("GET", "/proxy/", "", 404, "openai"),
    ("POST", "/proxy//v1/chat/completions", "", 404, "openai"),
    ("POST", "/proxy//v1/messages", "anthropic-version: 2023-06-01\r\n", 404, "anthropic"),
    ("GET", "/proxy/openai", "", 404, "openai"),
    ("GET", "/proxy/claude", "", 404, "anthropic"),
    ("CONNECT", "/proxy/openai/v1/chat/completions", "", 404, "openai"),
    ("CONNECT", "/proxy/claude/v1/messages", "", 404, "anthropic"),
    ("GET", "/proxy/nope/v1/x", "", 403, "openai"),
    ("POST", "/mcp", "", 404, "jsonrpc"),
    ("POST", "/mcp/", "", 404, "jsonrpc"),
    ("POST", "/mcp//", "", 404, "jsonrpc"),
    ("POST", "/mcp/tools/x", "", 404, "jsonrpc"),
    ("GET", "/mcp/tools/x/y", "", 404, "jsonrpc"),
    ("DELETE", "/mcp/openai/", "", 404, "jsonrpc"),
    ("CONNECT", "/mcp/tools", "", 404, "jsonrpc"),
    ("GET", "/proxyx", "", 404, "envelope"),
    ("GET", "/mcpx/tools", "", 404, "envelope"),
    ("CONNECT", "127.0.0.1:443", "", 404, "envelope"),
]


@pytest.fixture
async def sidecar(upstream_factory, sidecar_factory):
    up = await upstream_factory()
    targets = {
        "openai": openai_target(up.url),
        "claude": openai_target(up.url, usage="anthropic"),
        "tools": {"base_url": up.url + "/mcp", "mcp": {"tools": {"allow": ["echo"], "deny": []}}},
    }
    return await sidecar_factory(compile_policy(targets))


def _shape(body: Any) -> str:
    if body.get("jsonrpc") == "2.0":
        assert body["id"] is None
        assert body["error"]["code"] == rpc.EGRESS_ERROR
        assert body["error"]["data"]["egress_code"] in ("INVALID_PAYLOAD", "PERMISSION_DENIED")
        return "jsonrpc"
    if body.get("type") == "error":
        assert set(body["error"]) >= {"type", "message"}
        return "anthropic"
    if "success" in body:
        assert body["success"] is False
        return "envelope"
    assert set(body["error"]) >= {"message", "type", "code"}
    return "openai"


@pytest.mark.parametrize(("method", "target", "extra", "status", "shape"), ROWS)
async def test_every_path_under_a_route_family_answers_in_its_shape(
    sidecar, method: str, target: str, extra: str, status: int, shape: str
) -> None:
    raw = (
        f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}"
        "Content-Length: 0\r\nConnection: close\r\n\r\n"
    ).encode()
    got = await exchange(sidecar.server.port, raw)
    [answer] = got.answers
    assert answer.status == status, answer.body
    assert answer.headers["content-type"].startswith("application/json")
    assert _shape(json.loads(answer.body)) == shape
    [record] = sidecar.audit_records()
    assert record["success"] is False
    assert record["http_status"] == status or shape != "envelope"
    if shape == "envelope":
        return
    assert record["api"] == ("mcp" if shape == "jsonrpc" else "proxy")
    assert answer.headers["x-egress-trace-id"] == record["trace_id"]
    assert answer.headers["x-egress-correlation-id"] == record["correlation_id"]
    assert answer.headers["x-egress-error-code"] == record["error_code"]
    assert answer.headers["x-egress-retryable"] == "false"


async def test_claimed_ids_are_kept_on_an_unmatched_path(sidecar) -> None:
    headers = {"x-egress-trace-id": "tr-edge-1", "x-egress-correlation-id": "co-edge-1"}
    async with sidecar.session.post(sidecar.url + "/mcp/tools/extra", headers=headers) as resp:
        assert resp.status == 404
        assert resp.headers["x-egress-trace-id"] == "tr-edge-1"
        assert resp.headers["x-egress-correlation-id"] == "co-edge-1"
        assert (await resp.json())["jsonrpc"] == "2.0"
    [record] = sidecar.audit_records()
    assert (record["trace_id"], record["correlation_id"]) == ("tr-edge-1", "co-edge-1")


async def test_a_refused_notification_is_an_http_error_with_a_jsonrpc_error(
    upstream_factory, sidecar_factory
) -> None:
    async def accept(_: web.Request) -> web.StreamResponse:
        return web.Response(status=202)

    up = await upstream_factory(accept)
    spec = {"base_url": up.url + "/mcp", "mcp": {"tools": {"allow": ["echo"], "deny": []}}}
    sidecar = await sidecar_factory(compile_policy({"tools": spec}))
    headers = {"Accept": rpc.ACCEPT, "Content-Type": "application/json"}
    url = sidecar.url + "/mcp/tools"
    refused = {"jsonrpc": "2.0", "method": "tools/call", "params": {"name": "rm"}}
    async with sidecar.session.post(url, json=refused, headers=headers) as resp:
        # Not accepted: an HTTP error status (the MCP transport's rule for a
        # notification), the JSON-RPC error without an id in the body.
        assert resp.status == 403
        body = await resp.json()
    assert body["id"] is None
    assert body["error"]["code"] == rpc.EGRESS_ERROR
    assert body["error"]["data"]["egress_code"] == "PERMISSION_DENIED"
    assert up.hits == 0
    allowed = {"jsonrpc": "2.0", "method": "tools/call", "params": {"name": "echo"}}
    async with sidecar.session.post(url, json=allowed, headers=headers) as resp:
        assert resp.status == 202  # accepted: the server's 202, no body
        assert await resp.read() == b""
    request = {**refused, "id": 9}
    async with sidecar.session.post(url, json=request, headers=headers) as resp:
        assert resp.status == 200  # a request's refusal is its JSON-RPC answer
        assert (await resp.json())["id"] == 9
