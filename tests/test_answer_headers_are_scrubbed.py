"""An upstream that echoes the injected credential in its answer's headers (a debugging
endpoint, a proxy, an error page) never gets it to the agent: on every API (envelope,
drop-in, MCP) and every framing of the answer (JSON, an event stream relayed as it
arrives, chunked, binary), each header and each byte of the answer is scrubbed, in each
encoding the scrub knows (raw, percent-encoded, base64)."""

from __future__ import annotations

import base64
import json
from typing import Any
from urllib.parse import quote

import pytest
from aiohttp import web

from gateway.providers import mcp as rpc
from tests.conftest import compile_policy, envelope, openai_target
from tests.test_streams import CHAT_USAGE, chat, sse

#: A key with characters that percent-encoding changes, so that each form differs.
SECRET = "sk-fake/TEST+0001=NOT~REAL"
FORMS = {
    "raw": SECRET,
    "percent-encoded": quote(SECRET, safe=""),
    "base64": base64.b64encode(SECRET.encode()).decode(),
}
CREDENTIAL = {
    "header": "Authorization",
    "format": "Bearer {secret}",
    "default_ref": "env://TEST_OPENAI_KEY",
    "allowed_refs": ["env://TEST_OPENAI_KEY"],
}


def _echo_headers(request: web.Request) -> dict[str, str]:
    """The credential the upstream was sent, echoed back in each form."""
    seen = request.headers["Authorization"].removeprefix("Bearer ")
    assert seen == SECRET  # the sidecar did inject it
    return {
        "X-Debug-Authorization": request.headers["Authorization"],
        "X-Debug-Key-Url": quote(seen, safe=""),
        "X-Debug-Key-B64": base64.b64encode(seen.encode()).decode(),
        "Set-Cookie": f"debug={quote(seen, safe='')}; Path=/",
    }


def _frame(body: dict[str, Any]) -> str:
    params = body.get("params") or {}
    return str(body.get("frame") or (params.get("arguments") or {}).get("frame") or "json")


async def _upstream(request: web.Request) -> web.StreamResponse:
    body = json.loads(await request.read() or b"{}")
    frame = _frame(body)
    headers = _echo_headers(request)
    mcp = body.get("jsonrpc") == "2.0"
    result: Any = (
        {"jsonrpc": "2.0", "id": body.get("id"), "result": {"content": [], "echo": SECRET}}
        if mcp
        else {"id": "x", "choices": [], "echo": SECRET}
    )
    if frame == "json":
        return web.json_response(result, headers=headers)
    if frame == "binary":
        blob = b"\x00\xff" + SECRET.encode() + b"\x00"
        return web.Response(body=blob, content_type="application/octet-stream", headers=headers)
    if frame == "sse":
        if mcp:
            payload = b"event: message\ndata: " + json.dumps(result).encode() + b"\n\n"
        else:
            payload = sse(chat("Hi"), chat(SECRET, "stop"), CHAT_USAGE, "[DONE]")
        resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream"})
    else:  # chunked: no Content-Length, the body in two chunks
        payload = json.dumps(result).encode()
        resp = web.StreamResponse(headers={**headers, "Content-Type": "application/json"})
        resp.enable_chunked_encoding()
    await resp.prepare(request)
    half = len(payload) // 2
    await resp.write(payload[:half])
    await resp.write(payload[half:])
    await resp.write_eof()
    return resp


def _leaks(raw_headers: Any, body: bytes) -> list[str]:
    head = b"\n".join(name + b": " + value for name, value in raw_headers)
    return [
        f"{form} in {where}"
        for form, text in FORMS.items()
        for where, blob in (("headers", head), ("body", body))
        if text.encode() in blob
    ]


@pytest.fixture
async def sidecar(upstream_factory, sidecar_factory, monkeypatch):
    monkeypatch.setenv("TEST_OPENAI_KEY", SECRET)
    up = await upstream_factory(_upstream)
    chat_target = openai_target(up.url, credential=CREDENTIAL)
    chat_target["endpoints"] = [{"path": "/v1/chat/completions", "methods": ["POST"]}]
    mcp_target = {
        "base_url": up.url + "/mcp",
        "credential": CREDENTIAL,
        "mcp": {"tools": {"allow": ["echo"], "deny": []}},
    }
    return await sidecar_factory(compile_policy({"fake-openai": chat_target, "tools": mcp_target}))


FRAMES = ["json", "sse", "chunked", "binary"]


@pytest.mark.parametrize("frame", FRAMES)
async def test_drop_in_answers_are_scrubbed(sidecar, frame: str) -> None:
    body = {"model": "m", "messages": [], "stream": frame == "sse", "frame": frame}
    url = sidecar.url + "/proxy/fake-openai/v1/chat/completions"
    async with sidecar.session.post(url, json=body) as resp:
        raw = await resp.read()
        assert resp.status == 200, raw
        if frame == "sse":
            assert resp.content_type == "text/event-stream"
        assert "X-Debug-Key-B64" in resp.headers  # passed back, scrubbed
        assert _leaks(resp.raw_headers, raw) == []


@pytest.mark.parametrize("frame", ["json", "sse", "chunked"])
async def test_mcp_answers_are_scrubbed(sidecar, frame: str) -> None:
    call = {
        "jsonrpc": "2.0",
        "id": 3,
        "method": "tools/call",
        "params": {"name": "echo", "arguments": {"frame": frame}},
    }
    headers = {"Accept": rpc.ACCEPT, "Content-Type": "application/json"}
    async with sidecar.session.post(sidecar.url + "/mcp/tools", json=call, headers=headers) as resp:
        raw = await resp.read()
        assert resp.status == 200, raw
        assert b'"id": 3' in raw or b'"id":3' in raw
        assert "X-Debug-Key-B64" in resp.headers
        assert _leaks(resp.raw_headers, raw) == []


@pytest.mark.parametrize("frame", FRAMES)
@pytest.mark.parametrize("accept", ["application/json", "text/event-stream"])
async def test_envelope_answers_are_scrubbed(sidecar, frame: str, accept: str) -> None:
    params = {"model": "m", "messages": [], "stream": frame == "sse", "frame": frame}
    env = envelope(parameters=params)
    async with sidecar.session.post(
        sidecar.url + "/v1/calls", json=env, headers={"Accept": accept}
    ) as resp:
        raw = await resp.read()
        assert resp.status == 200, raw
        assert _leaks(resp.raw_headers, raw) == []
