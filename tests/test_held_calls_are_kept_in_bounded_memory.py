"""What an approval request keeps of a held call is bounded whatever the agent sends: an
agent may ask for approvals at will, and each request lives in memory (or Redis) until
it expires. Arguments longer than ``MAX_KEPT_ARGUMENTS`` are kept as their start, size
and SHA-256; the approval still covers the whole call, byte for byte."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.agents.approvals import MAX_KEPT_ARGUMENTS
from tests.conftest import FakeUpstream, Sidecar, compile_policy, envelope, openai_target

Factory = Callable[..., Awaitable[Any]]
OPERATORS = {"alice": {"token_ref": "env://ALICE_TOKEN"}}


def held_target(url: str) -> dict[str, Any]:
    return openai_target(url, approval={"endpoints": [{"path": "/v1/chat/*", "methods": ["POST"]}]})


async def _approved(sc: Sidecar, env: dict[str, Any]) -> None:
    status, answer = await sc.call({**env, "timeout": 0.05})
    assert status == 428, answer
    approval_id = answer["error"]["details"]["approval_id"]
    await sc.gateway.pipeline.approvals.decide(approval_id, "approved", "alice")


async def test_a_large_held_call_is_kept_in_bounded_memory_and_still_bound_whole(
    upstream: FakeUpstream, sidecar_factory: Factory
) -> None:
    policy = compile_policy({"fake-openai": held_target(upstream.url)}, operators=OPERATORS)
    sc: Sidecar = await sidecar_factory(policy)
    big = "x" * (1024 * 1024)
    asked = envelope(parameters={"model": "m", "messages": [{"role": "user", "content": big}]})
    await _approved(sc, asked)
    [record] = await sc.gateway.pipeline.approvals.store.recent(10)
    assert len(record["arguments"]) < MAX_KEPT_ARGUMENTS + 1024  # not the megabyte
    ops_view = json.loads(record["arguments"])
    assert ops_view["truncated"] is True
    assert ops_view["chars"] > 1024 * 1024
    # The approval still covers the whole call: another last byte is another call.
    changed = envelope(
        parameters={"model": "m", "messages": [{"role": "user", "content": big[:-1] + "y"}]}
    )
    status, _ = await sc.call({**changed, "timeout": 0.05})
    assert status == 428
    status, answer = await sc.call({**asked, "timeout": 2})
    assert (status, answer["success"]) == (200, True), answer
    assert upstream.hits == 1
