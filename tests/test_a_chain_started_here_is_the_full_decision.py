"""A call that comes with no chain, on a sidecar that signs none, starts one through a
short path (:func:`gateway.agents.chain.start`): its decision must be exactly the one
the full rules (:func:`gateway.agents.chain.decide`) make."""

from __future__ import annotations

import pytest

from gateway.agents import chain
from gateway.policy.chain import ChainSpec
from gateway.secrets.base import Secret


@pytest.mark.parametrize("ttl_s", [0.001, 0.5, 30.0, 600.0])
@pytest.mark.parametrize("timeout_s", [0.2, 5.0, 3600.0])
@pytest.mark.parametrize("seen", [None, {}])
def test_a_chain_started_here_is_decided_as_the_rules_decide(
    ttl_s: float, timeout_s: float, seen: dict[str, str] | None
) -> None:
    spec = ChainSpec(ttl_s=ttl_s, max_depth=1)
    now = 1_767_000_000_123
    full = chain.decide(
        seen, own_agent="agent-a", target_agent=None, now_ms=now, timeout_s=timeout_s, spec=spec
    )
    short = chain.start("agent-a", now, timeout_s, spec)
    assert full.error is None
    assert short == full
    assert short is not None
    assert short.headers() == full.headers()


def test_a_ttl_under_a_millisecond_takes_the_full_rules() -> None:
    spec = ChainSpec(ttl_s=0.0004)
    assert chain.start("agent-a", 1_767_000_000_000, 5.0, spec) is None
    full = chain.decide(
        None, own_agent="agent-a", target_agent=None, now_ms=1_767_000_000_000, timeout_s=5.0,
        spec=spec,
    )  # fmt: skip
    assert full.error is not None  # the short path would have let it through


@pytest.mark.parametrize("previous", [None, "the-previous-key"])
@pytest.mark.parametrize("require_signed_inbound", [False, True])
@pytest.mark.parametrize("seen", [None, {}])
def test_a_chain_started_here_on_a_signing_fleet_is_decided_as_the_rules_decide(
    previous: str | None, require_signed_inbound: bool, seen: dict[str, str] | None
) -> None:
    """With the fleet's keys the short path signs the chain it starts exactly as decide()."""
    spec = ChainSpec(
        ttl_s=30.0,
        signing_key_ref="file:///k",
        previous_signing_key_ref="file:///p" if previous else None,
        require_signed_inbound=require_signed_inbound,
    )
    keys = chain.SigningKeys(Secret("the-current-key"), Secret(previous) if previous else None)
    now = 1_767_000_000_123
    full = chain.decide(
        seen, own_agent="agent-a", target_agent=None, now_ms=now, timeout_s=5.0, spec=spec,
        keys=keys,
    )  # fmt: skip
    short = chain.start("agent-a", now, 5.0, spec, keys)
    assert full.error is None
    assert full.signature is not None
    assert short == full
    assert short is not None
    assert short.headers() == full.headers()


def test_a_started_chain_is_signed_as_any_chain_for_every_agent_and_deadline() -> None:
    """The inner state kept per agent (SigningKeys.sign_origin) gives sign()'s signature,
    for more agents than are kept (the states cleared and made again)."""
    key = Secret("the-current-key")
    keys = chain.SigningKeys(key)
    for round_ in range(2):
        for n in range(chain.MAX_ORIGINS + 3):
            agent, deadline = f"agent-{n}", 1_767_000_000_000 + 7 * n + round_
            assert keys.sign_origin(agent, deadline) == keys.sign((agent,), deadline)
            assert keys.sign((agent,), deadline) == chain.sign((agent,), deadline, key)
    assert chain.NO_KEYS.sign_origin("agent-a", 1) is None
