"""A ``tools/list`` answer is filtered wherever it arrives.

Not only as the answer to the POST that asked for it: on a resumed GET stream, and in an
event whose data starts with spaces, the listing the agent gets names only the tools the
policy allows. A recording loopback upstream gives the exact answers.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from gateway.providers import mcp as rpc
from tests.conftest import FakeUpstream, Sidecar, compile_policy

Factory = Callable[..., Awaitable[Any]]


HEADERS = {"Content-Type": "application/json", "Accept": rpc.ACCEPT}


def policy_for(url: str) -> Any:
    return compile_policy(
        {
            "tools": {
                "base_url": url,
                "mcp": {
                    "tools": {"allow": ["echo", "create_issue", "delete_*"], "deny": ["delete_*"]},
                    "arguments": {"create_issue": {"repo": {"pattern": "acme/[a-z-]+"}}},
                },
            }
        }
    )


LISTING = {
    "jsonrpc": "2.0",
    "id": "L",
    "result": {"tools": [{"name": "echo"}, {"name": "delete_repo"}], "nextCursor": "c2"},
}


async def test_a_listing_on_a_resumed_get_stream_is_filtered(
    upstream_factory: Factory, sidecar_factory: Factory
) -> None:
    """MCP 2025-11-25 "Resumability": a client whose POST stream broke GETs with
    ``Last-Event-ID`` and the server replays the stream's events there, the tools/list
    result included; it must be filtered like the POST's answer."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"id: e1\nevent: message\ndata: " + json.dumps(LISTING).encode() + b"\n\n")
        await resp.write_eof()
        return resp

    upstream: FakeUpstream = await upstream_factory(handler)
    sidecar: Sidecar = await sidecar_factory(policy_for(upstream.url + "/mcp"))
    async with sidecar.session.get(
        sidecar.url + "/mcp/tools",
        headers={"Accept": "text/event-stream", "Last-Event-ID": "e0", "Mcp-Session-Id": "s"},
    ) as resp:
        text = (await resp.read()).decode()
    assert upstream.seen[-1].headers["Last-Event-ID"] == "e0"
    assert text.startswith("id: e1\nevent: message\ndata: ")
    listed = json.loads(text.split("data: ", 1)[1])
    assert [t["name"] for t in listed["result"]["tools"]] == ["echo"]
    assert listed["result"]["nextCursor"] == "c2"


async def test_a_listing_whose_event_data_starts_with_spaces_is_filtered(
    upstream_factory: Factory, sidecar_factory: Factory
) -> None:
    """SSE strips one space after ``data:``; JSON allows more before the value, and the
    SDK's client reads them."""

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"event: message\ndata:   " + json.dumps(LISTING).encode() + b"\n\n")
        await resp.write_eof()
        return resp

    upstream: FakeUpstream = await upstream_factory(handler)
    sidecar: Sidecar = await sidecar_factory(policy_for(upstream.url + "/mcp"))
    body = json.dumps({"jsonrpc": "2.0", "id": "L", "method": "tools/list"}).encode()
    async with sidecar.session.post(sidecar.url + "/mcp/tools", data=body, headers=HEADERS) as r:
        text = (await r.read()).decode()
    listed = json.loads(text.split("data:", 1)[1])
    assert [t["name"] for t in listed["result"]["tools"]] == ["echo"]
