"""Operators list, show and decide approval requests on the ops listener with their
token: the exact arguments are shown, a decision is taken once, unknown and expired ids
and wrong tokens are refused, and only the named approvers may decide."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from tests.conftest import FakeUpstream, Sidecar, compile_policy, envelope, openai_target
from tests.desk_helpers import TOKEN, Ops, ops_factory

__all__ = ["ops_factory"]  # a fixture, imported for pytest

Factory = Callable[..., Awaitable[Any]]
OPERATORS = {
    "alice": {"token_ref": "env://ALICE_TOKEN"},
    "bob": {"token_ref": "env://BOB_TOKEN"},
}
BOB = "op-token-BOB-0002"


@pytest.fixture(autouse=True)
def _operator_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALICE_TOKEN", TOKEN)
    monkeypatch.setenv("BOB_TOKEN", BOB)


def held(url: str, ttl_s: float = 900) -> Any:
    approval = {
        "endpoints": [{"path": "/v1/chat/*", "methods": ["POST"]}],
        "approvers": ["alice"],
        "ttl_s": ttl_s,
    }
    return compile_policy(
        {"fake-openai": openai_target(url, approval=approval)}, operators=OPERATORS
    )


async def test_list_show_approve_and_bad_input(
    upstream: FakeUpstream, sidecar_factory: Factory, ops_factory: Factory
) -> None:
    sc: Sidecar = await sidecar_factory(held(upstream.url))
    ops: Ops = await ops_factory(sc)
    env = envelope(timeout=0.05)
    status, answer = await sc.call(env)
    approval_id = answer["error"]["details"]["approval_id"]

    status, listed = await ops("GET", "/v1/approvals?state=pending")
    assert status == 200
    [shown] = listed["approvals"]
    assert shown["id"] == approval_id
    assert shown["arguments"]["parameters"] == env["parameters"]  # exactly what would run
    assert (shown["target"], shown["name"], shown["method"]) == (
        "fake-openai", "/v1/chat/completions", "POST",
    )  # fmt: skip
    assert (shown["agent"], shown["trace"], shown["approvers"]) == (
        "test-agent", "tr-test-0001", ["alice"],
    )  # fmt: skip
    status, one = await ops("GET", f"/v1/approvals/{approval_id}")
    assert (status, one["state"]) == (200, "pending")

    assert (await ops("GET", "/v1/approvals", token=None))[0] == 401
    assert (await ops("POST", f"/v1/approvals/{approval_id}/approve", token="nope"))[0] == 401
    status, refused = await ops("POST", f"/v1/approvals/{approval_id}/approve", token=BOB)
    assert (status, refused["error"]["details"]["reason"]) == (403, "not_an_approver")
    status, decided = await ops("POST", f"/v1/approvals/{approval_id}/approve")
    assert (status, decided["state"], decided["decided_by"]) == (200, "approved", "alice")
    status, twice = await ops("POST", f"/v1/approvals/{approval_id}/deny")
    assert (status, twice["error"]["details"]["reason"]) == (409, "already_decided")
    status, unknown = await ops("POST", "/v1/approvals/apr_0000/approve")
    assert (status, unknown["error"]["details"]["reason"]) == (404, "unknown_approval")
    assert (await ops("GET", "/v1/approvals/apr_0000"))[0] == 404
    assert upstream.hits == 0  # deciding sends nothing; the call does
    status, answer = await sc.call(env)
    assert (status, upstream.hits) == (200, 1)
    status, one = await ops("GET", f"/v1/approvals/{approval_id}")
    assert one["state"] == "used"


async def test_a_decision_after_expiry_is_refused(
    upstream: FakeUpstream, sidecar_factory: Factory, ops_factory: Factory
) -> None:
    sc: Sidecar = await sidecar_factory(held(upstream.url, ttl_s=0.05))
    ops: Ops = await ops_factory(sc)
    status, answer = await sc.call(envelope(timeout=0.01))
    approval_id = answer["error"]["details"]["approval_id"]
    for _ in range(1000):  # bounded: the request's ttl_s is 50 ms
        status, one = await ops("GET", f"/v1/approvals/{approval_id}")
        if one["state"] == "expired":
            break
        await asyncio.sleep(0.01)
    assert one["state"] == "expired"
    status, late = await ops("POST", f"/v1/approvals/{approval_id}/approve")
    assert (status, late["error"]["details"]["reason"]) == (410, "approval_expired")
    assert upstream.hits == 0


async def test_the_stop_switch_token_is_an_operator_and_stops_are_shown(
    upstream: FakeUpstream, sidecar_factory: Factory, ops_factory: Factory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("SHARED_OPS_TOKEN", TOKEN)
    approval = {"endpoints": [{"path": "/v1/*", "methods": ["POST"]}]}
    policy = compile_policy(
        {"fake-openai": openai_target(upstream.url, approval=approval)},
        controls={"operator_token_ref": "env://SHARED_OPS_TOKEN"},
    )  # no operators: section; the stop switch's token decides
    sc: Sidecar = await sidecar_factory(policy)
    ops: Ops = await ops_factory(sc)
    _, answer = await sc.call(envelope(timeout=0.05))
    approval_id = answer["error"]["details"]["approval_id"]
    status, decided = await ops("POST", f"/v1/approvals/{approval_id}/approve")
    assert (status, decided["decided_by"]) == (200, "operator")
    status, overview = await ops("GET", "/v1/desk/overview")
    assert (status, overview["stops"]) == (200, [])
    stop = {"scope": "agent", "name": "test-agent", "reason": "looping", "by": "alice"}
    url = f"http://127.0.0.1:{ops.server.port}/v1/controls/stop"
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with ops.session.post(url, json=stop, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
    status, overview = await ops("GET", "/v1/desk/overview")
    [shown] = overview["stops"]
    assert (shown["scope"], shown["name"], shown["reason"]) == ("agent", "test-agent", "looping")
