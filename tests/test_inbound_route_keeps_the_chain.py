"""Calls to an agent through its own sidecar's inbound route (``/a2a/in/{path}``), with
the real A2A SDK: the chain that came is admitted (signed, within depth and deadline,
no loop) and remembered for the trace, so that the agent's own calls in that trace
carry it even when the agent leaves the chain headers out, its drop-in LLM calls too.
Asserted: what each agent and the LLM upstream received, and the audit records."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.a2a_agents import Agent, agents_fixture, ask  # noqa: F401 - the fixture `agents`
from tests.conftest import FakeUpstream, Sidecar, compile_policy, openai_target

KEY = "chain-key-0123456789abcdef0123456789"
TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture(autouse=True)
def _chain_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHAIN_KEY", KEY)


def _chain(**extra: Any) -> dict[str, Any]:
    return {"signing_key_ref": "env://CHAIN_KEY", **extra}


async def _completion(_: web.Request) -> web.StreamResponse:
    return web.json_response(
        {
            "id": "c1",
            "object": "chat.completion",
            "model": "gpt-4o-mini",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    )


async def _stack(
    agents: Callable[..., Awaitable[Agent]],
    sidecar_factory: Callable[..., Awaitable[Sidecar]],
    llm: FakeUpstream | None = None,
    b_chain: dict[str, Any] | None = None,
) -> tuple[Agent, Agent, Sidecar, Sidecar]:
    """A (the test) -> B (behind its sidecar's inbound route; drops the chain headers,
    keeps traceparent; asks the LLM through its sidecar first when ``llm``) -> C."""
    c = await agents("c")
    b = await agents("b", drop_chain=True)
    targets: dict[str, Any] = {"c": {"base_url": c.url, "a2a": {"agent_id": "c"}}}
    if llm is not None:
        targets["openai"] = openai_target(llm.url)
    side_b = await sidecar_factory(
        compile_policy(
            targets, agent_id="b", inbound={"agent_url": b.url}, chain=b_chain or _chain()
        )
    )
    b.next_url = f"{side_b.url}/a2a/c"
    if llm is not None:
        b.before_reply = _llm_call(side_b)
    side_a = await sidecar_factory(
        compile_policy(
            {"b": {"base_url": f"{side_b.url}/a2a/in", "a2a": {"agent_id": "b"}}},
            agent_id="a",
            chain=_chain(),
        )
    )
    return b, c, side_a, side_b


def _llm_call(side_b: Sidecar) -> Callable[[dict[str, str]], Awaitable[None]]:
    async def call(headers: dict[str, str]) -> None:
        # The agent's LLM call inside the task: traceparent only, no chain headers.
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"{side_b.url}/proxy/openai/v1/chat/completions",
                json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]},
                headers={"traceparent": headers["traceparent"]},
            ) as resp,
        ):
            assert resp.status == 200, await resp.text()

    return call


async def test_an_agent_that_drops_the_chain_still_carries_it(
    agents: Callable[..., Awaitable[Agent]],
    sidecar_factory: Callable[..., Awaitable[Sidecar]],
    upstream_factory: Callable[..., Awaitable[FakeUpstream]],
) -> None:
    llm = await upstream_factory(_completion)
    b, c, side_a, side_b = await _stack(agents, sidecar_factory, llm)

    await ask(f"{side_a.url}/a2a/b", "hello", {"traceparent": TRACE})

    assert b.replies == ["b>c"]
    assert b.received[0]["x-egress-call-chain"] == "a"  # admitted as it came
    assert c.received[0]["x-egress-call-chain"] == "a,b"  # B left it out: its sidecar did not
    assert llm.seen[0].headers["x-egress-call-chain"] == "a,b"  # the LLM call in the task too
    records = side_b.audit_records()
    inbound = [r for r in records if r["target_system"] == "a2a-inbound"]
    outbound = [r for r in records if r["target_system"] != "a2a-inbound"]
    assert {r["target_system"] for r in outbound} == {"openai", "c"}
    assert all(r["success"] for r in records)
    assert all(r["call_chain"] == ["a"] for r in inbound if r["method"] == "POST")
    assert all(r["call_chain"] == ["a", "b"] for r in outbound)


async def _direct(side_b: Sidecar, headers: dict[str, str]) -> dict[str, Any]:
    """A JSON-RPC SendMessage straight to B's inbound route with ``headers``."""
    body = {
        "jsonrpc": "2.0",
        "id": 7,
        "method": "SendMessage",
        "params": {"message": {"messageId": "m1", "role": "ROLE_USER", "parts": [{"text": "x"}]}},
    }
    async with side_b.session.post(f"{side_b.url}/a2a/in/", json=body, headers=headers) as resp:
        assert resp.status == 200
        answer: dict[str, Any] = await resp.json()
        return answer


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        (
            {"x-egress-call-chain": "a", "x-egress-call-chain-sig": "v1=" + "A" * 43},
            "invalid_chain",
        ),
        ({}, "invalid_chain"),  # no chain at all, under require_signed_inbound
    ],
    ids=["forged", "missing"],
)
async def test_a_forged_or_missing_chain_is_refused_inbound(
    agents: Callable[..., Awaitable[Agent]],
    sidecar_factory: Callable[..., Awaitable[Sidecar]],
    headers: dict[str, str],
    reason: str,
) -> None:
    b, _, _, side_b = await _stack(
        agents, sidecar_factory, b_chain=_chain(require_signed_inbound=True)
    )
    answer = await _direct(side_b, headers)
    assert answer["id"] == 7
    assert answer["error"]["data"]["egress_code"] == "CALL_CHAIN_REFUSED"
    assert answer["error"]["data"]["reason"] == reason
    assert b.received == []
    (record,) = side_b.audit_records()
    assert record["error_code"] == "CALL_CHAIN_REFUSED"
    assert record["attempts"] == 0


async def test_a_stale_deadline_is_refused_inbound(
    agents: Callable[..., Awaitable[Agent]], sidecar_factory: Callable[..., Awaitable[Sidecar]]
) -> None:
    b, _, _, side_b = await _stack(agents, sidecar_factory, b_chain={})
    past = str(int(time.time() * 1000) - 5000)
    answer = await _direct(side_b, {"x-egress-call-chain": "a", "x-egress-deadline": past})
    assert answer["error"]["data"]["reason"] == "ttl_expired"
    assert b.received == []


async def test_a_chain_past_max_depth_is_refused_before_the_next_agent(
    agents: Callable[..., Awaitable[Agent]], sidecar_factory: Callable[..., Awaitable[Sidecar]]
) -> None:
    # B's sidecar allows chains of one agent: A's call reaches B (a, then b: depth 2 at
    # B's inbound route) is refused there, before B's agent is called.
    b, c, _, side_b = await _stack(agents, sidecar_factory, b_chain=_chain(max_depth=1))

    answer = await _direct(side_b, {"x-egress-call-chain": "a"})

    assert answer["error"]["data"]["reason"] == "max_depth_exceeded"
    assert answer["error"]["data"]["call_chain"] == ["a", "b"]
    assert b.received == []
    assert c.received == []


async def test_the_inbound_route_serves_the_card_pointing_at_itself(
    agents: Callable[..., Awaitable[Agent]], sidecar_factory: Callable[..., Awaitable[Sidecar]]
) -> None:
    b, _, _, side_b = await _stack(agents, sidecar_factory)
    async with side_b.session.get(f"{side_b.url}/a2a/in/.well-known/agent-card.json") as resp:
        card = await resp.json()
    assert card["supportedInterfaces"][0]["url"] == f"{side_b.url}/a2a/in/"
    # so that a client reading it calls the agent through the sidecar, not around it
    await ask(f"{side_b.url}/a2a/in/", "hello", {"traceparent": TRACE})
    assert len(b.received) == 1
    posts = [r for r in side_b.audit_records() if r["a2a_method"] == "SendMessage"]
    assert sorted(r["target_system"] for r in posts) == ["a2a-inbound", "c"]


async def test_a_later_request_in_the_same_context_gets_its_chain(
    agents: Callable[..., Awaitable[Agent]], sidecar_factory: Callable[..., Awaitable[Sidecar]]
) -> None:
    b, _, _, side_b = await _stack(agents, sidecar_factory, b_chain={})

    async def send(headers: dict[str, str]) -> None:
        body = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "SendMessage",
            "params": {
                "message": {
                    "messageId": f"m{len(b.received)}",
                    "contextId": "ctx-1",
                    "role": "ROLE_USER",
                    "parts": [{"text": "x"}],
                }
            },
        }
        url = f"{side_b.url}/a2a/in/"
        headers = {**headers, "A2A-Version": "1.0"}
        async with side_b.session.post(url, json=body, headers=headers) as resp:
            answer = await resp.json()
        assert "result" in answer, answer

    await send({"x-egress-call-chain": "a"})
    await send({})  # the same context, no chain: the one remembered for it

    assert [h.get("x-egress-call-chain") for h in b.received] == ["a", "a"]


@pytest.mark.parametrize(
    "forged",
    [
        {"x-egress-call-chain": "z"},  # a shorter chain of its own making: depth reset
        {"x-egress-call-chain": "z", "x-egress-deadline": str(int(time.time() * 1000) + 600_000)},
    ],
    ids=["chain", "chain-and-deadline"],
)
async def test_an_agent_that_replaces_the_chain_still_carries_the_one_it_received(
    forged: dict[str, str],
    agents: Callable[..., Awaitable[Agent]],
    sidecar_factory: Callable[..., Awaitable[Sidecar]],
    upstream_factory: Callable[..., Awaitable[FakeUpstream]],
) -> None:
    llm = await upstream_factory(_completion)
    b, _c, side_a, side_b = await _stack(agents, sidecar_factory, llm)

    async def forging(headers: dict[str, str]) -> None:
        # The agent's LLM call inside the task: its own chain instead of the one it got.
        async with side_b.session.post(
            f"{side_b.url}/proxy/openai/v1/chat/completions",
            json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]},
            headers={"traceparent": headers["traceparent"], **forged},
        ) as resp:
            assert resp.status == 200, await resp.text()

    b.before_reply = forging
    await ask(f"{side_a.url}/a2a/b", "hello", {"traceparent": TRACE})

    assert b.received[0]["x-egress-call-chain"] == "a"
    sent = llm.seen[0].headers
    assert sent["x-egress-call-chain"] == "a,b"  # what B received, not what it claimed
    assert sent["x-egress-deadline"] == b.received[0]["x-egress-deadline"]
    [record] = [r for r in side_b.audit_records() if r["target_system"] == "openai"]
    assert record["call_chain"] == ["a", "b"]
