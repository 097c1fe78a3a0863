"""Dead letters: on a target with ``dead_letter: true`` a call that exhausted its
retries or ended OUTCOME_UNKNOWN is kept (request, ids, error; never a secret), bounded
(oldest dropped, counted), counted in a metric, and replayed once with its idempotency
key or discarded through the operator's routes; the routes refuse without a token."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from gateway.policy import PolicySet
from tests.conftest import FakeUpstream, Sidecar, compile_policy, envelope, openai_target
from tests.desk_helpers import TOKEN, Ops, ops_factory

__all__ = ["ops_factory"]  # a fixture, imported for pytest

Factory = Callable[..., Awaitable[Any]]
OPERATORS = {"alice": {"token_ref": "env://ALICE_TOKEN"}}
CANARY = "sk-fake-TEST-0001-NOTREAL"  # the conftest's credential


@pytest.fixture(autouse=True)
def _operator_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALICE_TOKEN", TOKEN)


def failing_policy(url: str, **extra: Any) -> PolicySet:
    target = openai_target(
        url,
        dead_letter=True,
        idempotency={"methods": ["POST"]},
        retry={"max_retries": 1, "backoff_base_s": 0.001, "backoff_max_s": 0.002},
    )
    return compile_policy({"fake-openai": target}, operators=OPERATORS, **extra)


async def test_a_call_that_failed_for_good_is_kept_and_replayed_once(
    upstream_factory: Factory, sidecar_factory: Factory, ops_factory: Factory
) -> None:
    failing = True

    async def handler(_: web.Request) -> web.StreamResponse:
        if failing:
            return web.json_response({"error": "down"}, status=503)
        return web.json_response({"ok": True})

    upstream: FakeUpstream = await upstream_factory(handler)
    sc: Sidecar = await sidecar_factory(failing_policy(upstream.url))
    ops: Ops = await ops_factory(sc)
    status, answer = await sc.call(envelope(max_retries=1))
    assert answer["error"]["code"] == "DEPENDENCY_FAILED"
    assert upstream.hits == 2  # the first try and its one retry
    # A refusal before any upstream contact is no dead letter.
    await sc.call(envelope(target_system="nope"))

    status, listed = await ops("GET", "/v1/dead-letters")
    assert status == 200
    [letter] = listed["dead_letters"]
    assert letter["target"] == "fake-openai"
    assert (letter["trace_id"], letter["correlation_id"]) == ("tr-test-0001", "corr-test-0001")
    assert letter["idempotency_key"] is not None
    assert letter["attempts"] == 2
    assert letter["error"]["code"] == "DEPENDENCY_FAILED"
    assert letter["request"]["parameters"]["messages"][0]["content"] == "ping"
    assert CANARY not in json.dumps(listed)
    metrics, _ = sc.gateway.metrics.render()
    assert 'egress_gateway_dead_letters_total{target="fake-openai"} 1.0' in metrics.decode()

    failing = False
    status, replayed = await ops("POST", f"/v1/dead-letters/{letter['id']}/replay")
    assert status == 200, replayed
    assert (replayed["status"], replayed["response"]["success"]) == (200, True)
    assert upstream.hits == 3
    sent = upstream.seen[-1].headers
    assert sent["Idempotency-Key"] == letter["idempotency_key"]
    assert upstream.seen[0].headers["Idempotency-Key"] == letter["idempotency_key"]
    status, again = await ops("POST", f"/v1/dead-letters/{letter['id']}/replay")
    assert (status, again["error"]["details"]["reason"]) == (404, "unknown_dead_letter")
    assert upstream.hits == 3  # replayed once
    events = [r["event"] for r in sc.lines() if r.get("event", "").startswith("dead_letter")]
    assert events == ["dead_letter_kept", "dead_letter_replayed"]


async def test_bounds_drop_the_oldest_and_discard_and_tokens(
    upstream_factory: Factory, sidecar_factory: Factory, ops_factory: Factory
) -> None:
    async def down(_: web.Request) -> web.StreamResponse:
        return web.json_response({"error": "down"}, status=503)

    upstream: FakeUpstream = await upstream_factory(down)
    policy = failing_policy(upstream.url, dead_letters={"max_count": 2})
    sc: Sidecar = await sidecar_factory(policy)
    ops: Ops = await ops_factory(sc)
    for n in range(3):
        await sc.call(envelope(max_retries=0, correlation_id=f"corr-{n}"))
    status, listed = await ops("GET", "/v1/dead-letters")
    assert [d["correlation_id"] for d in listed["dead_letters"]] == ["corr-2", "corr-1"]
    metrics = sc.gateway.metrics.render()[0].decode()
    assert "egress_gateway_dead_letters_dropped_total 1.0" in metrics

    for token in (None, "wrong-token"):
        status, refused = await ops("GET", "/v1/dead-letters", token=token)
        assert status == 401
        assert refused["error"]["code"] == "PERMISSION_DENIED"
    first = listed["dead_letters"][0]["id"]
    status, answer = await ops("POST", f"/v1/dead-letters/{first}/discard", token="wrong")
    assert status == 401
    status, answer = await ops("POST", f"/v1/dead-letters/{first}/discard")
    assert (status, answer) == (200, {"discarded": first})
    status, answer = await ops("POST", f"/v1/dead-letters/{first}/discard")
    assert status == 404
    status, answer = await ops("GET", "/v1/dead-letters/dl_unknown")
    assert status == 404

    # Its target removed from the policy: the replay is refused and the letter kept.
    second = listed["dead_letters"][1]["id"]
    sc.gateway.apply_policy(compile_policy({}, operators=OPERATORS))
    status, answer = await ops("POST", f"/v1/dead-letters/{second}/replay")
    assert (status, answer["error"]["details"]["reason"]) == (409, "target_removed")
    status, _ = await ops("GET", f"/v1/dead-letters/{second}")
    assert status == 200
    hits = upstream.hits
    assert hits == 3
    refusals = [r for r in sc.lines() if r.get("event") == "desk_refused"]
    assert len(refusals) == 3


async def test_an_outcome_unknown_is_kept_and_an_upstream_4xx_is_not(
    upstream_factory: Factory, sidecar_factory: Factory, ops_factory: Factory
) -> None:
    answer_with = "drop"

    async def handler(request: web.Request) -> web.StreamResponse:
        if answer_with == "drop":
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        return web.json_response({"error": "bad request"}, status=400)

    upstream: FakeUpstream = await upstream_factory(handler)
    # No idempotency, and a lost chat completion not resent either: kept as it failed.
    target = openai_target(upstream.url, dead_letter=True, retry={"resend_unanswered": False})
    sc: Sidecar = await sidecar_factory(compile_policy({"t": target}, operators=OPERATORS))
    ops: Ops = await ops_factory(sc)
    _, answer = await sc.call(envelope(target_system="t"))
    assert answer["error"]["code"] == "OUTCOME_UNKNOWN"
    answer_with = "400"
    _, answer = await sc.call(envelope(target_system="t", correlation_id="corr-400"))
    assert answer["error"]["code"] == "UPSTREAM_REJECTED"  # the agent's mistake: not kept
    _, listed = await ops("GET", "/v1/dead-letters")
    [letter] = listed["dead_letters"]
    assert (letter["error"]["code"], letter["idempotency_key"]) == ("OUTCOME_UNKNOWN", None)
    assert letter["attempts"] == 1


async def test_a_replay_runs_as_the_agent_whose_call_it_was(
    upstream_factory: Factory, sidecar_factory: Factory, ops_factory: Factory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("WORKER_TOKEN", "agent-token-WORKER-0003")
    down = True

    async def handler(_: web.Request) -> web.StreamResponse:
        return web.json_response({"ok": not down}, status=503 if down else 200)

    upstream: FakeUpstream = await upstream_factory(handler)
    target = openai_target(upstream.url, dead_letter=True, retry={"max_retries": 0})
    policy = compile_policy(
        {"t": target}, operators=OPERATORS, agents={"worker": {"token_ref": "env://WORKER_TOKEN"}}
    )
    sc: Sidecar = await sidecar_factory(policy)
    ops: Ops = await ops_factory(sc)
    headers = {"x-egress-agent-token": "agent-token-WORKER-0003"}
    body = envelope(target_system="t", agent_id="worker")
    async with sc.session.post(sc.url + "/v1/calls", json=body, headers=headers) as resp:
        assert (await resp.json())["error"]["code"] == "DEPENDENCY_FAILED"
    [letter] = sc.gateway.pipeline.dead_letters.list()
    assert letter.agent == "worker"
    down = False
    status, replayed = await ops("POST", f"/v1/dead-letters/{letter.id}/replay")
    assert (status, replayed["response"]["success"]) == (200, True), replayed
    assert sc.audit_records()[-1]["agent_id"] == "worker"


async def test_a_replay_is_held_to_what_the_agent_may_call_now(
    upstream: FakeUpstream, sidecar_factory: Factory, ops_factory: Factory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("WORKER_TOKEN", "agent-token-WORKER-0003")
    targets = {"t": openai_target(upstream.url, dead_letter=True), "u": openai_target(upstream.url)}
    agents = {"worker": {"token_ref": "env://WORKER_TOKEN", "targets": ["u"]}}
    sc: Sidecar = await sidecar_factory(compile_policy(targets, operators=OPERATORS, agents=agents))
    ops: Ops = await ops_factory(sc)
    # A letter the agent's call left when it still could call t (its policy then).
    letter = sc.gateway.pipeline.dead_letters.keep(
        target="t", api="envelope", agent="worker", trace_id="tr-1", correlation_id="c-1",
        idempotency_key=None, request=envelope(target_system="t", trace_id="tr-1"),
        error={"code": "DEPENDENCY_FAILED"}, attempts=1,
    )  # fmt: skip
    for who in ("worker", "gone"):  # an agent the policy no longer has: no one's call
        if who == "gone":
            letter = sc.gateway.pipeline.dead_letters.keep(
                target="u", api="envelope", agent="gone", trace_id="tr-2", correlation_id="c-2",
                idempotency_key=None, request=envelope(target_system="u", trace_id="tr-2"),
                error={"code": "DEPENDENCY_FAILED"}, attempts=1,
            )  # fmt: skip
        status, replayed = await ops("POST", f"/v1/dead-letters/{letter.id}/replay")
        reason = "target_not_allowed" if who == "worker" else "unknown_agent"
        assert (status, replayed["error"]["details"]["reason"]) == (409, reason), replayed
        status, _ = await ops("GET", f"/v1/dead-letters/{letter.id}")
        assert status == 200  # refused, the letter is kept
    assert upstream.hits == 0
