"""Agents calling agents through their sidecars, with the real A2A SDK (a2a-sdk): each
agent an SDK server on loopback behind its own sidecar, each calling the next with the
SDK's client pointed at its sidecar's ``/a2a/{target}``. Asserted: what each agent got
(the chain headers, the message metadata), what the caller got back (the answer, or the
JSON-RPC refusal with ``data.egress_code``), and every sidecar's audit records."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from a2a.utils.errors import A2AError

from tests.a2a_agents import Agent, ask
from tests.conftest import Sidecar, compile_policy


def a2a_target(agent: Agent, **a2a: Any) -> dict[str, Any]:
    return {"base_url": agent.url, "a2a": {"agent_id": agent.name, **a2a}}


@pytest.fixture
async def agents() -> AsyncIterator[Callable[..., Awaitable[Agent]]]:
    made: list[Agent] = []

    async def make(name: str, **kwargs: Any) -> Agent:
        agent = Agent(name, **kwargs)
        await agent.start()
        made.append(agent)
        return agent

    yield make
    for agent in made:
        await agent.stop()


async def _sidecar(
    sidecar_factory: Callable[..., Awaitable[Sidecar]], name: str, *callees: Agent, **extra: Any
) -> Sidecar:
    targets = {callee.name: a2a_target(callee) for callee in callees}
    return await sidecar_factory(compile_policy(targets, agent_id=name, **extra))


def _rpc_records(sidecar: Sidecar) -> list[dict[str, Any]]:
    return [r for r in sidecar.audit_records() if r["api"] == "a2a" and r["a2a_method"]]


async def test_a_chain_of_three_agents_carries_the_chain(
    agents: Callable[..., Awaitable[Agent]], sidecar_factory: Callable[..., Awaitable[Sidecar]]
) -> None:
    c = await agents("c")
    side_b = await _sidecar(sidecar_factory, "b", c)
    b = await agents("b", next_url=f"{side_b.url}/a2a/c")
    side_a = await _sidecar(sidecar_factory, "a", b)

    events = await ask(f"{side_a.url}/a2a/b", "hello")

    assert b.replies == ["b>c"]
    assert b.received[0]["x-egress-call-chain"] == "a"
    assert c.received[0]["x-egress-call-chain"] == "a,b"
    assert events  # the SDK client read the relayed answer
    (rec_a,) = _rpc_records(side_a)
    (rec_b,) = _rpc_records(side_b)
    assert rec_a["call_chain"] == ["a"]
    assert rec_b["call_chain"] == ["a", "b"]
    assert rec_a["a2a_method"] == "SendMessage"
    assert rec_a["success"] is True
    assert rec_a["a2a_task_id"]
    assert rec_a["a2a_context_id"]


async def test_a_loop_is_refused_at_the_second_sidecar_before_the_first_agent_is_called(
    agents: Callable[..., Awaitable[Agent]], sidecar_factory: Callable[..., Awaitable[Sidecar]]
) -> None:
    a = await agents("a")
    side_b = await _sidecar(sidecar_factory, "b", a)
    b = await agents("b", next_url=f"{side_b.url}/a2a/a")
    side_a = await _sidecar(sidecar_factory, "a", b)

    await ask(f"{side_a.url}/a2a/b", "hello")

    assert a.received == []  # never called, not even for its card
    assert b.replies[0].startswith("b!")  # the SDK client raised: the call was refused
    (refused,) = [r for r in side_b.audit_records() if r["api"] == "a2a"]
    assert refused["error_code"] == "CALL_CHAIN_REFUSED"
    assert refused["call_chain"] == ["a", "b", "a"]
    assert refused["attempts"] == 0


async def test_the_sidecar_refuses_with_a_jsonrpc_error_the_sdk_raises(
    agents: Callable[..., Awaitable[Agent]], sidecar_factory: Callable[..., Awaitable[Sidecar]]
) -> None:
    b = await agents("b")
    side_a = await sidecar_factory(
        compile_policy({"b": a2a_target(b, methods={"allow": ["GetTask"]})}, agent_id="a")
    )
    with pytest.raises(A2AError) as raised:
        await ask(f"{side_a.url}/a2a/b", "hello")
    assert "not allowed" in str(raised.value)
    assert b.received == []
    (refused,) = _rpc_records(side_a)
    assert refused["error_code"] == "PERMISSION_DENIED"
    assert refused["a2a_method"] == "SendMessage"


async def test_a_task_stream_is_relayed_event_by_event(
    agents: Callable[..., Awaitable[Agent]], sidecar_factory: Callable[..., Awaitable[Sidecar]]
) -> None:
    b = await agents("b", steps=3)
    side_a = await _sidecar(sidecar_factory, "a", b)

    events = await ask(f"{side_a.url}/a2a/b", "hello", streaming=True)

    assert len(events) >= 5  # the task, three working updates, the completion
    (record,) = _rpc_records(side_a)
    assert record["a2a_method"] == "SendStreamingMessage"
    assert record["stream"] is True
    assert record["stream_events"] >= 5
    assert record["success"] is True
    assert record["a2a_task_id"]
