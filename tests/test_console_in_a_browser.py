"""The operator's console in a real browser (Debian's chromium through chromium-driver,
driven by Selenium): sign in with the token, see a tool call of the real MCP SDK held
for approval with its exact arguments, approve it and see the call complete and its
record appear; deny another (the SDK gets APPROVAL_DENIED); replay a dead letter and see
the upstream get it once. ``UPDATE_SCREENSHOTS=1`` copies its screenshots to docs/img/
(the README's).

Selenium's calls block, so they run in a thread while the sidecar, its ops listener and
the console serve on the test's event loop.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx2
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from gateway.console.server import create_console_app
from tests.conftest import FakeUpstream, Sidecar, compile_policy, envelope, openai_target
from tests.desk_helpers import TOKEN, Ops, ops_factory
from tests.mcp_server import McpTestServer, RunningServer

__all__ = ["ops_factory"]  # a fixture, imported for pytest

Factory = Callable[..., Awaitable[Any]]
ROOT = Path(__file__).resolve().parent.parent
SHOTS = ROOT / "docs" / "img"
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
    "--window-size=1500,1000", "--disable-dev-shm-usage",
)  # fmt: skip
webdriver = pytest.importorskip("selenium.webdriver")
By = pytest.importorskip("selenium.webdriver.common.by").By


def _browser_or_skip() -> tuple[str, str]:
    chromium = shutil.which("chromium")
    driver = shutil.which("chromedriver")
    if chromium is None or driver is None:
        if os.environ.get("REQUIRE_BROWSER") == "1":
            pytest.fail("chromium and chromium-driver are required (REQUIRE_BROWSER=1)")
        pytest.skip("Debian's chromium and chromium-driver are not installed")
    return chromium, driver


@pytest.fixture
def browser() -> Iterator[Any]:
    chromium, driver = _browser_or_skip()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    service = webdriver.ChromeService(executable_path=driver)
    chrome = webdriver.Chrome(options=options, service=service)
    yield chrome
    chrome.quit()


@pytest.fixture(scope="module")
def mcp_server() -> Iterator[McpTestServer]:
    running = RunningServer()
    yield running.start()
    running.stop()


@pytest.fixture(autouse=True)
def _tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALICE_TOKEN", TOKEN)
    monkeypatch.setenv("TEST_MCP_TOKEN", "mcp-fake-TEST-0007-NOTREAL")


@asynccontextmanager
async def mcp_client(url: str) -> AsyncIterator[ClientSession]:
    async with (
        httpx2.AsyncClient(timeout=60) as http,
        streamable_http_client(url, http_client=http) as (read, write),
        ClientSession(read, write) as client,
    ):
        await client.initialize()
        yield client


def policy(mcp_url: str, orders_url: str, audit_path: Path) -> Any:
    tools = {
        "base_url": mcp_url,
        "credential": {"header": "Authorization", "format": "Bearer {secret}",
                       "default_ref": "env://TEST_MCP_TOKEN"},
        "mcp": {"tools": {"allow": ["echo", "create_issue"], "deny": []}},
        "approval": {"tools": ["create_issue"], "approvers": ["alice"], "ttl_s": 600},
    }  # fmt: skip
    orders = openai_target(
        orders_url, dead_letter=True, idempotency={"methods": ["POST"]},
        retry={"max_retries": 0},
    )  # fmt: skip
    return compile_policy(
        {"tools": tools, "orders": orders},
        operators={"alice": {"token_ref": "env://ALICE_TOKEN"}},
        audit={"sink": "file", "path": str(audit_path)},
        budgets={"daily": {"limit_usd": 5, "window": "daily", "max_output_tokens": 1000}},
        prices={"fake-model-1": {"input_usd_per_mtok": 1, "output_usd_per_mtok": 2}},
    )


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    for _ in range(2000):  # bounded: each check is one loopback request
        if await check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def test_an_operator_approves_denies_and_replays_in_the_browser(
    browser: Any,
    mcp_server: McpTestServer,
    upstream_factory: Factory,
    sidecar_factory: Factory,
    ops_factory: Factory,
    tmp_path: Path,
) -> None:
    orders_down = True

    async def orders(_: web.Request) -> web.StreamResponse:
        return web.json_response({"ok": not orders_down}, status=503 if orders_down else 200)

    upstream: FakeUpstream = await upstream_factory(orders)
    sc: Sidecar = await sidecar_factory(policy(mcp_server.url, upstream.url, tmp_path / "a.log"))
    ops: Ops = await ops_factory(sc)
    console = TestServer(create_console_app(f"http://127.0.0.1:{ops.server.port}"))
    await console.start_server()
    base = f"http://127.0.0.1:{console.port}"
    store = sc.gateway.pipeline.approvals.store
    before = len(mcp_server.side_effects)

    async def pending() -> list[dict[str, str]]:
        return [r for r in await store.recent(20) if r["state"] == "pending"]

    async def run(fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    try:
        async with mcp_client(sc.url + "/mcp/tools") as client:
            args = {"repo": "acme/web", "title": "approve me"}
            held = asyncio.create_task(client.call_tool("create_issue", args))
            await until(lambda: _truthy(pending()), "the call is held")
            assert len(mcp_server.side_effects) == before  # held: not run

            # Sign in: the token field is labelled and reached by the keyboard.
            await run(browser.get, base + "/")
            assert "Sign in" in browser.title
            label = await run(browser.find_element, By.CSS_SELECTOR, 'label[for="token"]')
            assert label.text == "Operator token"
            field = await run(browser.find_element, By.ID, "token")
            await run(field.send_keys, TOKEN + "\n")
            await until(lambda: _done(run, browser, "Approvals"), "the desk page")
            [request] = await pending()
            row = await run(browser.find_element, By.ID, request["id"])
            assert '"title": "approve me"' in row.text  # the exact arguments
            assert "create_issue" in row.text
            await run(screenshot, browser, tmp_path, "console-approvals.png")
            approve = await run(
                row.find_element, By.CSS_SELECTOR, f'button[aria-label="Approve {request["id"]}"]'
            )
            await run(approve.click)
            result = await asyncio.wait_for(held, 30)
            assert result.content[0].text == "created in acme/web"
            assert mcp_server.side_effects[before:] == ["create_issue acme/web approve me"]
            await run(wait_for_text, browser, f"{request['id']}: approved by alice")

            # The record appears among the agent's recent calls.
            await run(browser.get, base + "/?agent=test-agent#calls")
            calls = await run(browser.find_element, By.ID, "calls")
            assert "create_issue" in calls.text

            # Deny another: the SDK's call fails with APPROVAL_DENIED, nothing runs.
            refused = asyncio.create_task(
                client.call_tool("create_issue", {"repo": "acme/web", "title": "deny me"})
            )
            await until(lambda: _truthy(pending()), "the second call is held")
            [second] = await pending()
            await run(browser.get, base + "/")
            deny = await run(
                browser.find_element, By.CSS_SELECTOR, f'button[aria-label="Deny {second["id"]}"]'
            )
            await run(deny.click)
            await run(wait_for_text, browser, f"{second['id']}: denied by alice")
            with pytest.raises(MCPError) as denied:
                await asyncio.wait_for(refused, 30)
            assert denied.value.error.data["egress_code"] == "APPROVAL_DENIED"
            assert len(mcp_server.side_effects) == before + 1

        # A dead letter, replayed from the page: the upstream gets it once more.
        status, answer = await sc.call(envelope(target_system="orders", max_retries=0))
        assert status == 502, answer
        hits = upstream.hits
        orders_down = False
        [letter] = sc.gateway.pipeline.dead_letters.list()
        await run(browser.get, base + "/#h-letters")
        await run(screenshot, browser, tmp_path, "console-dead-letters.png")
        replay = await run(
            browser.find_element, By.CSS_SELECTOR, f'button[aria-label="Replay {letter.id}"]'
        )
        await run(replay.click)
        text = await run(wait_for_text, browser, f"{letter.id} replayed: HTTP 200, succeeded")
        assert upstream.hits == hits + 1
        assert upstream.seen[-1].headers["Idempotency-Key"] == letter.idempotency_key
        assert "No dead letters." in text
    finally:
        await console.close()


def screenshot(browser: Any, tmp_path: Path, name: str) -> None:
    """A PNG of the page; copied to docs/img/ (the README's) with UPDATE_SCREENSHOTS=1."""
    shot = tmp_path / name
    assert browser.save_screenshot(str(shot))
    assert shot.read_bytes().startswith(b"\x89PNG")
    if os.environ.get("UPDATE_SCREENSHOTS") == "1":
        shutil.copyfile(shot, SHOTS / name)


def wait_for_text(browser: Any, expected: str) -> str:
    """The page's text once it holds ``expected`` (after a form's redirect), bounded."""
    errors = pytest.importorskip("selenium.common.exceptions")
    # Mid-redirect the old body is stale, or the new document has no body yet (seen with
    # two pytest-xdist workers on 2 cores): both are "not yet", like text without expected.
    gone = (errors.StaleElementReferenceException, errors.NoSuchElementException)
    text = ""
    for _ in range(500):  # bounded: the form posts to loopback
        try:
            text = browser.find_element(By.TAG_NAME, "body").text
        except gone:
            text = ""
        if expected in text:
            return str(text)
        time.sleep(0.01)
    raise AssertionError(f"{expected!r} never appeared; the page says: {text[:500]}")


async def _truthy(value: Awaitable[Any]) -> bool:
    return bool(await value)


async def _done(run: Callable[..., Awaitable[Any]], browser: Any, title: str) -> bool:
    heading = await run(browser.find_elements, By.ID, "h-approvals")
    return bool(heading) and title in heading[0].text
