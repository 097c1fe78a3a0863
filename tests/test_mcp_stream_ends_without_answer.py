"""An MCP server's event stream that ends without the answer to a pending request, however
it ends (cleanly after progress events, after bytes that are not SSE, with nothing at
all), leaves no request unanswered: each one still pending gets a JSON-RPC error
(``data.egress_code: STREAM_INTERRUPTED``) and a failed audit record, on the MCP route
and for an envelope alike; bytes that are not SSE are not relayed as events."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp import web

from gateway.providers import mcp as rpc
from tests.conftest import compile_policy

PROGRESS = {
    "jsonrpc": "2.0",
    "method": "notifications/progress",
    "params": {"progressToken": "p1", "progress": 1, "total": 3},
}
JUNK = b"<html><body>502 Bad Gateway</body></html>"


def _event(message: Any) -> bytes:
    return b"event: message\ndata: " + json.dumps(message).encode() + b"\n\n"


def _answer(request_id: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "result": {"content": [], "isError": False}}


# How the stream ends: the pieces the server sends before closing it cleanly.
ENDINGS = {
    "clean-after-progress": [_event(PROGRESS)],
    "after-non-sse-bytes": [_event(PROGRESS), JUNK + b"\n\n", b"trailing junk, no blank line"],
    "non-sse-bytes-only": [JUNK],
    "nothing": [],
    "after-another-answer": [_event(_answer(8))],
}


def _server(pieces: list[bytes]):
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for piece in pieces:
            await resp.write(piece)
        await resp.write_eof()
        return resp

    return handler


def _call(request_id: int) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "id": request_id,
        "method": "tools/call",
        "params": {"name": "echo", "arguments": {}, "_meta": {"progressToken": "p1"}},
    }


async def _sidecar(upstream_factory, sidecar_factory, pieces: list[bytes]):
    up = await upstream_factory(_server(pieces))
    spec = {"base_url": up.url + "/mcp", "mcp": {"tools": {"allow": ["echo"], "deny": []}}}
    return await sidecar_factory(compile_policy({"tools": spec}))


def _messages(content_type: str, raw: bytes) -> list[Any]:
    if content_type == "application/json":
        value = json.loads(raw)
        return value if isinstance(value, list) else [value]
    out = []
    for block in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        data = [ln[5:].strip() for ln in block.split(b"\n") if ln.startswith(b"data:")]
        if data:
            out.append(json.loads(b"\n".join(data)))
    return out


@pytest.mark.parametrize("ending", list(ENDINGS))
async def test_every_pending_request_gets_an_error_when_the_stream_ends(
    upstream_factory, sidecar_factory, ending: str
) -> None:
    sidecar = await _sidecar(upstream_factory, sidecar_factory, ENDINGS[ending])
    batch = ending == "after-another-answer"  # one request answered, the other not
    body: Any = [_call(8), _call(7)] if batch else _call(7)
    headers = {"Accept": rpc.ACCEPT, "Content-Type": "application/json"}
    async with sidecar.session.post(sidecar.url + "/mcp/tools", json=body, headers=headers) as resp:
        raw = await resp.read()
        assert resp.status == 200, raw
        content_type = resp.content_type
    assert JUNK not in raw
    assert b"trailing junk" not in raw
    messages = _messages(content_type, raw)  # every event parses as JSON-RPC
    errors = {m["id"]: m["error"] for m in messages if "error" in m}
    assert set(errors) == {7}, raw
    assert errors[7]["code"] == rpc.EGRESS_ERROR
    assert errors[7]["data"]["egress_code"] == "STREAM_INTERRUPTED"
    records = {r["mcp_request_id"]: r for r in sidecar.audit_records()}
    assert records["7"]["success"] is False
    assert records["7"]["error_code"] == "STREAM_INTERRUPTED"
    if batch:
        assert [m["id"] for m in messages if "result" in m] == [8]


async def test_an_envelope_whose_stream_ends_without_the_answer_fails(
    upstream_factory, sidecar_factory
) -> None:
    sidecar = await _sidecar(upstream_factory, sidecar_factory, [_event(PROGRESS)])
    envelope = {
        "trace_id": "tr-mcp-end",
        "correlation_id": "c-end",
        "target_system": "tools",
        "endpoint": "/mcp",
        "method": "POST",
        "parameters": _call(7),
    }
    status, answer = await sidecar.call(envelope)
    assert answer["success"] is False, answer
    assert answer["error"]["code"] == "STREAM_INTERRUPTED"
    assert status == 502
    [record] = sidecar.audit_records()
    assert (record["success"], record["error_code"]) == (False, "STREAM_INTERRUPTED")


async def test_a_stream_with_every_answer_still_succeeds(upstream_factory, sidecar_factory):
    bom = "\ufeff".encode()  # a stream may start with a byte order mark
    pieces = [bom + _event(PROGRESS), b": keep-alive\n\n", b"retry: 10\n\n", _event(_answer(7))]
    sidecar = await _sidecar(upstream_factory, sidecar_factory, pieces)
    headers = {"Accept": rpc.ACCEPT, "Content-Type": "application/json"}
    url = sidecar.url + "/mcp/tools"
    async with sidecar.session.post(url, json=_call(7), headers=headers) as resp:
        raw = await resp.read()
    assert raw == b"".join(pieces)  # relayed as sent, comments included
    [record] = sidecar.audit_records()
    assert record["success"] is True
