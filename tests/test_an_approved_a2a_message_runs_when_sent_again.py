"""An A2A target's ``approval:`` holds a message to the other agent until a person says
yes, and the same message sent again (same text and message id, same trace) then runs
once: what the approval is bound to is the agent's request, not the call chain the
sidecar writes into the message's ``metadata`` (its deadline differs on every send)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from a2a.client.errors import A2AClientError

from tests.a2a_agents import Agent, agents_fixture, ask  # noqa: F401 - the fixture `agents`
from tests.conftest import Sidecar, compile_policy

OPERATORS = {"alice": {"token_ref": "env://ALICE_TOKEN"}}
TRACE = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}


async def test_an_approved_message_runs_once_when_sent_again(
    agents: Callable[..., Awaitable[Agent]], sidecar_factory: Callable[..., Awaitable[Sidecar]]
) -> None:
    payer = await agents("payer")
    target: dict[str, Any] = {
        "base_url": payer.url,
        "a2a": {"agent_id": "payer"},
        "approval": {"endpoints": [{"path": "/", "methods": ["POST"]}]},
    }
    sc = await sidecar_factory(compile_policy({"payer": target}, agent_id="a", operators=OPERATORS))
    with pytest.raises(A2AClientError, match="approval"):
        await ask(f"{sc.url}/a2a/payer", "pay 10", {**TRACE, "x-egress-timeout": "0.5"})
    assert payer.received == []  # held: nothing reached the agent
    approvals = sc.gateway.pipeline.approvals
    [pending] = [r for r in await approvals.store.recent(10) if r["state"] == "pending"]
    await approvals.decide(pending["id"], "approved", "alice")

    await ask(f"{sc.url}/a2a/payer", "pay 10", {**TRACE, "x-egress-timeout": "2"})
    assert len(payer.received) == 1
    assert pending["arguments"].count("pay 10") == 1  # the person reads the message itself
    assert "x-egress-deadline" not in pending["arguments"]
