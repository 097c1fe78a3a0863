"""The repeated-call breaker counts an A2A message by what it says (method and params),
not by what changes on every send (the JSON-RPC id, the message id, the call chain the
sidecar writes into its ``metadata``): two agents sending each other the same message
in a loop of new traces are stopped at ``max_repeats``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
from a2a.client.errors import A2AClientError

from tests.a2a_agents import Agent, agents_fixture, ask  # noqa: F401 - the fixture `agents`
from tests.conftest import Sidecar, compile_policy


async def test_the_same_message_past_max_repeats_is_refused(
    agents: Callable[..., Awaitable[Agent]], sidecar_factory: Callable[..., Awaitable[Sidecar]]
) -> None:
    peer = await agents("peer")
    target = {"base_url": peer.url, "a2a": {"agent_id": "peer"}}
    controls = {"repeated_calls": {"max_repeats": 2, "window_s": 60}}
    sc = await sidecar_factory(compile_policy({"peer": target}, agent_id="a", controls=controls))
    for _ in range(2):
        await ask(f"{sc.url}/a2a/peer", "same again")
    with pytest.raises(A2AClientError, match="same call"):
        await ask(f"{sc.url}/a2a/peer", "same again")
    assert len(peer.received) == 2
    await ask(f"{sc.url}/a2a/peer", "something else")  # another message: counted apart
    assert len(peer.received) == 3
