"""Tool caps (docs/features/stopping.md): a budget's ``max_calls`` per window on the MCP
tools or endpoints its ``applies_to.tool`` glob names, counted before the call, in one
sidecar or across sidecars on the real Redis (no overshoot: admission is atomic), with
the refusal BUDGET_EXCEEDED naming the tool; shadow mode; validation of the keys."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.policy.loader import PolicyError, parse_policy
from tests.conftest import FakeUpstream, Sidecar, compile_policy, envelope, policy_yaml
from tests.mcp_server import McpTestServer, RunningServer
from tests.processes import ROOT
from tests.redis_fixtures import SHARED_URL, redis_prefix

__all__ = ["redis_prefix"]  # fixture, imported for pytest

Factory = Callable[..., Awaitable[Sidecar]]


def _items(url: str) -> dict[str, Any]:
    return {
        "base_url": url,
        "endpoints": [{"path": "/items/*", "methods": ["GET"]}],
        "retry": {"max_retries": 0},
    }


def _get(name: str) -> dict[str, Any]:
    env = envelope(target_system="items", endpoint=f"/items/{name}", method="GET")
    env.pop("api_key_ref")
    env["parameters"] = {}
    return env


def _cap(**overrides: Any) -> dict[str, Any]:
    cap: dict[str, Any] = {
        "max_calls": 5,
        "window": "daily",
        "applies_to": {"target": "items", "tool": "/items/search*"},
    }
    cap.update(overrides)
    return cap


async def test_two_sidecars_share_a_cap_without_overshoot(
    upstream: FakeUpstream, sidecar_factory: Factory, redis_prefix: str
) -> None:
    policy = compile_policy(
        {"items": _items(upstream.url)},
        redis={"url": SHARED_URL, "key_prefix": redis_prefix},
        budgets={"search-calls": _cap(scope="cluster")},
    )
    a, b = await sidecar_factory(policy), await sidecar_factory(policy)
    answers = await asyncio.gather(
        *(sc.call(_get(f"search-{n}")) for n in range(8) for sc in (a, b))
    )
    refused = [body for status, body in answers if status != 200]
    # Admission is atomic in Redis: no call beyond the cap goes out, however they interleave.
    assert upstream.hits == 5
    assert len(refused) == 11
    for body in refused:
        error = body["error"]
        assert (error["code"], error["retryable"]) == ("BUDGET_EXCEEDED", False)
        assert error["details"]["budget"] == "search-calls"
        assert error["details"]["tool"].startswith("/items/search-")
        assert error["details"]["max_calls"] == 5
        assert error["suggested_retry_after"] > 0
    # Other endpoints of the target are not capped.
    assert (await a.call(_get("other")))[0] == 200
    metrics = a.gateway.metrics.render(None)[0].decode()
    assert 'egress_gateway_budget_rejections_total{budget="search-calls"}' in metrics


async def test_shadow_cap_records_and_lets_the_calls_go(
    upstream: FakeUpstream, sidecar_factory: Factory
) -> None:
    policy = compile_policy(
        {"items": _items(upstream.url)},
        budgets={"search-calls": _cap(max_calls=1, mode="shadow")},
    )
    sc = await sidecar_factory(policy)
    for n in range(3):
        assert (await sc.call(_get(f"search-{n}")))[0] == 200
    assert upstream.hits == 3
    assert [r["decision"] for r in sc.audit_records()] == [
        "allowed",
        "shadow_denied",
        "shadow_denied",
    ]


@pytest.fixture(scope="module")
def mcp_server() -> Iterator[McpTestServer]:
    running = RunningServer(stateless=True, json_response=True)
    yield running.start()
    running.stop()


async def test_an_mcp_tool_cap_names_the_tool(
    sidecar_factory: Factory, mcp_server: McpTestServer
) -> None:
    policy = compile_policy(
        {"tools": {"base_url": mcp_server.url, "mcp": {"tools": {"allow": ["echo", "headers"]}}}},
        budgets={"echo-cap": _cap(max_calls=2, applies_to={"tool": "echo"})},
    )
    sc = await sidecar_factory(policy)
    headers = {"Accept": "application/json, text/event-stream"}

    async def rpc(n: int, method: str, params: Any = None) -> dict[str, Any]:
        body: dict[str, Any] = {"jsonrpc": "2.0", "id": n, "method": method}
        if params is not None:
            body["params"] = params
        async with sc.session.post(sc.url + "/mcp/tools", json=body, headers=headers) as resp:
            return json.loads(await resp.text())

    for n in range(3):  # protocol traffic is not a tool call
        assert "result" in await rpc(n, "tools/list")
    for n in range(2):
        assert "result" in await rpc(
            10 + n, "tools/call", {"name": "echo", "arguments": {"text": str(n)}}
        )
    refused = await rpc(20, "tools/call", {"name": "echo", "arguments": {"text": "3"}})
    data = refused["error"]["data"]
    assert (data["egress_code"], data["tool"], data["budget"]) == (
        "BUDGET_EXCEEDED",
        "echo",
        "echo-cap",
    )
    assert "result" in await rpc(21, "tools/call", {"name": "headers", "arguments": {}})


def test_a_budget_needs_a_limit_or_a_call_count() -> None:
    text = policy_yaml({}, budgets={"b": {"window": "daily"}})
    with pytest.raises(PolicyError) as caught:
        parse_policy(text, "p.yaml")
    assert "set 'limit_usd' (USD per window) or 'max_calls' (calls per window)" in str(caught.value)


def test_validate_warns_about_a_cap_that_matches_nothing(tmp_path: Path) -> None:
    text = policy_yaml(
        {"items": _items("https://api.example.com")},
        budgets={
            "typo": _cap(applies_to={"target": "items", "tool": "/itmes/*"}),
            "fine": _cap(),
        },
    )
    path = tmp_path / "p.yaml"
    path.write_text(text)
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "validate", "--no-env-check", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0
    assert done.stderr.splitlines() == [
        f"{path}: budgets.typo.applies_to.tool: warning: '/itmes/*' matches no endpoint of "
        "target 'items': it caps nothing"
    ]
