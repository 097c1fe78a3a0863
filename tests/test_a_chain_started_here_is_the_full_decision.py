"""A call that comes with no chain, on a sidecar that signs none, starts one through a
short path (:func:`gateway.agents.chain.start`): its decision must be exactly the one
the full rules (:func:`gateway.agents.chain.decide`) make."""

from __future__ import annotations

import pytest

from gateway.agents import chain
from gateway.policy.chain import ChainSpec


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
