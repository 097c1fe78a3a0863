"""An agent's own rate-limit group (``agents.NAME.rate_limit_group``) behaves as any
group: ``tokens_per_minute`` reserves a call's estimate there and settles it with the
real usage; ``mode: shadow`` never refuses but records the refusal it would give; a call
whose own group is the agent's takes it once; an agent without one takes only its
target's; an envelope may not name another agent's own group. Agents recognised by
their token, in process."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web

from tests.agent_processes import COMPLETION
from tests.conftest import compile_policy, envelope, openai_target

TOKENS = {"planner": "agent-token-TEST-0051-NOTREAL", "coder": "agent-token-TEST-0052-NOTREAL"}
#: Refilled at one call per 1000 s: no refill within a test, whatever the machine.
SLOW = {"requests_per_second": 0.001, "max_queue_s": 0}


@pytest.fixture(autouse=True)
def _tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, token in TOKENS.items():
        monkeypatch.setenv(f"TEST_{name.upper()}_TOKEN", token)


async def _sidecar(upstream_factory: Any, sidecar_factory: Any, **policy: Any) -> tuple[Any, Any]:
    async def completion(_: web.Request) -> web.StreamResponse:
        return web.json_response(COMPLETION)  # usage: 4 tokens

    up = await upstream_factory(completion)
    agents = policy.pop("agents")
    for name, spec in agents.items():
        spec["token_ref"] = f"env://TEST_{name.upper()}_TOKEN"
    target = openai_target(up.url, **policy.pop("target", {}))
    sc = await sidecar_factory(compile_policy({"fake-openai": target}, agents=agents, **policy))
    return up, sc


async def _call(
    sc: Any, agent: str, trace: str, max_tokens: int = 5, group: str | None = None
) -> tuple[int, Any]:
    named = {"rate_limit_group": group} if group else {}
    body = envelope(
        **named, trace_id=trace, parameters={**envelope()["parameters"], "max_tokens": max_tokens}
    )
    headers = {"x-egress-agent-token": TOKENS[agent]}
    async with sc.session.post(sc.url + "/v1/calls", json=body, headers=headers) as resp:
        return resp.status, await resp.json()


async def test_the_token_estimate_is_reserved_and_settled_with_the_usage(
    upstream_factory: Any, sidecar_factory: Any
) -> None:
    # 800 tokens a minute: one call's estimate (500 + its prompt) fits once; settled with
    # its real usage (4 tokens) the next fits too; unsettled it would not (2 x 500 > 800).
    up, sc = await _sidecar(
        upstream_factory, sidecar_factory,
        rate_limit_groups={"pace": {"requests_per_second": 100, "burst": 100,
                                    "tokens_per_minute": 800, "max_queue_s": 0}},
        agents={"planner": {"rate_limit_group": "pace"}},
    )  # fmt: skip
    assert [(await _call(sc, "planner", f"tr-{i}", 500))[0] for i in range(3)] == [200] * 3
    status, body = await _call(sc, "planner", "tr-too-large", 900)
    assert status == 429
    error = body["error"]
    assert (error["code"], error["retryable"]) == ("CAPACITY_EXCEEDED", False)
    assert (error["details"]["group"], error["details"]["reason"]) == ("pace", "too_large")
    assert len(up.seen) == 3
    records = sc.audit_records()
    assert [(r["rate_limit_group"], r["agent_rate_limit_group"], r["rate_limit_refused"])
            for r in records] == [(None, "pace", None)] * 3 + [(None, "pace", "pace")]  # fmt: skip


async def test_a_shadow_group_refuses_nothing_and_says_what_it_would_refuse(
    upstream_factory: Any, sidecar_factory: Any
) -> None:
    up, sc = await _sidecar(
        upstream_factory, sidecar_factory,
        rate_limit_groups={"pace": {**SLOW, "burst": 1, "mode": "shadow"}},
        agents={"planner": {"rate_limit_group": "pace"}},
    )  # fmt: skip
    assert [(await _call(sc, "planner", f"tr-{i}"))[0] for i in range(2)] == [200, 200]
    assert len(up.seen) == 2
    first, second = sc.audit_records()
    assert (first["decision"], first["shadow_denied"]) == ("allowed", [])
    assert (second["decision"], second["shadow_denied"]) == (
        "shadow_denied", ["rate_limit_group:pace"],
    )  # fmt: skip
    assert second["rate_limit_refused"] is None


async def test_the_agents_group_as_the_calls_own_is_taken_once(
    upstream_factory: Any, sidecar_factory: Any
) -> None:
    # The target's group is the planner's own, 2 calls deep: taken twice a call, the
    # second call would be refused.
    up, sc = await _sidecar(
        upstream_factory, sidecar_factory,
        rate_limit_groups={"pace": {**SLOW, "burst": 2}},
        target={"rate_limit_group": "pace"},
        agents={"planner": {"rate_limit_group": "pace"}, "coder": {}},
    )  # fmt: skip
    statuses = [(await _call(sc, "planner", f"tr-{i}"))[0] for i in range(3)]
    assert statuses == [200, 200, 429]
    records = sc.audit_records()
    assert [(r["agent_rate_limit_group"], r["rate_limit_refused"]) for r in records] == [
        (None, None), (None, None), (None, "pace"),
    ]  # fmt: skip
    # The coder has no group of its own, but the target's is the one the planner used up.
    status, body = await _call(sc, "coder", "tr-coder")
    assert (status, body["error"]["details"]["group"]) == (429, "pace")
    assert len(up.seen) == 2


async def test_an_envelope_may_not_spend_another_agents_pace(
    upstream_factory: Any, sidecar_factory: Any
) -> None:
    up, sc = await _sidecar(
        upstream_factory, sidecar_factory,
        rate_limit_groups={"planner-pace": {**SLOW, "burst": 5},
                           "coder-pace": {**SLOW, "burst": 5}},
        agents={"planner": {"rate_limit_group": "planner-pace"},
                "coder": {"rate_limit_group": "coder-pace"}},
    )  # fmt: skip
    status, body = await _call(sc, "planner", "tr-foreign", group="coder-pace")
    assert status == 403
    assert body["error"]["details"] == {
        "reason": "rate_limit_group_not_allowed", "group": "coder-pace",
    }  # fmt: skip
    assert up.seen == []
    # Naming its own group is fine: taken once, as the call's own group.
    assert (await _call(sc, "planner", "tr-own", group="planner-pace"))[0] == 200
    foreign, own = sc.audit_records()
    assert (foreign["decision"], foreign["error_code"]) == ("denied", "PERMISSION_DENIED")
    assert (own["rate_limit_group"], own["agent_rate_limit_group"]) == ("planner-pace", None)


@pytest.mark.parametrize(
    ("group", "status", "reason"),
    [
        ("coder-pace", 403, "rate_limit_group_not_allowed"),
        ("no-such", 400, "unknown_rate_limit_group"),
    ],
)
async def test_a_group_the_call_may_not_name_is_refused_before_a_person_is_asked(
    upstream_factory: Any, sidecar_factory: Any, group: str, status: int, reason: str
) -> None:
    # A held target: a call naming another agent's group (or none of the policy's) would
    # otherwise wait for an operator's yes, and then be refused, its approval used up.
    held = {"endpoints": [{"path": "/v1/chat/*", "methods": ["POST"]}]}
    up, sc = await _sidecar(
        upstream_factory, sidecar_factory,
        rate_limit_groups={"planner-pace": {**SLOW, "burst": 5},
                           "coder-pace": {**SLOW, "burst": 5}},
        target={"approval": held},
        agents={"planner": {"rate_limit_group": "planner-pace"},
                "coder": {"rate_limit_group": "coder-pace"}},
        operators={"alice": {"token_ref": "env://TEST_PLANNER_TOKEN"}},
    )  # fmt: skip
    body = envelope(rate_limit_group=group, trace_id="tr-named", timeout=0.2)
    headers = {"x-egress-agent-token": TOKENS["planner"]}
    async with sc.session.post(sc.url + "/v1/calls", json=body, headers=headers) as resp:
        got, answer = resp.status, await resp.json()
    assert (got, answer["error"]["details"].get("reason")) == (status, reason), answer
    events = [r["event"] for r in sc.lines() if r.get("event", "").startswith("approval_")]
    assert events == []
    assert await sc.gateway.pipeline.approvals.store.recent(10) == []  # nobody was asked
    assert up.seen == []


async def test_a_replayed_answer_takes_nothing_from_the_agents_group(
    upstream_factory: Any, sidecar_factory: Any
) -> None:
    # One call's worth of pace: the answer it bought is the agent's again, by its
    # idempotency key, as often as it asks (a lost answer is what the key is for); only a
    # call that is sent takes from the group.
    up, sc = await _sidecar(
        upstream_factory, sidecar_factory,
        rate_limit_groups={"pace": {**SLOW, "burst": 1}},
        target={"idempotency": {"methods": ["POST"]}},
        agents={"planner": {"rate_limit_group": "pace"}},
    )  # fmt: skip
    answers = [await _call(sc, "planner", "tr-same") for _ in range(3)]
    assert [status for status, _ in answers] == [200] * 3, answers[-1]
    assert len(up.seen) == 1
    status, body = await _call(sc, "planner", "tr-another")  # a new call: the pace is spent
    assert (status, body["error"]["details"]["group"]) == (429, "pace")
    records = sc.audit_records()
    assert [(r["replayed"], r["agent_rate_limit_group"], r["rate_limit_refused"])
            for r in records] == [(False, "pace", None), (True, None, None), (True, None, None),
                                  (False, "pace", "pace")]  # fmt: skip


async def test_a_failed_call_gives_its_token_estimate_back_as_the_targets_group_does(
    upstream_factory: Any, sidecar_factory: Any
) -> None:
    # The same group twice, the target's and the planner's: 800 tokens a minute, one
    # call's estimate (500 + its prompt) fits once. An upstream that answers 500 reports
    # no usage: both give the estimate back, so a failing upstream does not lock the
    # agent out of its own pace for a minute (each call reaches the upstream).
    async def failing(_: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "boom"}}, status=500)

    up = await upstream_factory(failing)
    pace = {"requests_per_second": 100, "burst": 100, "tokens_per_minute": 800, "max_queue_s": 0}
    agents = {"planner": {"rate_limit_group": "pace",
                          "token_ref": "env://TEST_PLANNER_TOKEN"}}  # fmt: skip
    target = openai_target(up.url, rate_limit_group="target-pace", circuit_breaker=None)
    sc = await sidecar_factory(
        compile_policy({"fake-openai": target}, agents=agents,
                       rate_limit_groups={"pace": pace, "target-pace": pace})
    )  # fmt: skip
    answers = [await _call(sc, "planner", f"tr-{i}", 500) for i in range(3)]
    assert [body["error"]["code"] for _, body in answers] == ["DEPENDENCY_FAILED"] * 3, answers
    assert len(up.seen) == 3 * 3  # each call's attempts (max_retries: 2)
    assert [r["rate_limit_refused"] for r in sc.audit_records()] == [None] * 3


async def test_a_fallback_whose_group_is_the_agents_takes_it_once(
    upstream_factory: Any, sidecar_factory: Any
) -> None:
    # The primary (no group) answers 503, its fallback's group is the agent's own: the
    # call holds that group once (taken on entry), so two calls fit a burst of two.
    async def down(_: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "overloaded"}}, status=503)

    async def completion(_: web.Request) -> web.StreamResponse:
        return web.json_response(COMPLETION)

    primary, spare = await upstream_factory(down), await upstream_factory(completion)
    targets = {
        "fake-openai": openai_target(primary.url, fallbacks=[{"target": "spare"}]),
        "spare": openai_target(spare.url, rate_limit_group="pace"),
    }
    agents = {"planner": {"rate_limit_group": "pace", "token_ref": "env://TEST_PLANNER_TOKEN"}}
    groups = {"pace": {**SLOW, "burst": 2}}
    sc = await sidecar_factory(compile_policy(targets, agents=agents, rate_limit_groups=groups))
    results = [await _call(sc, "planner", f"tr-fb-{i}") for i in range(3)]
    assert [status for status, _ in results] == [200, 200, 429]
    assert [b["served_by"]["target"] for _, b in results[:2]] == ["spare", "spare"]
    assert results[2][1]["error"]["details"]["group"] == "pace"
    assert len(spare.seen) == 2
