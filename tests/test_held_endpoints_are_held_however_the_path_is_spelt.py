"""An endpoint a target's ``approval:`` names is held whatever spelling of its path the
agent sends: a trailing slash (the allowlist reads ``/v1/charges/`` as ``/v1/charges``)
or percent-encoded letters (``/v1/%63harges``, which the upstream decodes to
``/v1/charges``) are the same endpoint to the approval rule, to tool caps and to the
repeated-call breaker, so none of them can be stepped around by respelling the path."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gateway.agents.repeats import call_names
from gateway.envelope import ExternalCallRequest
from gateway.policy.egress import endpoint_name
from tests.conftest import FakeUpstream, Sidecar, compile_policy, envelope, openai_target

Factory = Callable[..., Awaitable[Any]]
OPERATORS = {"alice": {"token_ref": "env://ALICE_TOKEN"}}
SPELLINGS = ["/v1/charges", "/v1/charges/", "/v1/%63harges", "/v1/%63%68arges/", "/v1/charge%73"]


def charges_target(url: str) -> dict[str, Any]:
    return openai_target(
        url,
        endpoints=[{"path": "/v1/*", "methods": ["POST"]}],
        approval={"endpoints": [{"path": "/v1/charges", "methods": ["POST"]}]},
    )


@pytest.mark.parametrize("endpoint", SPELLINGS)
async def test_a_respelt_held_endpoint_is_still_held(
    endpoint: str, upstream: FakeUpstream, sidecar_factory: Factory
) -> None:
    policy = compile_policy({"fake-openai": charges_target(upstream.url)}, operators=OPERATORS)
    sc: Sidecar = await sidecar_factory(policy)
    status, answer = await sc.call(
        envelope(endpoint=endpoint, parameters={"amount": 1250}, timeout=0.05)
    )
    assert status == 428, answer
    assert answer["error"]["code"] == "APPROVAL_PENDING"
    assert upstream.hits == 0


async def test_an_endpoint_beside_the_held_one_is_not_held(
    upstream: FakeUpstream, sidecar_factory: Factory
) -> None:
    policy = compile_policy({"fake-openai": charges_target(upstream.url)}, operators=OPERATORS)
    sc: Sidecar = await sidecar_factory(policy)
    for endpoint in ("/v1/charges2", "/v1/%63harge"):
        status, answer = await sc.call(envelope(endpoint=endpoint, parameters={}, timeout=1))
        assert (status, answer["success"]) == (200, True), answer
    assert [s.path for s in upstream.seen] == ["/v1/charges2", "/v1/charge"]


def test_every_spelling_of_a_path_has_one_name() -> None:
    assert {endpoint_name(e) for e in SPELLINGS} == {"/v1/charges"}
    assert endpoint_name("/") == "/"
    # Reserved and non-ASCII escapes are kept as they are (they mean something else
    # decoded); hex digits are upper-cased (RFC 3986, section 6.2.2.1).
    assert endpoint_name("/a%3ab/%c3%a9") == "/a%3Ab/%C3%A9"
    assert endpoint_name("/a%20b") == "/a%20b"
    request = ExternalCallRequest.model_validate(envelope(endpoint="/v1/%63harges/"))
    assert call_names(request, None) == ["/v1/charges"]


async def test_respelling_the_path_does_not_reset_the_repeat_count(
    upstream: FakeUpstream, sidecar_factory: Factory
) -> None:
    target = openai_target(upstream.url, endpoints=[{"path": "/v1/*", "methods": ["POST"]}])
    policy = compile_policy(
        {"fake-openai": target},
        controls={"repeated_calls": {"max_repeats": 2, "window_s": 60}},
    )
    sc: Sidecar = await sidecar_factory(policy)
    answers = [
        await sc.call(envelope(endpoint=e, parameters={"amount": 1}, timeout=1))
        for e in ("/v1/charges", "/v1/charges/", "/v1/%63harges")
    ]
    assert [status for status, _ in answers] == [200, 200, 429], answers
    assert answers[2][1]["error"]["code"] == "REPEATED_CALL"
    assert upstream.hits == 2


async def test_a_tool_cap_written_with_a_trailing_slash_counts_every_spelling(
    upstream: FakeUpstream, sidecar_factory: Factory
) -> None:
    target = openai_target(upstream.url, endpoints=[{"path": "/v1/*", "methods": ["POST"]}])
    cap = {"max_calls": 1, "window": "daily", "applies_to": {"tool": "/v1/charges/"}}
    policy = compile_policy(
        {"fake-openai": target},
        budgets={"charges": cap},
        controls={"repeat_exempt": ["/v1/jobs/"]},
    )
    assert policy.policy.budgets["charges"].applies_to.tool == "/v1/charges"
    assert policy.policy.controls.repeat_exempt == ["/v1/jobs"]
    sc: Sidecar = await sidecar_factory(policy)
    answers = [
        await sc.call(envelope(endpoint=e, parameters={"amount": n}, timeout=1))
        for n, e in enumerate(("/v1/charges/", "/v1/charges"))
    ]
    assert [status for status, _ in answers] == [200, 429], answers
    assert answers[1][1]["error"]["code"] == "BUDGET_EXCEEDED"
    assert upstream.hits == 1
