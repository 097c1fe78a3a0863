"""The call chain's rules (gateway.agents.chain), table-driven and without sockets: how a
received chain is read, extended, signed and refused, and the refusal's shape."""

from __future__ import annotations

import base64
import hashlib
import hmac
import typing
from typing import Any

import pytest

from gateway.agents import chain as chains
from gateway.agents.chain import (
    AGENT_ID,
    CHAIN_HEADER,
    DEADLINE_HEADER,
    MAX_CHAIN_AGENTS,
    MAX_CHAIN_BYTES,
    NO_KEYS,
    SIGNATURE_HEADER,
    ChainDecision,
    SigningKeys,
    decide,
    sign,
)
from gateway.envelope import CallChain, ErrorCode
from gateway.errors import CallChainRefused
from gateway.policy.chain import ChainSpec
from gateway.policy.models import Name
from gateway.secrets.base import Secret

NOW = 1_800_000_000_000  # Unix ms
SPEC = ChainSpec()  # max_depth 8, ttl_s 900, max_clock_skew_s 5
TTL_MS = 900_000
LATER = NOW + 60_000
KEY, OLD, OTHER = Secret("fleet-key-2"), Secret("fleet-key-1"), Secret("not-the-fleet")
KEYS = SigningKeys(KEY, OLD)


def run(
    seen: Any,
    *,
    own: str = "me",
    target: str | None = None,
    spec: ChainSpec = SPEC,
    keys: SigningKeys = NO_KEYS,
    timeout_s: float = 30.0,
) -> ChainDecision:
    return decide(
        seen,
        own_agent=own,
        target_agent=target,
        now_ms=NOW,
        timeout_s=timeout_s,
        spec=spec,
        keys=keys,
    )


def headers(chain: str | None = None, deadline: Any = LATER, sig: str | None = None) -> dict:
    out = {}
    if chain is not None:
        out[CHAIN_HEADER] = chain
    if deadline is not None:
        out[DEADLINE_HEADER] = str(deadline)
    if sig is not None:
        out[SIGNATURE_HEADER] = sig
    return out


def signed(agents: list[str], deadline: int = LATER, key: Secret = KEY) -> dict[str, str]:
    return headers(",".join(agents), deadline, sign(agents, deadline, key))


# -- accepted -------------------------------------------------------------------------------

ACCEPTED: list[tuple[str, Any, dict[str, Any], tuple[str, ...], int]] = [
    ("no chain: this call starts one", {}, {}, ("me",), NOW + TTL_MS),
    ("no envelope chain either", None, {}, ("me",), NOW + TTL_MS),
    ("headers: extended", headers("a,b"), {}, ("a", "b", "me"), LATER),
    ("blanks around ids", headers(" a ,\tb"), {}, ("a", "b", "me"), LATER),
    ("envelope field", CallChain(agents=["a", "b"], deadline_ms=LATER), {},
     ("a", "b", "me"), LATER),
    ("chain without a deadline: ttl from now", headers("a", None), {}, ("a", "me"), NOW + TTL_MS),
    ("deadline within ttl + skew", headers("a", NOW + TTL_MS + 5000), {}, ("a", "me"),
     NOW + TTL_MS + 5000),
    ("depth exactly max_depth", headers(",".join(f"a{i}" for i in range(7))), {},
     (*(f"a{i}" for i in range(7)), "me"), LATER),
    ("64 ids with max_depth 64", headers(",".join(f"a{i}" for i in range(63))),
     {"spec": ChainSpec(max_depth=64)}, (*(f"a{i}" for i in range(63)), "me"), LATER),
    ("another target agent", headers("a"), {"target": "b"}, ("a", "me"), LATER),
    ("a signature without a key is ignored", headers("a", sig="v1=forged"), {}, ("a", "me"), LATER),
    ("unsigned with a key, not required", headers("a"), {"keys": KEYS}, ("a", "me"), LATER),
    ("signed with the current key", signed(["a"]), {"keys": KEYS}, ("a", "me"), LATER),
    ("signed with the previous key", signed(["a"], key=OLD), {"keys": KEYS}, ("a", "me"), LATER),
    ("signed, required", signed(["a", "b"]),
     {"keys": KEYS, "spec": ChainSpec(require_signed_inbound=True, signing_key_ref="env://K")},
     ("a", "b", "me"), LATER),
    ("no chain at all, signing required: an origin", {},
     {"keys": KEYS, "spec": ChainSpec(require_signed_inbound=True, signing_key_ref="env://K")},
     ("me",), NOW + TTL_MS),
]  # fmt: skip


@pytest.mark.parametrize(
    ("seen", "kw", "agents", "deadline"),
    [case[1:] for case in ACCEPTED],
    ids=[case[0] for case in ACCEPTED],
)
def test_accepted_chains_are_extended(
    seen: Any, kw: dict[str, Any], agents: tuple[str, ...], deadline: int
) -> None:
    decision = run(seen, **kw)
    assert decision.error is None
    assert decision.agents == agents
    assert decision.depth == len(agents)
    assert decision.deadline_ms == deadline
    sent = decision.headers()
    assert sent[CHAIN_HEADER] == ",".join(agents)
    assert sent[DEADLINE_HEADER] == str(deadline)
    keys = kw.get("keys", NO_KEYS)
    if keys.current is None:
        assert SIGNATURE_HEADER not in sent
    else:  # re-signed over the whole extended chain with the current key
        assert sent[SIGNATURE_HEADER] == sign(agents, deadline, KEY)


def test_the_calls_deadline_is_the_earlier_of_its_timeout_and_the_chains() -> None:
    assert run(headers("a", NOW + 2_500), timeout_s=30).remaining_s == 2.5
    assert run(headers("a", NOW + 60_000), timeout_s=30).remaining_s == 30
    assert run({}, timeout_s=30).remaining_s == 30


# -- refused --------------------------------------------------------------------------------

REQUIRE = {"keys": KEYS, "spec": ChainSpec(require_signed_inbound=True, signing_key_ref="env://K")}
REFUSED: list[tuple[str, Any, dict[str, Any], str, list[str] | None]] = [
    ("own agent already in the chain", headers("me,b"), {}, "circular_call_detected",
     ["me", "b", "me"]),
    ("own agent in it, calling another agent", headers("me,b"), {"target": "c"},
     "circular_call_detected", ["me", "b", "me"]),
    ("target agent already in the chain", headers("a,b"), {"target": "a"},
     "circular_call_detected", ["a", "b", "me", "a"]),
    ("envelope: own agent in it", CallChain(agents=["x", "me"]), {}, "circular_call_detected",
     ["x", "me", "me"]),
    ("one past max_depth", headers(",".join(f"a{i}" for i in range(8))), {}, "max_depth_exceeded",
     [*(f"a{i}" for i in range(8)), "me"]),
    ("max_depth 1: nobody may call on", headers("a"), {"spec": ChainSpec(max_depth=1)},
     "max_depth_exceeded", ["a", "me"]),
    ("deadline passed", headers("a", NOW - 1), {}, "ttl_expired", ["a", "me"]),
    ("deadline is now", headers("a", NOW), {}, "ttl_expired", ["a", "me"]),
    ("envelope deadline passed", CallChain(agents=["a"], deadline_ms=-5), {}, "ttl_expired",
     ["a", "me"]),
    ("more than 64 ids", headers(",".join(f"a{i}" for i in range(MAX_CHAIN_AGENTS + 1))),
     {"spec": ChainSpec(max_depth=64)}, "invalid_chain", None),
    ("over 8 KiB", headers(",".join(["a" * 63] * 10) + "," + "b" * MAX_CHAIN_BYTES), {},
     "invalid_chain", None),
    ("envelope over 64 ids", CallChain(agents=[f"a{i}" for i in range(65)]), {},
     "invalid_chain", None),
    ("envelope over 8 KiB", CallChain(agents=["a" * 64] * 130), {}, "invalid_chain", None),
    ("an id with a space", headers("a,b c"), {}, "invalid_chain", None),
    ("an id with a control character", headers("a,b\x1bc"), {}, "invalid_chain", None),
    ("an id not ASCII", headers("a,\u00e9t\u00e9"), {}, "invalid_chain", None),
    ("an id of 65 characters", headers("a" * 65), {}, "invalid_chain", None),
    ("an id starting with '-'", headers("-a"), {}, "invalid_chain", None),
    ("an empty entry", headers("a,,b"), {}, "invalid_chain", None),
    ("an empty header", headers(""), {}, "invalid_chain", None),
    ("envelope: empty list", CallChain(agents=[]), {}, "invalid_chain", None),
    ("envelope: bad id", CallChain(agents=["a", "x/y"]), {}, "invalid_chain", None),
    ("deadline not a number", headers("a", "soon"), {}, "invalid_chain", None),
    ("deadline negative", headers("a", "-1"), {}, "invalid_chain", None),
    ("deadline fractional", headers("a", "1800000000000.5"), {}, "invalid_chain", None),
    ("deadline of 17 digits", headers("a", "1" * 17), {}, "invalid_chain", None),
    ("deadline without a chain", headers(None, LATER), {}, "invalid_chain", None),
    ("deadline far in the future", headers("a", NOW + TTL_MS + 5001), {}, "invalid_chain", None),
    ("envelope deadline far in the future", CallChain(agents=["a"], deadline_ms=10**18), {},
     "invalid_chain", None),
    ("forged: an id changed", {**signed(["a", "b"]), CHAIN_HEADER: "a,c"}, {"keys": KEYS},
     "invalid_chain", None),
    ("truncated: the origin dropped", {**signed(["a", "b"]), CHAIN_HEADER: "b"}, {"keys": KEYS},
     "invalid_chain", None),
    ("truncated: the last dropped", {**signed(["a", "b"]), CHAIN_HEADER: "a"}, {"keys": KEYS},
     "invalid_chain", None),
    ("reordered", {**signed(["a", "b"]), CHAIN_HEADER: "b,a"}, {"keys": KEYS}, "invalid_chain",
     None),
    ("deadline moved", {**signed(["a"]), DEADLINE_HEADER: str(LATER + 1)}, {"keys": KEYS},
     "invalid_chain", None),
    ("deadline dropped", {k: v for k, v in signed(["a"]).items() if k != DEADLINE_HEADER},
     {"keys": KEYS}, "invalid_chain", None),
    ("signed with another key", signed(["a"], key=OTHER), {"keys": KEYS}, "invalid_chain", None),
    ("signed with a retired key", signed(["a"], key=OLD), {"keys": SigningKeys(KEY)},
     "invalid_chain", None),
    ("malformed signature", headers("a", sig="v1=short"), {"keys": KEYS}, "invalid_chain", None),
    ("unsigned, signing required", headers("a"), REQUIRE, "invalid_chain", None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("seen", "kw", "reason", "chain"),
    [case[1:] for case in REFUSED],
    ids=[case[0] for case in REFUSED],
)
def test_refused_chains(
    seen: Any, kw: dict[str, Any], reason: str, chain: list[str] | None
) -> None:
    decision = run(seen, **kw)
    error = decision.error
    assert isinstance(error, CallChainRefused)
    assert (error.code, error.http_status, error.retryable) == (
        ErrorCode.CALL_CHAIN_REFUSED,
        409,
        False,
    )
    assert error.details == {"reason": reason, "call_chain": chain}
    assert error.message.startswith(f"call chain refused ({reason}): ")
    assert decision.headers() == {}
    payload = error.to_payload()
    assert payload.details["reason"] == reason
    assert payload.retryable is False


def test_a_bad_id_is_never_echoed() -> None:
    decision = run(headers("a,\x1b[31mred"))
    assert decision.error is not None
    assert "\x1b" not in decision.error.message
    assert "red" not in decision.error.message
    assert "entry 2 of x-egress-call-chain" in decision.error.message


def test_the_checks_run_in_order() -> None:
    # Circular beats depth beats an expired deadline; an unreadable chain beats them all.
    loop_deep_stale = headers(",".join(["me", *(f"a{i}" for i in range(9))]), NOW - 1)
    assert run(loop_deep_stale).error.details["reason"] == "circular_call_detected"  # type: ignore[union-attr]
    deep_stale = headers(",".join(f"a{i}" for i in range(9)), NOW - 1)
    assert run(deep_stale).error.details["reason"] == "max_depth_exceeded"  # type: ignore[union-attr]
    forged_loop = {**signed(["me"]), CHAIN_HEADER: "me,x"}
    assert run(forged_loop, keys=KEYS).error.details["reason"] == "invalid_chain"  # type: ignore[union-attr]


def test_every_reason_is_documented() -> None:
    from gateway.agents.chain import REASONS, Reason

    assert set(REASONS) == set(typing.get_args(Reason))
    assert {case[3] for case in REFUSED} == set(REASONS)


def test_an_agent_id_is_written_as_the_policys_agent_id() -> None:
    [constraint] = [m for m in typing.get_args(Name)[1:] if hasattr(m, "pattern")]
    assert f"^{AGENT_ID.pattern}$" == constraint.pattern


def test_signing_keys_do_not_show_themselves() -> None:
    assert "fleet-key" not in repr(KEYS)
    assert "fleet-key" not in repr(run(signed(["a"]), keys=KEYS))


@pytest.mark.parametrize(
    ("seen", "says"),
    [
        (headers("a," * 5000), "x-egress-call-chain is longer than 8192 bytes"),
        (headers(",".join(f"a{i}" for i in range(65))), "has more than 64 agent ids"),
        (CallChain(agents=["a" * 64] * 130), "call_chain.agents is longer than 8192 bytes"),
        (headers("a", "soon"), "x-egress-deadline is not Unix milliseconds"),
        (headers(None, LATER), "x-egress-deadline without x-egress-call-chain"),
        (headers("a", NOW + 10**9), "further ahead than chain.ttl_s allows"),
        (CallChain(agents=[]), "call_chain.agents is empty"),
    ],
)
def test_an_unreadable_chain_says_why(seen: Any, says: str) -> None:
    error = run(seen).error
    assert error is not None
    assert says in error.message


def test_a_signature_is_the_base64url_hmac_sha256_of_the_canonical_bytes() -> None:
    """sign() (C calls only) equals the HMAC-SHA256 made with the stdlib's hmac.new and
    base64.urlsafe_b64encode, unpadded, for keys and chains of every length class."""
    for n in range(1, 70):
        key = ("k+/=" * n)[:n]
        agents = tuple(f"agent-{i}" for i in range(1 + n % 5))
        deadline = 1_700_000_000_000 + n * 7919
        mac = hmac.new(key.encode(), chains.canonical(agents, deadline), hashlib.sha256).digest()
        expected = "v1=" + base64.urlsafe_b64encode(mac).rstrip(b"=").decode()
        assert chains.sign(agents, deadline, Secret(key)) == expected


def test_the_chain_headers_sent_are_the_sidecars_whatever_the_agent_set() -> None:
    """with_headers: the agent's own chain headers (any case) are dropped, every other
    header kept, and the decision's headers added; without any, the headers are kept
    as they are plus the chain's."""
    decision = ChainDecision(received=(), agents=("a",), deadline_ms=123, signature=None)
    own = {"x-egress-call-chain": "a", "x-egress-deadline": "123"}
    plain = {"traceparent": "00-x", "Authorization": "Bearer k"}
    assert chains.with_headers(plain, decision) == {**plain, **own}
    forged = {
        **plain,
        "X-Egress-Call-Chain": "evil",
        "X-EGRESS-DEADLINE": "9",
        "x-egress-call-chain-sig": "v1=x",
    }
    assert chains.with_headers(forged, decision) == {**plain, **own}
    assert chains.with_headers({}, decision) == own
