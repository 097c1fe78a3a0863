"""The drop-in route's resource (gateway.api.http.TargetRoute, a prefix and one split)
matches exactly what aiohttp's own route ``/proxy/{target}/{path:.*}`` matches, with the
same ``target`` and ``path``: two servers on loopback, one with each, asked the same raw
request lines; and the same with shortcuts (the route indexed under whole paths for
aiohttp's router: some of the paths asked, their parents, a path never asked)."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from gateway.api.http import TargetRoute

#: Raw request targets: matches, near misses, escapes, odd characters.
PATHS = (
    "/proxy/openai/v1/chat/completions",
    "/proxy/openai/",
    "/proxy/openai",
    "/proxy/",
    "/proxy",
    "/proxy//v1",
    "/proxy/a/b/c?x=1&y=%2F",
    "/proxy/open%2Fai/v1/x%2Fy",
    "/proxy/open%25ai/v1/a%25b%2525",
    "/proxy/op%7Ben/v1",
    "/proxy/op%7Den/v1",
    "/proxy/open/v1%0Ax",
    "/proxy/op%0Aen/v1",
    "/proxy/%C3%A9t%C3%A9/v1/%C3%A9",
    "/proxy/openai/v1/%3Ffoo%23bar",
    "/proxy/a/%2e%2e/b",
    "/proxy/a/../b",
    "/proxyx/a/b",
    "/other/a/b",
    "/proxy/a//b/",
    "/proxy/a/%2F",
)


async def _echo(request: web.Request) -> web.Response:
    return web.json_response(dict(request.match_info))


async def _serve(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]  # the port the OS gave


async def _ask(port: int, target: str, method: str) -> tuple[int, object]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    answer = await reader.read()
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body) if status == 200 else None


#: Shortcuts: paths asked (with and without a query), a parent of one, a path no request
#: names, and ones the router could not look up as written (left out).
SHORTCUTS = (
    "/proxy/openai/v1/chat/completions",
    "/proxy/a/b/c",
    "/proxy/a/b",
    "/proxy/openai/v1",
    "/proxy/other/v1/messages",
    "/proxy/open%2Fai/v1/x%2Fy",
    "/proxy/a//b/",
    "/other/a/b",
)


@pytest.mark.parametrize("shortcuts", [(), SHORTCUTS], ids=["plain", "shortcuts"])
@pytest.mark.parametrize("method", ["POST", "GET", "DELETE"])
async def test_the_prefix_route_matches_as_the_pattern_route(
    method: str, shortcuts: tuple[str, ...]
) -> None:
    ours = web.Application()
    TargetRoute("/proxy", _echo).register(ours.router, shortcuts)
    # Indexed: the route and one shortcut per path the router can look up as written.
    assert len(ours.router.resources()) == 1 + (5 if shortcuts else 0)
    theirs = web.Application()
    theirs.router.add_route("*", "/proxy/{target}/{path:.*}", _echo)
    runners = []
    try:
        ours_runner, ours_port = await _serve(ours)
        runners.append(ours_runner)
        theirs_runner, theirs_port = await _serve(theirs)
        runners.append(theirs_runner)
        matched = 0
        for path in PATHS:
            expected = await _ask(theirs_port, path, method)
            assert await _ask(ours_port, path, method) == expected, path
            matched += expected[0] == 200
        assert matched >= 10  # the list holds matches, not only misses
    finally:
        for runner in runners:
            await runner.cleanup()
