"""Agents calling agents through their sidecars, with the real A2A SDK (a2a-sdk): each
agent an SDK server on loopback behind its own sidecar, each calling the next with the
SDK's client pointed at its sidecar's ``/a2a/{target}``. Asserted: what each agent got
(the chain headers, the message metadata), what the caller got back (the answer, or the
JSON-RPC refusal with ``data.egress_code``), and every sidecar's audit records."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from a2a.utils.errors import A2AError
from aiohttp import web

from tests.a2a_agents import Agent, agents_fixture, ask  # noqa: F401 - the fixture `agents`
from tests.conftest import FakeUpstream, Sidecar, compile_policy


def a2a_target(agent: Agent, **a2a: Any) -> dict[str, Any]:
    return {"base_url": agent.url, "a2a": {"agent_id": agent.name, **a2a}}


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


def _sse_task(*, final: bool) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """An A2A agent's stream: the task, a working update and, with ``final``, its
    completion (0.3 shapes: ``kind``, ``final``); then the connection ends."""

    async def handler(request: web.Request) -> web.StreamResponse:
        ident = (await request.json())["id"]
        events: list[dict[str, Any]] = [
            {"kind": "task", "id": "t1", "contextId": "c1", "status": {"state": "submitted"}},
            {"kind": "status-update", "taskId": "t1", "contextId": "c1",
             "status": {"state": "working"}, "final": False},
        ]  # fmt: skip
        if final:
            events.append(
                {"kind": "status-update", "taskId": "t1", "contextId": "c1",
                 "status": {"state": "completed"}, "final": True}
            )  # fmt: skip
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in events:
            line = json.dumps({"jsonrpc": "2.0", "id": ident, "result": event})
            await resp.write(f"data: {line}\n\n".encode())
        await resp.write_eof()
        return resp

    return handler


@pytest.mark.parametrize("method", ["message/stream", "tasks/resubscribe"])
@pytest.mark.parametrize("final", [True, False], ids=["complete", "cut-before-final"])
async def test_a_task_stream_is_complete_only_at_its_final_event(
    upstream_factory: Callable[..., Awaitable[FakeUpstream]],
    sidecar_factory: Callable[..., Awaitable[Sidecar]],
    final: bool,
    method: str,
) -> None:
    up = await upstream_factory(_sse_task(final=final))
    side = await sidecar_factory(
        compile_policy({"b": {"base_url": up.url, "a2a": {"agent_id": "b"}}}, agent_id="a")
    )
    params: dict[str, Any] = (
        {"message": {"messageId": "m", "role": "user", "parts": []}}
        if method == "message/stream"
        else {"id": "t1"}
    )
    body = {"jsonrpc": "2.0", "id": 3, "method": method, "params": params}
    async with side.session.post(f"{side.url}/a2a/b", json=body) as resp:
        text = await resp.text()
    relayed = [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: ")]
    assert [e["result"]["kind"] for e in relayed if "result" in e][:2] == ["task", "status-update"]
    (record,) = side.audit_records()
    assert record["a2a_task_id"] == "t1"
    assert record["a2a_context_id"] == "c1"
    if final:
        assert record["success"] is True
        assert all("error" not in e for e in relayed)
    else:
        assert record["error_code"] == "STREAM_INTERRUPTED"
        assert relayed[-1]["id"] == 3
        assert relayed[-1]["error"]["data"]["egress_code"] == "STREAM_INTERRUPTED"
        assert relayed[-1]["error"]["data"]["reason"] == "no_final_event"
    assert up.seen[0].headers["x-egress-call-chain"] == "a"
    if method == "message/stream":  # the chain went in the message's metadata too
        sent = up.seen[0].json()["params"]["message"]["metadata"]
        assert sent["x-egress-call-chain"] == "a"


async def test_a_loop_between_two_agents_stops_at_the_first_repeat(
    agents: Callable[..., Awaitable[Agent]], sidecar_factory: Callable[..., Awaitable[Sidecar]]
) -> None:
    """A asks B, B asks A again: each agent is called once, and the loop is refused at
    the first repeat, in B's sidecar's audit log (its call to A); an agent that goes
    around its sidecar to A's inbound route is refused there, in A's log."""
    a = await agents("a")
    b = await agents("b")
    side_a = await sidecar_factory(
        compile_policy(
            {"b": {"base_url": b.url, "a2a": {"agent_id": "b"}}},
            agent_id="a",
            inbound={"agent_url": a.url},
        )
    )
    side_b = await _sidecar(sidecar_factory, "b", a)
    a.next_url, b.next_url = f"{side_a.url}/a2a/b", f"{side_b.url}/a2a/a"

    await ask(f"{side_a.url}/a2a/in/", "start")  # A is asked (by a user): A -> B -> A?

    assert len(a.received) == 1  # called once: the repeat never reached it
    assert len(b.received) == 1
    (start,) = [r for r in side_a.audit_records() if r["a2a_method"] == "SendMessage"][-1:]
    assert start["target_system"] == "a2a-inbound"  # the user's call went through A's sidecar
    refused = [r for r in side_b.audit_records() if r["error_code"] == "CALL_CHAIN_REFUSED"]
    assert len(refused) == 1
    assert refused[0]["call_chain"] == ["a", "b", "a"]
    # B going around its sidecar, straight to A's inbound route with the chain it got:
    bypass = {"x-egress-call-chain": b.received[0]["x-egress-call-chain"]}
    with pytest.raises(Exception):  # noqa: B017, PT011 - the SDK's card or RPC error
        await ask(f"{side_a.url}/a2a/in/", "again", bypass)
    assert len(a.received) == 1
    in_a = [r for r in side_a.audit_records() if r["error_code"] == "CALL_CHAIN_REFUSED"]
    assert in_a
    assert in_a[0]["target_system"] == "a2a-inbound"


@pytest.mark.parametrize("path", ["/a2a/", "/a2a/b/extra", "/a2a/b/.well-known/x/y"])
async def test_a_path_under_a2a_that_no_route_matches_is_a_jsonrpc_error(
    sidecar_factory: Callable[..., Awaitable[Sidecar]], path: str
) -> None:
    side = await sidecar_factory(compile_policy({}, agent_id="a"))
    async with side.session.post(side.url + path, json={}) as resp:
        answer = await resp.json()
    assert resp.status == 404
    assert answer["error"]["data"]["egress_code"] == "INVALID_PAYLOAD"
    assert answer["error"]["data"]["reason"] == "route"
    (record,) = side.audit_records()
    assert record["api"] == "a2a"


async def test_the_targets_credential_is_injected_and_the_agents_is_dropped(
    upstream_factory: Callable[..., Awaitable[FakeUpstream]],
    sidecar_factory: Callable[..., Awaitable[Sidecar]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("B_TOKEN", "b-token-0123456789")
    up = await upstream_factory(_sse_task(final=True))
    target = {
        "base_url": up.url,
        "a2a": {"agent_id": "b"},
        "credential": {
            "header": "Authorization",
            "format": "Bearer {secret}",
            "default_ref": "env://B_TOKEN",
            "allowed_refs": ["env://B_TOKEN"],
        },
    }
    side = await sidecar_factory(compile_policy({"b": target}, agent_id="a"))
    body = {"jsonrpc": "2.0", "id": 1, "method": "tasks/resubscribe", "params": {"id": "t1"}}
    headers = {"Authorization": "Bearer the-agents-own"}
    async with side.session.post(f"{side.url}/a2a/b", json=body, headers=headers) as resp:
        text = await resp.text()
    assert resp.status == 200
    assert up.seen[0].headers["Authorization"] == "Bearer b-token-0123456789"
    assert "b-token-0123456789" not in text
    assert "b-token-0123456789" not in side.log.getvalue()


async def test_a_task_past_its_ttl_is_refused_whatever_the_requests_deadline(
    upstream_factory: Callable[..., Awaitable[FakeUpstream]],
    sidecar_factory: Callable[..., Awaitable[Sidecar]],
) -> None:
    up = await upstream_factory(_sse_task(final=True))
    target = {"base_url": up.url, "a2a": {"agent_id": "b", "task_ttl_s": 5}}
    side = await sidecar_factory(compile_policy({"b": target}, agent_id="a"))
    side.gateway.a2a_tasks.seen("b", "old", now=time.monotonic() - 6)  # first seen 6 s ago
    body = {"jsonrpc": "2.0", "id": 1, "method": "tasks/resubscribe", "params": {"id": "old"}}
    async with side.session.post(f"{side.url}/a2a/b", json=body) as resp:
        answer = await resp.json()
    assert answer["error"]["data"]["egress_code"] == "AGENT_TIMEOUT"
    assert answer["error"]["data"]["reason"] == "task_ttl_expired"
    assert up.hits == 0
    (record,) = side.audit_records()
    assert record["a2a_task_id"] == "old"
