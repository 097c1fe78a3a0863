"""The console's sign-in and forms without a browser: no session, no page; a wrong token
is refused; a POST without the session's CSRF token or from another origin is refused
and changes nothing; answers carry a strict Content-Security-Policy; every value on the
page is escaped."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from gateway.console.page import desk_page
from gateway.console.server import create_console_app
from tests.conftest import FakeUpstream, Sidecar, compile_policy, envelope, openai_target
from tests.desk_helpers import TOKEN, Ops, ops_factory

__all__ = ["ops_factory"]  # a fixture, imported for pytest

Factory = Callable[..., Awaitable[Any]]
OPERATORS = {"alice": {"token_ref": "env://ALICE_TOKEN"}}


@pytest.fixture(autouse=True)
def _operator_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALICE_TOKEN", TOKEN)


@pytest.fixture
async def console_factory() -> AsyncIterator[Callable[[Ops], Awaitable[TestServer]]]:
    made: list[TestServer] = []

    async def make(ops: Ops) -> TestServer:
        server = TestServer(
            create_console_app(f"http://127.0.0.1:{ops.server.port}"), host="127.0.0.1"
        )
        await server.start_server()
        made.append(server)
        return server

    yield make
    for server in made:
        await server.close()


def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, html
    return found.group(1)


async def test_sign_in_csrf_and_origin(
    upstream: FakeUpstream, sidecar_factory: Factory, ops_factory: Factory, console_factory: Factory
) -> None:
    target = openai_target(
        upstream.url, approval={"endpoints": [{"path": "/v1/*", "methods": ["POST"]}]}
    )
    sc: Sidecar = await sidecar_factory(compile_policy({"t": target}, operators=OPERATORS))
    ops: Ops = await ops_factory(sc)
    console: TestServer = await console_factory(ops)
    base = f"http://127.0.0.1:{console.port}"
    _, answer = await sc.call(envelope(target_system="t", timeout=0.05))
    approval_id = answer["error"]["details"]["approval_id"]

    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as web:
        async with web.get(base + "/", allow_redirects=False) as resp:
            assert (resp.status, resp.headers["Location"]) == (303, "/login")
        async with web.get(base + "/login") as resp:
            login = await resp.text()
            assert "default-src 'none'" in resp.headers["Content-Security-Policy"]
        assert '<label for="token">' in login
        form = {"csrf": csrf_of(login), "token": "wrong"}
        async with web.post(base + "/login", data=form) as resp:
            assert resp.status == 401
            assert "operator token is wrong" in await resp.text()
            again = await resp.text()
        form = {"csrf": "made-up", "token": TOKEN}
        async with web.post(base + "/login", data=form) as resp:
            assert "form expired" in await resp.text()
        form = {"csrf": csrf_of(again), "token": TOKEN}
        async with web.post(base + "/login", data=form) as resp:
            assert resp.status == 200
            page = await resp.text()
        assert approval_id in page
        assert TOKEN not in page
        csrf = csrf_of(page)
        action = f"{base}/approvals/{approval_id}/approve"
        async with web.post(action, data={"csrf": "wrong"}, allow_redirects=False) as resp:
            assert resp.status == 403
        headers = {"Origin": "http://evil.example"}
        async with web.post(action, data={"csrf": csrf}, headers=headers) as resp:
            assert resp.status == 403
        state = (await sc.gateway.pipeline.approvals.store.get(approval_id) or {})["state"]
        assert state == "pending"  # nothing changed
        async with web.post(action, data={"csrf": csrf}) as resp:
            assert resp.status == 200
            assert "approved by alice" in await resp.text()
        async with web.post(base + "/logout", data={"csrf": csrf}, allow_redirects=False) as resp:
            assert resp.status == 303
        async with web.get(base + "/", allow_redirects=False) as resp:
            assert resp.status == 303


def test_every_value_on_the_page_is_escaped() -> None:
    evil = "<script>alert(1)</script>"
    data = {
        "overview": {
            "agent_id": evil,
            "operator": evil,
            "breakers": {evil: "open"},
            "budgets": [],
            "stops": None,
        },
        "approvals": [{"id": evil, "state": "pending", "arguments": {evil: evil}, "name": evil}],
        "dead_letters": [{"id": evil, "request": {"endpoint": evil}, "error": {"code": evil}}],
        "calls": {"calls": [{"trace_id": evil}]},
        "agent": evil,
        "trace": evil,
    }
    html = desk_page(data, csrf='"><x', flash=evil, error=True)
    assert "<script>alert" not in html
    assert '"><x' not in html
    assert html.count("<script") == 1  # the page's own /static/console.js
