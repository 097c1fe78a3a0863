"""An approval covers the call a person saw and nothing else: besides its arguments,
the headers the agent has forwarded upstream (``forward_headers``: an account header
moves a charge to another account) and the secret reference it picked among the
target's ``allowed_refs`` (another key acts as another account) are part of what it is
bound to. The same call with another value is a new request, and nothing is sent;
trace headers, which change on every send, are not."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from tests.conftest import FakeUpstream, Sidecar, compile_policy, envelope, openai_target

Factory = Callable[..., Awaitable[Any]]
OPERATORS = {"alice": {"token_ref": "env://ALICE_TOKEN"}}
KEYS = ["env://TEST_OPENAI_KEY", "env://TEST_OTHER_KEY"]


@pytest.fixture(autouse=True)
def _other_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_OTHER_KEY", "sk-fake-TEST-0099-NOTREAL")


def _target(url: str) -> dict[str, Any]:
    return openai_target(
        url,
        credential={
            "header": "Authorization",
            "format": "Bearer {secret}",
            "default_ref": KEYS[0],
            "allowed_refs": KEYS,
        },
        forward_headers=["x-account"],
        approval={"endpoints": [{"path": "/v1/chat/*", "methods": ["POST"]}]},
    )


async def _approved(sc: Sidecar, env: dict[str, Any]) -> None:
    status, answer = await sc.call({**env, "timeout": 0.05})
    assert status == 428, answer
    approval_id = answer["error"]["details"]["approval_id"]
    await sc.gateway.pipeline.approvals.decide(approval_id, "approved", "alice")


@pytest.mark.parametrize(
    "changed",
    [
        {"headers": {"x-account": "acct_B"}},
        {"headers": {}},
        {"api_key_ref": KEYS[1]},
    ],
    ids=["another-header-value", "header-left-out", "another-key"],
)
async def test_an_approval_does_not_cover_another_header_or_key(
    changed: dict[str, Any], upstream: FakeUpstream, sidecar_factory: Factory
) -> None:
    policy = compile_policy({"fake-openai": _target(upstream.url)}, operators=OPERATORS)
    sc: Sidecar = await sidecar_factory(policy)
    asked = envelope(headers={"x-account": "acct_A"}, api_key_ref=KEYS[0])
    await _approved(sc, asked)
    status, answer = await sc.call({**asked, **changed, "timeout": 0.05})
    assert status == 428, answer
    assert answer["error"]["code"] == "APPROVAL_PENDING"
    assert upstream.hits == 0
    # The call that was approved still runs, once.
    status, answer = await sc.call({**asked, "timeout": 2})
    assert (status, answer["success"]) == (200, True), answer
    assert upstream.hits == 1
    assert upstream.seen[0].headers["x-account"] == "acct_A"


async def test_a_new_traceparent_is_the_same_call(
    upstream: FakeUpstream, sidecar_factory: Factory
) -> None:
    policy = compile_policy({"fake-openai": _target(upstream.url)}, operators=OPERATORS)
    sc: Sidecar = await sidecar_factory(policy)
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    asked = envelope(
        trace_id=trace,
        headers={"x-account": "acct_A", "traceparent": f"00-{trace}-00f067aa0ba902b7-01"},
    )
    await _approved(sc, asked)
    resent = {**asked, "headers": {**asked["headers"]}, "timeout": 2}
    resent["headers"]["traceparent"] = f"00-{trace}-b7ad6b7169203331-01"
    status, answer = await sc.call(resent)
    assert (status, answer["success"]) == (200, True), answer
    assert upstream.hits == 1
