"""The repeated-call breaker (docs/features/stopping.md): the same agent, target,
endpoint or MCP tool and canonical arguments more than ``max_repeats`` times within
``window_s`` is REPEATED_CALL (429, not retryable), counted in one sidecar (local) or
across sidecars through the real Redis (cluster); shadow mode records and lets it go;
``repeat_exempt`` endpoints and tools, other arguments and MCP protocol traffic are not
counted."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from gateway.agents.controls import Controls
from gateway.agents.repeats import Operation, RepeatedCalls, is_exempt, operations
from gateway.envelope import ExternalCallRequest
from gateway.errors import RepeatedCall
from gateway.policy.controls import RepeatedCallsSpec
from gateway.policy.loader import PolicyError, parse_policy
from tests.conftest import (
    FakeUpstream,
    Sidecar,
    compile_policy,
    envelope,
    openai_target,
    policy_yaml,
)
from tests.mcp_server import McpTestServer, RunningServer
from tests.redis_fixtures import SHARED_URL, redis_prefix

__all__ = ["redis_prefix"]  # fixture, imported for pytest

Factory = Callable[..., Awaitable[Sidecar]]


def _policy(url: str, mcp_url: str | None = None, redis: Any = None, **repeats: Any) -> Any:
    targets: dict[str, Any] = {
        "fake-openai": openai_target(
            url,
            endpoints=[
                {"path": "/v1/chat/completions", "methods": ["POST"]},
                {"path": "/v1/jobs/*", "methods": ["GET"]},
            ],
        )
    }
    if mcp_url is not None:
        targets["tools"] = {"base_url": mcp_url, "mcp": {"tools": {"allow": ["echo"]}}}
    exempt = repeats.pop("exempt", [])
    extra: dict[str, Any] = {"redis": redis} if redis else {}
    return compile_policy(
        targets,
        controls={
            "repeated_calls": {"max_repeats": 2, "window_s": 60, **repeats},
            "repeat_exempt": exempt,
        },
        **extra,
    )


def _job(n: int) -> dict[str, Any]:
    return envelope(endpoint=f"/v1/jobs/{n}", method="GET", parameters={})


async def test_the_call_past_max_repeats_is_refused(
    upstream: FakeUpstream, sidecar_factory: Factory
) -> None:
    sc = await sidecar_factory(_policy(upstream.url))
    for _ in range(2):
        assert (await sc.call(envelope()))[0] == 200
    status, answer = await sc.call(envelope(trace_id="tr-other"))  # ids are not arguments
    assert status == 429
    error = answer["error"]
    assert (error["code"], error["retryable"]) == ("REPEATED_CALL", False)
    assert (error["details"]["count"], error["details"]["window_s"]) == (3, 60)
    assert upstream.hits == 2
    # Other arguments are another call; a refused call still counts (the agent loops).
    other = envelope(parameters={"model": "fake-model-1", "messages": []})
    assert (await sc.call(other))[0] == 200
    assert (await sc.call(envelope()))[0] == 429
    assert upstream.hits == 3
    records = [r for r in sc.audit_records() if r.get("error_code") == "REPEATED_CALL"]
    assert len(records) == 2


async def test_shadow_mode_records_and_lets_the_call_go(
    upstream: FakeUpstream, sidecar_factory: Factory
) -> None:
    sc = await sidecar_factory(_policy(upstream.url, mode="shadow"))
    for _ in range(4):
        assert (await sc.call(envelope()))[0] == 200
    assert upstream.hits == 4
    decisions = [r["decision"] for r in sc.audit_records()]
    assert decisions == ["allowed", "allowed", "shadow_denied", "shadow_denied"]
    metrics = sc.gateway.metrics.render(None)[0].decode()
    assert (
        'egress_gateway_shadow_denials_total{kind="repeated_call",rule="fake-openai"} 2.0'
        in metrics
    )


async def test_exempt_endpoints_are_never_counted(
    upstream: FakeUpstream, sidecar_factory: Factory
) -> None:
    sc = await sidecar_factory(_policy(upstream.url, exempt=["/v1/jobs/*"]))
    for _ in range(5):
        assert (await sc.call(_job(1)))[0] == 200
    assert upstream.hits == 5


async def test_two_sidecars_share_the_count_in_cluster_scope(
    upstream: FakeUpstream, sidecar_factory: Factory, redis_prefix: str
) -> None:
    redis = {"url": SHARED_URL, "key_prefix": redis_prefix}
    a = await sidecar_factory(_policy(upstream.url, redis=redis, scope="cluster"))
    b = await sidecar_factory(_policy(upstream.url, redis=redis, scope="cluster"))
    assert (await a.call(envelope()))[0] == 200
    assert (await b.call(envelope()))[0] == 200
    status, answer = await a.call(envelope())
    assert (status, answer["error"]["details"]["count"]) == (429, 3)
    assert (await b.call(envelope()))[0] == 429
    assert upstream.hits == 2
    # Local scope on the same Redis: each sidecar counts alone.
    c = await sidecar_factory(_policy(upstream.url, redis=redis, scope="local"))
    assert (await c.call(envelope()))[0] == 200


@pytest.fixture(scope="module")
def mcp_server() -> Iterator[McpTestServer]:
    running = RunningServer(stateless=True, json_response=True)
    yield running.start()
    running.stop()


async def test_an_mcp_tool_called_again_with_the_same_arguments_is_refused(
    upstream: FakeUpstream, sidecar_factory: Factory, mcp_server: McpTestServer
) -> None:
    sc = await sidecar_factory(_policy(upstream.url, mcp_server.url))
    headers = {"Accept": "application/json, text/event-stream"}

    async def rpc(n: int, method: str, params: Any = None) -> dict[str, Any]:
        body: dict[str, Any] = {"jsonrpc": "2.0", "id": n, "method": method}
        if params is not None:
            body["params"] = params
        async with sc.session.post(sc.url + "/mcp/tools", json=body, headers=headers) as resp:
            return json.loads(await resp.text())

    for n in range(4):  # protocol traffic is not counted
        assert "result" in await rpc(n, "tools/list")
    call = {"name": "echo", "arguments": {"text": "again"}}
    assert "result" in await rpc(10, "tools/call", call)
    assert "result" in await rpc(11, "tools/call", call)
    refused = await rpc(12, "tools/call", call)
    assert refused["error"]["data"]["egress_code"] == "REPEATED_CALL"
    assert (refused["error"]["data"]["operation"], refused["error"]["data"]["count"]) == ("echo", 3)
    other = {"name": "echo", "arguments": {"text": "something else"}}
    assert "result" in await rpc(13, "tools/call", other)


def _request(**overrides: Any) -> ExternalCallRequest:
    return ExternalCallRequest.model_validate(envelope(**overrides))


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ({}, {}, True),
        ({"parameters": {"b": 1, "a": 2}}, {"parameters": {"a": 2, "b": 1}}, True),  # canonical
        ({"trace_id": "t1"}, {"trace_id": "t2"}, True),  # ids are not arguments
        ({"parameters": {"a": 1}}, {"parameters": {"a": 2}}, False),
        ({"endpoint": "/v1/x"}, {"endpoint": "/v1/y"}, False),
        ({"query": {"q": "1"}}, {"query": {"q": "2"}}, False),
    ],
)
def test_what_counts_as_the_same_call(a: dict[str, Any], b: dict[str, Any], same: bool) -> None:
    [first] = operations("t", _request(**a), None)
    [second] = operations("t", _request(**b), None)
    assert (first.digest == second.digest) is same
    assert isinstance(first, Operation)


_PAIRS = [
    ({}, {}),
    (
        {"parameters": {"b": 1, "a": [2, {"y": 1, "x": 2}]}},
        {"parameters": {"a": [2, {"x": 2, "y": 1}], "b": 1}},
    ),
    ({"parameters": {"a": 1}}, {"parameters": {"a": 2}}),
    ({"parameters": {"a": 1}}, {"parameters": {"a": 1.0}}),  # 500 and 500.0 differ
    ({"parameters": {"a": 0.0}}, {"parameters": {"a": -0.0}}),
    ({"parameters": {"a": 1e16}}, {"parameters": {"a": 1e16}}),  # spelled 1e+16 by json
    ({"parameters": {"a": 1e-07}}, {"parameters": {"a": 1e-7}}),
    ({"parameters": {"a": True}}, {"parameters": {"a": 1}}),
    ({"parameters": {"a": "1"}}, {"parameters": {"a": 1}}),
    ({"parameters": {"é": "Zoë \u2028"}}, {"parameters": {"é": "Zoë \u2028"}}),
    ({"parameters": {"a": None}}, {"parameters": {"a": None}}),  # counted by canonical JSON
    ({"parameters": {"a": 2**70}}, {"parameters": {"a": 2**70}}),  # past orjson's integers
    ({"parameters": {"a": 2**70}}, {"parameters": {"a": 2**70 + 1}}),
    ({"endpoint": "/v1/x"}, {"endpoint": "/v1/y"}),
    ({"method": "POST"}, {"method": "PUT"}),
    ({"query": {"q": "1"}}, {"query": {"q": "1"}}),  # counted by canonical JSON
    ({"query": {"q": "1"}}, {"query": {"q": "2"}}),
    ({"trace_id": "t1"}, {"trace_id": "t2"}),
]


@pytest.mark.parametrize(("a", "b"), _PAIRS)
def test_a_local_count_tells_calls_apart_as_their_canonical_json_does(
    a: dict[str, Any], b: dict[str, Any]
) -> None:
    """A local count of a plain HTTP call is keyed without its canonical JSON
    (``check_here``); two calls are counted as one exactly when their canonical JSON
    is the same."""
    breaker = RepeatedCalls(RepeatedCallsSpec(max_repeats=1, window_s=60))
    counted = []
    for overrides in (a, b):
        request = _request(**overrides)
        refused = breaker.check_here("agent", "t", request, None)
        if refused is None:  # not a call check_here counts: the canonical path's
            assert request.query or any(
                v is None or (isinstance(v, int) and v > 2**63) for v in request.parameters.values()
            )
            refused = asyncio.run(breaker.check("agent", operations("t", request, None)))
        counted.append(refused)
    [first] = operations("t", _request(**a), None)
    [second] = operations("t", _request(**b), None)
    assert counted[0] == ()
    assert (counted[1] != ()) is (first.canonical == second.canonical)


def test_a_local_count_is_per_agent_and_target() -> None:
    breaker = RepeatedCalls(RepeatedCallsSpec(max_repeats=1, window_s=60))
    request = _request()
    for agent, target in (("a1", "t"), ("a2", "t"), ("a1", "u")):
        assert breaker.check_here(agent, target, request, None) == ()
    [refusal] = breaker.check_here("a1", "t", request, None) or ()
    assert refusal.details["count"] == 2


@pytest.mark.parametrize(
    ("name", "patterns", "exempt"),
    [
        ("/v1/jobs/7", ["/v1/jobs/*"], True),
        ("/v1/jobs", ["/v1/jobs/*"], False),
        ("get_status", ["get_*"], True),
        ("search", ["get_*", "/v1/*"], False),
        ("search", [], False),
    ],
)
def test_repeat_exempt_globs(name: str, patterns: list[str], exempt: bool) -> None:
    assert is_exempt(name, patterns) is exempt


def test_cluster_scope_needs_a_redis_section() -> None:
    text = policy_yaml(
        {}, controls={"repeated_calls": {"max_repeats": 2, "window_s": 1, "scope": "cluster"}}
    )
    with pytest.raises(PolicyError) as caught:
        parse_policy(text, "p.yaml")
    assert "controls.repeated_calls.scope: 'cluster' needs a redis section" in str(caught.value)


@pytest.mark.parametrize("mode", ["enforce", "shadow"])
def test_the_controls_counted_here_answer_as_their_coroutine(mode: str) -> None:
    """Controls.check_here (no coroutine) and Controls.check give the same answers, call
    for call: the shadow refusal returned, the enforced one raised; a call it cannot
    count here is left to the coroutine, uncounted."""
    spec = RepeatedCallsSpec(max_repeats=1, window_s=60, mode=mode)  # type: ignore[arg-type]
    here, awaited = Controls(repeats=RepeatedCalls(spec)), Controls(repeats=RepeatedCalls(spec))
    assert here.check_here("a", "t", _request(query={"q": "1"}), None) is None
    request = _request()
    for _ in range(3):
        try:
            got: object = here.check_here("a", "t", request, None)
        except RepeatedCall as exc:
            got = (exc.code, str(exc), exc.details)
        try:
            want: object = asyncio.run(awaited.check("a", "t", request, None))
        except RepeatedCall as exc:
            want = (exc.code, str(exc), exc.details)
        assert got == want
    assert asyncio.run(here.check("a", "t", _request(query={"q": "1"}), None)) == []
