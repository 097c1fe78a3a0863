"""Every API's answers pass through the one answer writer (gateway.api.http): a secret
that an upstream plants in its answer, in a header or anywhere in the body (JSON, an
event stream, a chunked body, binary), never reaches the agent, whichever API it called
through (envelope, streamed envelope, drop-in route, MCP route)."""

from __future__ import annotations

import base64
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from gateway.providers import mcp as rpc
from tests.conftest import FakeUpstream, Sidecar, compile_policy, envelope

Factory = Callable[..., Awaitable[Any]]
CANARY = "canary-ANSWER-5e2d9a41-NOT-REAL"
MODES = ("json", "sse", "chunked", "binary")
CALL = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "echo"}}
CREDENTIAL = {
    "header": "Authorization",
    "format": "Bearer {secret}",
    "default_ref": "env://ANSWER_CANARY",
}


def _pieces(secret: str, size: int = 12) -> list[bytes]:
    return [secret[i : i + size].encode() for i in range(len(secret) - size + 1)]


async def _planting(request: web.Request) -> web.StreamResponse:
    """Answers with the credential it was sent planted in a header and in the body, the
    body's copy cut in two writes where the mode streams."""
    secret = request.headers["Authorization"].removeprefix("Bearer ").encode()
    headers = {"X-Echo": f"you sent {secret.decode()}", "Set-Cookie": f"k={secret.decode()}"}
    mode = request.path.rsplit("/", 1)[-1]
    message = {"jsonrpc": "2.0", "id": 7, "result": {"content": [{"type": "text", "text": "@"}]}}
    before, after = json.dumps(message).encode().split(b"@")
    half = len(secret) // 2
    if mode == "binary":
        body = b"\x00\xff" + secret + b"\x00\x80"
        return web.Response(body=body, content_type="application/octet-stream", headers=headers)
    if mode == "json":
        return web.Response(
            body=before + secret + after, headers=headers, content_type="application/json"
        )
    content_type = "text/event-stream" if mode == "sse" else "application/json"
    response = web.StreamResponse(headers={**headers, "Content-Type": content_type})
    response.enable_chunked_encoding()
    await response.prepare(request)
    lead = b"event: message\ndata: " if mode == "sse" else b""
    await response.write(lead + before + secret[:half])
    await response.write(secret[half:] + after + (b"\n\n" if mode == "sse" else b""))
    await response.write_eof()
    return response


async def _send(sidecar: Sidecar, api: str, mode: str) -> tuple[int, bytes, bytes]:
    """``(status, head, body)`` of one call of ``mode`` through ``api``, as the agent got
    them: every header line and every body byte."""
    url, headers, body = sidecar.url, {"Content-Type": "application/json"}, CALL
    if api.startswith("envelope"):
        url += "/v1/calls"
        body = envelope(
            target_system="plant",
            endpoint=f"/v1/{mode}",
            parameters=CALL,
            api_key_ref=...,
            max_retries=0,
        )
        if api == "envelope-stream":
            headers["Accept"] = "text/event-stream"
    elif api == "proxy":
        url += f"/proxy/plant/v1/{mode}"
    else:
        url += f"/mcp/mcp-{mode}"
        headers["Accept"] = rpc.ACCEPT
    async with sidecar.session.post(url, data=json.dumps(body), headers=headers) as resp:
        head = b"\r\n".join(name + b": " + value for name, value in resp.raw_headers)
        return resp.status, head, await resp.read()


def _unwrapped(body: bytes) -> bytes:
    """``body`` and, for an envelope answer of bytes, the bytes its ``data`` holds."""
    try:
        data = json.loads(body).get("data")
    except ValueError:
        return body
    if isinstance(data, dict) and "base64" in data:
        return body + base64.b64decode(data["base64"].replace("[REDACTED]", ""), validate=False)
    return body


@pytest.mark.parametrize("api", ["envelope", "envelope-stream", "proxy", "mcp"])
async def test_a_secret_planted_in_an_answer_never_reaches_the_agent(
    api: str, upstream_factory: Factory, sidecar_factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANSWER_CANARY", CANARY)
    upstream: FakeUpstream = await upstream_factory(_planting)
    targets: dict[str, Any] = {
        "plant": {
            "base_url": upstream.url,
            "endpoints": [{"path": "/v1/*", "methods": ["POST"]}],
            "credential": CREDENTIAL,
        }
    }
    for mode in MODES:
        targets[f"mcp-{mode}"] = {
            "base_url": f"{upstream.url}/mcp/{mode}",
            "mcp": {"tools": {"allow": ["echo"], "deny": []}},
            "credential": CREDENTIAL,
        }
    sidecar: Sidecar = await sidecar_factory(compile_policy(targets))

    for mode in MODES:
        status, head, body = await _send(sidecar, api, mode)
        assert status == 200, (mode, body[:300])
        seen = head + b"\r\n\r\n" + _unwrapped(body)
        for piece in _pieces(CANARY):
            assert piece not in seen, (mode, piece, seen[:600])
        # Scrubbed, not merely absent: the upstream's copies were there to be redacted.
        assert b"[REDACTED]" in body, (mode, body[:300])
        if api in ("proxy", "mcp"):  # the upstream's headers are passed back, scrubbed
            assert b"X-Echo: you sent [REDACTED]" in head, (mode, head)
    # The canary really was the credential on the wire, once per call.
    assert [s.headers["Authorization"] for s in upstream.seen] == [f"Bearer {CANARY}"] * 4
