"""Whoever reaches the console's port can ask for its sign-in form without a token; the
forms' CSRF tokens it keeps are bounded (the oldest forgotten first), so a flood of
requests cannot grow its memory, and the newest forms still sign in."""

from __future__ import annotations

import re

import aiohttp
from aiohttp.test_utils import TestServer

from gateway.console import server as console_server


async def test_sign_in_forms_kept_are_bounded() -> None:
    app = console_server.create_console_app("http://127.0.0.1:9")  # no sidecar needed
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        console = app[console_server._CONSOLE]
        limit = console_server.MAX_LOGIN_FORMS
        first = last = ""
        async with aiohttp.ClientSession() as web:
            for n in range(limit + 50):
                async with web.get(f"http://127.0.0.1:{server.port}/login") as resp:
                    assert resp.status == 200
                    found = re.search(r'name="csrf" value="([^"]+)"', await resp.text())
                    assert found is not None
                    first, last = (found.group(1) if n == 0 else first), found.group(1)
        assert len(console.login_csrf) <= limit
        assert last in console.login_csrf
        assert first not in console.login_csrf  # the oldest went first
    finally:
        await server.close()
