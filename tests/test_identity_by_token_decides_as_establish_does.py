"""identify()'s shortcut for a token without a claim (an identity made once per agent)
decides what establish() decides, for every token and claim, over plain and multi-valued
headers."""

from __future__ import annotations

import dataclasses
import itertools

from multidict import CIMultiDict

from gateway.agents.identity import (
    CLAIM_HEADER,
    TOKEN_HEADER,
    Identity,
    Seen,
    build_agents,
    establish,
    identify,
)

AGENTS = build_agents(
    "sidecar",
    [
        ("planner", None, "planner-token-0001", None),
        ("executor", None, "executor-token-0002", ["openai"]),
        ("twin", None, "executor-token-0002", None),  # same token: the last one wins
        ("no-token", None, None, None),
    ],
)
TOKENS = [None, "planner-token-0001", "executor-token-0002", "nobody-token", ""]
CLAIMS = [None, "planner", "twin", "someone"]


def same(a: Identity, b: Identity) -> bool:
    """Equal identities, refusals compared by their message and details."""
    ra, rb = a.refusal, b.refusal
    if (ra is None) != (rb is None):
        return False
    if ra is not None and rb is not None and (str(ra) != str(rb) or ra.details != rb.details):
        return False
    return dataclasses.replace(a, refusal=None) == dataclasses.replace(b, refusal=None)


def test_every_token_and_claim_is_decided_as_establish_decides() -> None:
    for token, claim in itertools.product(TOKENS, CLAIMS):
        headers = {k: v for k, v in ((TOKEN_HEADER, token), (CLAIM_HEADER, claim)) if v is not None}
        got = identify(None, headers, AGENTS)
        want = establish(Seen("tcp", None, token, claim), AGENTS)
        assert same(got, want), (token, claim, got, want)


def test_a_known_token_gives_its_agent_and_the_same_identity_each_call() -> None:
    first = identify(None, {TOKEN_HEADER: "executor-token-0002"}, AGENTS)
    assert (first.agent_id, first.agent_auth, first.refusal) == ("twin", "token", None)
    assert identify(None, {TOKEN_HEADER: "executor-token-0002"}, AGENTS) is first


def test_a_repeated_token_header_is_refused_as_before() -> None:
    headers: CIMultiDict[str] = CIMultiDict(
        [(TOKEN_HEADER, "planner-token-0001"), (TOKEN_HEADER, "executor-token-0002")]
    )
    got = identify(None, headers, AGENTS)
    assert got.refusal is not None
    assert got.refusal.details["reason"] == "unknown_agent"
    want = establish(Seen("tcp", None, "planner-token-0001,executor-token-0002", None), AGENTS)
    assert same(got, want)
    twice: CIMultiDict[str] = CIMultiDict(
        [(TOKEN_HEADER, "planner-token-0001"), (TOKEN_HEADER, "planner-token-0001")]
    )
    assert identify(None, twice, AGENTS).agent_id == "planner"  # the same value twice: one
