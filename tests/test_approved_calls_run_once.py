"""Calls a target's ``approval:`` names wait for a person's yes: held until decided or
APPROVAL_PENDING at their deadline (nothing sent), approved ones run exactly once,
denied ones get APPROVAL_DENIED, changed arguments are another request, approvals
expire; every request and decision is an audit event."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gateway.agents.approvals import (
    MAX_REOPENS,
    Approvals,
    MemoryApprovalStore,
    effective_state,
    held_call,
)
from gateway.envelope import ExternalCallRequest
from gateway.errors import ApprovalDenied, ApprovalPending, InvalidPayload, PermissionDenied
from gateway.policy.desk import ApprovalSpec
from tests.conftest import FakeUpstream, Sidecar, compile_policy, envelope, openai_target

Factory = Callable[..., Awaitable[Any]]
OPERATORS = {"alice": {"token_ref": "env://ALICE_TOKEN"}, "bob": {"token_ref": "env://BOB_TOKEN"}}


def held_target(url: str, **approval: Any) -> dict[str, Any]:
    spec = {"endpoints": [{"path": "/v1/chat/*", "methods": ["POST"]}], **approval}
    return openai_target(url, approval=spec)


async def pending_id(sc: Sidecar, env: dict[str, Any]) -> str:
    status, answer = await sc.call(env)
    assert status == 428, answer
    error = answer["error"]
    assert (error["code"], error["retryable"], error["suggested_retry_after"]) == (
        "APPROVAL_PENDING",
        True,
        5.0,
    )
    return str(error["details"]["approval_id"])


async def test_an_approved_call_runs_once_and_a_second_send_asks_again(
    upstream: FakeUpstream, sidecar_factory: Factory
) -> None:
    policy = compile_policy({"fake-openai": held_target(upstream.url)}, operators=OPERATORS)
    sc: Sidecar = await sidecar_factory(policy)
    env = envelope(timeout=0.05)
    approval_id = await pending_id(sc, env)
    assert upstream.hits == 0  # held: nothing sent
    assert await pending_id(sc, env) == approval_id  # the same call: the same request
    approvals = sc.gateway.pipeline.approvals
    decided = await approvals.decide(approval_id, "approved", "alice")
    assert (decided["state"], decided["decided_by"]) == ("approved", "alice")

    status, answer = await sc.call(env)
    assert (status, answer["success"]) == (200, True), answer
    assert upstream.hits == 1
    # Single-use: the same call again is a new request, and is not sent.
    again = await pending_id(sc, env)
    assert again != approval_id
    assert upstream.hits == 1
    events = [r for r in sc.lines() if r.get("event", "").startswith("approval_")]
    assert [e["event"] for e in events] == [
        "approval_requested", "approval_decided", "approval_used", "approval_requested",
    ]  # fmt: skip
    assert events[1]["by"] == "alice"
    assert events[1]["verdict"] == "approved"
    assert events[0]["approval_id"] == approval_id
    assert events[0]["trace_id"] == "tr-test-0001"


class CountingStore(MemoryApprovalStore):
    """The memory store, counting the held call's waits for a decision."""

    waits = 0

    async def wait(self, approval_id: str, timeout_s: float) -> None:
        self.waits += 1
        await super().wait(approval_id, timeout_s)


async def test_a_held_call_runs_when_approved_while_it_waits(
    upstream: FakeUpstream, sidecar_factory: Factory
) -> None:
    policy = compile_policy({"fake-openai": held_target(upstream.url)}, operators=OPERATORS)
    sc: Sidecar = await sidecar_factory(policy)
    approvals = sc.gateway.pipeline.approvals
    approvals.store = store = CountingStore()
    call = asyncio.create_task(sc.call(envelope(timeout=30)))

    async def polled_many_times() -> None:  # a wait longer than any retry count
        while store.waits <= 3 * MAX_REOPENS:
            await asyncio.sleep(0.005)

    await asyncio.wait_for(polled_many_times(), 20)
    rows = await store.recent(10)
    assert upstream.hits == 0
    assert not call.done()
    await approvals.decide(rows[0]["id"], "approved", "bob")
    status, answer = await asyncio.wait_for(call, 10)
    assert (status, answer["success"], upstream.hits) == (200, True, 1)


async def test_denied_changed_and_expired(upstream: FakeUpstream, sidecar_factory: Factory) -> None:
    policy = compile_policy(
        {"fake-openai": held_target(upstream.url, approvers=["alice"])}, operators=OPERATORS
    )
    sc: Sidecar = await sidecar_factory(policy)
    approvals = sc.gateway.pipeline.approvals
    env = envelope(timeout=0.05)
    approval_id = await pending_id(sc, env)
    with pytest.raises(PermissionDenied, match="may not decide"):
        await approvals.decide(approval_id, "approved", "bob")  # not an approver
    await approvals.decide(approval_id, "approved", "alice")
    with pytest.raises(InvalidPayload) as twice:
        await approvals.decide(approval_id, "denied", "alice")
    assert twice.value.http_status == 409
    with pytest.raises(InvalidPayload) as unknown:
        await approvals.decide("apr_nope", "approved", "alice")
    assert unknown.value.http_status == 404

    # Other arguments: not covered by the approval of the first.
    changed = envelope(timeout=0.05, parameters={"model": "fake-model-1", "messages": []})
    other = await pending_id(sc, changed)
    assert other != approval_id
    assert upstream.hits == 0
    await approvals.decide(other, "denied", "alice")
    status, answer = await sc.call(changed)
    assert status == 403
    assert answer["error"]["code"] == "APPROVAL_DENIED"
    assert answer["error"]["retryable"] is False
    assert answer["error"]["details"] == {"approval_id": other, "decided_by": "alice"}
    assert upstream.hits == 0
    # Another trace is another call.
    assert await pending_id(sc, {**env, "trace_id": "tr-other"}) not in (approval_id, other)
    # The approved first call still runs once.
    status, answer = await sc.call(env)
    assert (status, upstream.hits) == (200, 1)
    records = [r for r in sc.audit_records() if r["error_code"] == "APPROVAL_DENIED"]
    assert len(records) == 1


async def test_requests_and_approvals_expire() -> None:
    now = [1000.0]
    store = MemoryApprovalStore(clock=lambda: now[0])
    approvals = Approvals(store, clock=lambda: now[0])
    spec = ApprovalSpec(endpoints=[{"path": "/x", "methods": ["POST"]}], ttl_s=60)  # type: ignore[list-item]
    request = ExternalCallRequest.model_validate(
        envelope(target_system="t", endpoint="/x", timeout=1)
    )
    call = held_call(spec, "t", request, None, "agent")
    assert call is not None
    with pytest.raises(Exception, match="waits for an operator"):
        await approvals.hold(spec, call, deadline=0.0)
    first = (await store.recent(1))[0]
    now[0] += 61
    assert effective_state(first, now[0]) == "expired"
    with pytest.raises(InvalidPayload) as late:
        await approvals.decide(first["id"], "approved", "alice")
    assert late.value.http_status == 410
    with pytest.raises(Exception, match="waits for an operator"):
        await approvals.hold(spec, call, deadline=0.0)  # a new request
    second = (await store.recent(1))[0]
    assert second["id"] != first["id"]
    await approvals.decide(second["id"], "approved", "alice")
    now[0] += 61  # the approval itself expires unused
    with pytest.raises(Exception, match="waits for an operator"):
        await approvals.hold(spec, call, deadline=0.0)
    third = (await store.recent(1))[0]
    assert third["id"] not in (first["id"], second["id"])
    await approvals.decide(third["id"], "denied", "alice")
    with pytest.raises(ApprovalDenied):
        await approvals.hold(spec, call, deadline=0.0)
    now[0] += 61  # a denial holds ttl_s, then the same call asks anew
    with pytest.raises(ApprovalPending):
        await approvals.hold(spec, call, deadline=0.0)
    assert (await store.recent(1))[0]["id"] != third["id"]
