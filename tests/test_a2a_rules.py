"""The pure parts of A2A and the inbound chain (no sockets): which events end a task
stream, which methods a policy allows, the chain written into a message's metadata, the
inbound admission of a chain, the bounded memory of chains, and the card's signed form
(the same bytes as the a2a-sdk's)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from a2a.utils.signing import _canonicalize_agent_card
from google.protobuf.json_format import ParseDict

from gateway.agents import card as cards
from gateway.agents import chain
from gateway.agents.chain_memory import GRACE_MS, ChainMemory
from gateway.call.a2a import TaskClock
from gateway.errors import PermissionDenied
from gateway.policy.a2a import A2aSpec
from gateway.policy.chain import ChainSpec
from gateway.providers import a2a as rpc

NOW = 1_800_000_000_000


def _answer(result: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": 1, "result": result}


@pytest.mark.parametrize(
    ("result", "final"),
    [
        ({"kind": "status-update", "status": {"state": "working"}, "final": False}, False),
        ({"kind": "status-update", "status": {"state": "working"}, "final": True}, True),
        ({"kind": "task", "id": "t", "status": {"state": "submitted"}}, False),
        ({"kind": "task", "id": "t", "status": {"state": "completed"}}, True),
        ({"kind": "artifact-update", "taskId": "t", "artifact": {}}, False),
        ({"kind": "message", "role": "agent", "parts": []}, True),
        ({"statusUpdate": {"taskId": "t", "status": {"state": "TASK_STATE_WORKING"}}}, False),
        ({"statusUpdate": {"taskId": "t", "status": {"state": "TASK_STATE_COMPLETED"}}}, True),
        ({"statusUpdate": {"taskId": "t", "status": {"state": "TASK_STATE_INPUT_REQUIRED"}}}, True),
        ({"task": {"id": "t", "contextId": "c", "status": {"state": "TASK_STATE_FAILED"}}}, True),
        ({"message": {"messageId": "m", "role": "ROLE_AGENT", "parts": []}}, True),
    ],
)
def test_which_events_end_a_task_stream(result: dict[str, Any], final: bool) -> None:
    exchange = rpc.parse_request(b'{"jsonrpc":"2.0","id":1,"method":"message/stream"}')
    exchange.read(_answer(result))
    assert exchange.final is final


def test_a_jsonrpc_error_ends_a_stream_with_its_code() -> None:
    exchange = rpc.parse_request(b'{"jsonrpc":"2.0","id":1,"method":"SubscribeToTask"}')
    exchange.read({"jsonrpc": "2.0", "id": 1, "error": {"code": -32001, "message": "no task"}})
    assert exchange.final is True
    assert exchange.error_code == -32001


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"not json", "parse_error"),
        (b"[]", "batch"),
        (b'{"jsonrpc":"1.0","id":1,"method":"x"}', "not_jsonrpc"),
        (b'{"jsonrpc":"2.0","id":1}', "no_method"),
        (b'{"jsonrpc":"2.0","method":"message/send"}', "no_id"),
        (b'{"jsonrpc":"2.0","id":true,"method":"message/send"}', "no_id"),
    ],
)
def test_bodies_that_are_not_one_request_are_refused(body: bytes, reason: str) -> None:
    with pytest.raises(rpc.A2aProtocolError) as raised:
        rpc.parse_request(body)
    assert raised.value.reason == reason


@pytest.mark.parametrize(
    ("methods", "method", "refusal"),
    [
        ({}, "message/send", None),
        ({"allow": ["message/*"]}, "tasks/get", "allow"),
        ({"allow": ["*"], "deny": ["tasks/pushNotificationConfig/*"]},
         "tasks/pushNotificationConfig/set", "deny:tasks/pushNotificationConfig/*"),
        ({"allow": ["SendMessage", "GetTask"]}, "GetTask", None),
    ],
)  # fmt: skip
def test_methods_are_allowed_by_policy(
    methods: dict[str, Any], method: str, refusal: str | None
) -> None:
    spec = A2aSpec.model_validate({"methods": methods})
    assert rpc.method_refusal(spec, method) == refusal


def test_the_chain_replaces_what_the_agent_wrote_in_the_metadata() -> None:
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "SendMessage",
        "params": {
            "message": {"metadata": {"x-egress-call-chain": "forged", "mine": 1}, "parts": []}
        },
    }
    exchange = rpc.parse_request(json.dumps(body).encode())
    out = rpc.with_chain(exchange, {"x-egress-call-chain": "a,b", "x-egress-deadline": "9"})
    assert out is not None
    metadata = out["params"]["message"]["metadata"]
    assert metadata == {"mine": 1, "x-egress-call-chain": "a,b", "x-egress-deadline": "9"}
    assert rpc.chain_in_body(out) == {"x-egress-call-chain": "a,b", "x-egress-deadline": "9"}
    get = rpc.parse_request(b'{"jsonrpc":"2.0","id":2,"method":"GetTask","params":{"id":"t"}}')
    assert rpc.with_chain(get, {"x-egress-call-chain": "a"}) is None
    assert get.task_id == "t"


SPEC = ChainSpec(max_depth=3, ttl_s=60)


@pytest.mark.parametrize(
    ("headers", "reason", "agents"),
    [
        ({"x-egress-call-chain": "a"}, None, ("a",)),
        ({"x-egress-call-chain": "a,b"}, "circular_call_detected", ("a", "b", "b")),
        ({"x-egress-call-chain": "a,c,d"}, "max_depth_exceeded", ("a", "c", "d", "b")),
        ({"x-egress-call-chain": "a", "x-egress-deadline": str(NOW - 1)}, "ttl_expired", ("a",)),
        ({"x-egress-call-chain": "a b"}, "invalid_chain", ()),
        (None, None, ()),
    ],
)
def test_an_inbound_chain_is_admitted_not_extended(
    headers: dict[str, str] | None, reason: str | None, agents: tuple[str, ...]
) -> None:
    decision = chain.admit(headers, own_agent="b", now_ms=NOW, timeout_s=30, spec=SPEC)
    assert (decision.error.details["reason"] if decision.error else None) == reason
    assert decision.agents == agents


def test_chains_are_remembered_bounded_and_until_past_their_deadline() -> None:
    memory = ChainMemory(limit=2)
    decision = chain.admit(
        {"x-egress-call-chain": "a"}, own_agent="b", now_ms=NOW, timeout_s=30, spec=SPEC
    )
    memory.remember([("trace", "t0"), ("trace", "t1"), ("task", "k1"), ("context", None)], decision)
    assert len(memory) == 2  # the oldest beyond the limit went; None ids are not keys
    assert memory.recall([("trace", "t0")], NOW) is None
    assert memory.recall([("trace", "t1")], NOW) == decision.headers()
    assert memory.recall([("task", "k1")], NOW) == decision.headers()
    late = (decision.deadline_ms or 0) + GRACE_MS
    assert memory.recall([("task", "k1")], late - 1) == decision.headers()
    assert memory.recall([("task", "k1")], late) is None


CARD: dict[str, Any] = {
    "name": "é agent",
    "description": "d",
    "version": "1",
    "supportedInterfaces": [{"url": "http://x/", "protocolBinding": "JSONRPC"}],
    "capabilities": {"streaming": True},
    "defaultInputModes": ["text/plain"],
    "defaultOutputModes": ["text/plain"],
    "skills": [{"id": "s", "name": "s", "description": "", "tags": ["t"]}],
}


def test_the_cards_signed_form_is_the_sdks() -> None:
    from a2a.types import AgentCard

    sdk = _canonicalize_agent_card(ParseDict(CARD, AgentCard()))
    assert cards.canonical(CARD) == sdk.encode()


def test_a_card_is_served_pointing_at_the_sidecar() -> None:
    served = cards.served({**CARD, "url": "http://x/", "signatures": [{}]}, "http://s/a2a/b")
    assert served["url"] == "http://s/a2a/b"
    assert served["supportedInterfaces"][0]["url"] == "http://s/a2a/b"
    assert "signatures" not in served


@pytest.mark.parametrize("body", [b"[]", b'{"name": "x"}', b"\xff", b'{"url": "u"}'])
def test_what_is_not_a_card_is_refused(body: bytes) -> None:
    with pytest.raises(PermissionDenied) as raised:
        cards.check(body, verify=False, key=None, algorithms=("ES256",))
    assert raised.value.details["reason"] == "card_invalid"


def test_a_tasks_clock_starts_when_the_sidecar_first_sees_it() -> None:
    clock = TaskClock(limit=2)
    assert clock.left_s("b", "t1", 10.0, now=100.0) == 10.0
    assert clock.left_s("b", "t1", 10.0, now=104.0) == 6.0
    assert clock.left_s("b", "t1", 10.0, now=111.0) == -1.0  # refused: task_ttl_expired
    assert clock.left_s("b", None, 10.0, now=111.0) == 10.0  # no task yet: a new one
    clock.seen("b", "t2", now=200.0)
    clock.seen("b", "t3", now=200.0)  # past the limit: t1, the oldest, is forgotten
    assert clock.left_s("b", "t1", 10.0, now=300.0) == 10.0
