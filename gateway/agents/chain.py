"""The call chain of agents calling agents: read, check, extend and sign it (pure, no I/O).

design.md, "Agents calling agents". Every outbound call carries its chain::

    x-egress-call-chain: planner-01,executor-02     agent ids, origin first
    x-egress-deadline: 1764612345678                absolute, Unix milliseconds
    x-egress-call-chain-sig: v1=<43 base64url>      with a signing key only

An agent passes on the chain it received (those headers on a drop-in or MCP call, or
the envelope's ``call_chain``). :func:`decide` is the whole per-call rule: it reads what
the call came with, appends this sidecar's agent and answers a frozen
:class:`ChainDecision`: the chain and deadline to send, or a
:class:`~gateway.errors.CallChainRefused` whose ``details.reason`` is, checked in order:

* ``invalid_chain``: unreadable (over :data:`MAX_CHAIN_AGENTS` ids or
  :data:`MAX_CHAIN_BYTES` bytes, an id that is not an agent id, an empty entry, a
  deadline that is not a number, a deadline without a chain, a deadline more than
  ``chain.ttl_s + chain.max_clock_skew_s`` ahead: a far-future deadline is refused, not
  clamped, since only a broken or lying sender writes one), or its signature fails;
* ``circular_call_detected``: the target agent or this sidecar's own agent is already in
  the chain (the target agent when the target is an agent);
* ``max_depth_exceeded``: the chain with this agent would be longer than
  ``chain.max_depth`` (depth: agents in the chain, this one included; an origin call is 1);
* ``ttl_expired``: the chain's deadline has passed.

A call with no chain starts one: its deadline is now + ``chain.ttl_s`` (as is that of a
received chain without a deadline, which only an unsigned chain can be). The call's own
deadline is the earlier of its ``timeout`` and the chain's (:attr:`ChainDecision.
remaining_s`); the chain goes on with the chain's deadline, not the call's, since a
task the call starts may outlive the call.

Signing (``chain.signing_key_ref``, a key the fleet shares): each sidecar that extends a
chain signs the whole chain and its deadline (HMAC-SHA256 over :func:`canonical`), so a
forged, truncated or reordered chain, or a changed deadline, fails verification against
the current key and the previous one (``previous_signing_key_ref``: two keys accepted
during a rotation; only the current one signs). A chain without a signature is taken as
given unless ``chain.require_signed_inbound``. Without a key chains are unsigned and
taken as given (one trust domain), and a received signature is ignored.
"""

from __future__ import annotations

import binascii
import functools
import hashlib
import hmac
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, NamedTuple

from gateway.envelope import CallChain
from gateway.errors import CallChainRefused
from gateway.policy.chain import ChainSpec
from gateway.secrets.base import Secret

CHAIN_HEADER: Final = "x-egress-call-chain"
DEADLINE_HEADER: Final = "x-egress-deadline"
SIGNATURE_HEADER: Final = "x-egress-call-chain-sig"
#: The chain's headers (lower case): the sidecar writes them, never passes the agent's on.
CHAIN_HEADERS: Final = frozenset({CHAIN_HEADER, DEADLINE_HEADER, SIGNATURE_HEADER})
#: Their lengths: a name of none of them is none of them, whatever its case (the one
#: character whose lower case is longer, U+0130, lowers to a non-ASCII pair), which is
#: told without lower-casing each name (:func:`with_headers`).
_CHAIN_HEADER_LENGTHS: Final = frozenset(map(len, CHAIN_HEADERS))
#: Bounds of a received chain (the issue's): far past any sane depth, and small enough
#: for every proxy's header limit.
MAX_CHAIN_AGENTS: Final = 64
MAX_CHAIN_BYTES: Final = 8 * 1024
#: An agent id, as the policy's ``agent_id`` is written (gateway.policy.models.Name): no
#: comma, space or control character can hide in one.
AGENT_ID: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")
_DEADLINE: Final = re.compile(r"[0-9]{1,16}")
SIGNATURE_PREFIX: Final = "v1="
_SIGNATURE: Final = re.compile(r"v1=[A-Za-z0-9_\-]{43}")
#: Base64 to base64url (RFC 4648, section 5), as base64.urlsafe_b64encode does.
_URLSAFE: Final = bytes.maketrans(b"+/", b"-_")
#: SHA-256's block size and HMAC's pads (RFC 2104), as translation tables of a key block.
_SHA256_BLOCK: Final = 64
_IPAD: Final = bytes(x ^ 0x36 for x in range(256))
#: The agents whose started chains :meth:`SigningKeys.sign_origin` keeps a state for
#: (a sidecar signs for its one ``agent_id``; past this: cleared).
MAX_ORIGINS: Final = 16
_OPAD: Final = bytes(x ^ 0x5C for x in range(256))

Reason = Literal["circular_call_detected", "max_depth_exceeded", "ttl_expired", "invalid_chain"]
REASONS: Final[tuple[Reason, ...]] = (
    "circular_call_detected",
    "max_depth_exceeded",
    "ttl_expired",
    "invalid_chain",
)


@dataclass(frozen=True, slots=True)
class SigningKeys:
    """The fleet's chain keys, resolved from ``chain.signing_key_ref`` (``current``, which
    signs) and ``previous_signing_key_ref`` (still accepted); none: chains unsigned.
    The current key's HMAC states are made once, here (:meth:`sign`)."""

    current: Secret | None = None
    previous: Secret | None = None
    _states: tuple[Any, Any] | None = field(init=False, repr=False, compare=False)
    #: Per agent, the inner hash state after the canonical bytes of a chain it starts,
    #: up to its deadline (:meth:`sign_origin`): the same for every chain it starts, so
    #: fed once, not per call. Dies with the keys (a rotated key makes new ones).
    _origins: dict[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        states = None if self.current is None else _hmac_states(self.current.reveal().encode())
        object.__setattr__(self, "_states", states)
        object.__setattr__(self, "_origins", {})

    def sign(self, agents: Sequence[str], deadline_ms: int | None) -> str | None:
        """:func:`sign` with the current key (None: no key, chains unsigned)."""
        states = self._states
        return None if states is None else _signed(states, agents, deadline_ms)

    def sign_origin(self, own_agent: str, deadline_ms: int) -> str | None:
        """:meth:`sign` of the chain ``(own_agent,)`` (one this agent starts): the same
        signature, from the inner state kept for the agent."""
        states = self._states
        if states is None:
            return None
        origins = self._origins
        inner = origins.get(own_agent)
        if inner is None:
            if len(origins) >= MAX_ORIGINS:
                origins.clear()
            inner = origins[own_agent] = states[0].copy()
            inner.update(_CANONICAL_V1 + own_agent.encode("ascii") + b"\n")
        inner = inner.copy()
        inner.update(str(deadline_ms).encode("ascii"))
        return _finished(states[1], inner)


NO_KEYS: Final = SigningKeys()


@dataclass(frozen=True, slots=True)
class Received:
    """The chain a call came with: ``agents`` (None: none came), ``deadline_ms``,
    ``signature``; ``problem`` says why it could not be read (then ``invalid_chain``)."""

    agents: tuple[str, ...] | None = None
    deadline_ms: int | None = None
    signature: str | None = None
    problem: str | None = None


class ChainDecision(NamedTuple):
    """What :func:`decide` made of a call's chain.

    ``received``: the agents the call came with (empty: it starts a chain); ``agents``:
    the chain with this agent appended (what goes out; for a refusal, the chain that was
    refused; empty when unreadable); ``deadline_ms``: the chain's deadline (absolute,
    Unix ms); ``signature``: of the chain sent (None: unsigned); ``verified``: the
    received chain's signature was checked; ``remaining_s``: seconds the call may take
    (the earlier of its timeout and the chain's deadline); ``error``: the refusal, or None.

    A named tuple, immutable as a frozen dataclass is, because one is made on every call
    and a frozen dataclass's ``__init__`` (an ``object.__setattr__`` per field) costs
    three times a tuple's construction.
    """

    received: tuple[str, ...]
    agents: tuple[str, ...]
    deadline_ms: int | None
    signature: str | None = None
    verified: bool = False
    remaining_s: float = 0.0
    error: CallChainRefused | None = None

    @property
    def depth(self) -> int:
        """Agents in the chain, this one included (0 when the chain was unreadable)."""
        return len(self.agents)

    def headers(self) -> dict[str, str]:
        """The chain's outbound headers (empty for a refusal)."""
        deadline = self.deadline_ms
        if self.error is not None or deadline is None:
            return {}
        if self.signature is None:
            return {CHAIN_HEADER: ",".join(self.agents), DEADLINE_HEADER: str(deadline)}
        return {
            CHAIN_HEADER: ",".join(self.agents),
            DEADLINE_HEADER: str(deadline),
            SIGNATURE_HEADER: self.signature,
        }


def canonical(agents: Sequence[str], deadline_ms: int | None) -> bytes:
    """The bytes a chain's signature covers: a version line, the ids joined by commas,
    the deadline (empty when none). Unambiguous: an agent id holds no comma or newline."""
    deadline = "" if deadline_ms is None else str(deadline_ms)
    return f"egress-call-chain/v1\n{','.join(agents)}\n{deadline}".encode("ascii")


#: :func:`canonical`'s version line.
_CANONICAL_V1: Final = b"egress-call-chain/v1\n"


def sign(agents: Sequence[str], deadline_ms: int | None, key: Secret) -> str:
    """``v1=`` and the unpadded base64url HMAC-SHA256 (RFC 2104) of :func:`canonical`
    (the key's hash states kept, :func:`_hmac_states`; tested equal to :mod:`hmac`'s)."""
    return _signed(_hmac_states(key.reveal().encode()), agents, deadline_ms)


def _signed(states: tuple[Any, Any], agents: Sequence[str], deadline_ms: int | None) -> str:
    inner = states[0].copy()
    inner.update(canonical(agents, deadline_ms))
    return _finished(states[1], inner)


def _finished(outer_state: Any, inner: Any) -> str:
    """The signature of the HMAC whose inner hash has been fed: ``v1=`` and the outer
    digest in unpadded base64url (a SHA-256's 32 bytes: 43 characters and one ``=``)."""
    outer = outer_state.copy()
    outer.update(inner.digest())
    text = binascii.b2a_base64(outer.digest(), newline=False)
    return SIGNATURE_PREFIX + text[:43].translate(_URLSAFE).decode()


@functools.lru_cache(maxsize=4)  # the fleet's current and previous keys
def _hmac_states(key: bytes) -> tuple[Any, Any]:
    """HMAC-SHA256's inner and outer hash states after ``key``'s padded blocks (RFC 2104):
    each signature copies them, as OpenSSL's HMAC init per call costs twice the rest."""
    block = hashlib.sha256(key).digest() if len(key) > _SHA256_BLOCK else key
    block = block.ljust(_SHA256_BLOCK, b"\0")
    inner = hashlib.sha256(block.translate(_IPAD))
    outer = hashlib.sha256(block.translate(_OPAD))
    return inner, outer


def verify(received: Received, keys: SigningKeys) -> bool:
    """True if ``received`` carries a well-formed signature made with either key."""
    given = received.signature
    if given is None or received.agents is None or not _SIGNATURE.fullmatch(given):
        return False
    for key in (keys.current, keys.previous):
        if key is not None:
            expected = sign(received.agents, received.deadline_ms, key)
            if hmac.compare_digest(expected.encode(), given.encode()):
                return True
    return False


def from_headers(headers: Mapping[str, str]) -> Received:
    """The chain in request ``headers`` (lower-case names; a repeated header's values
    joined with ``", "``, which reads as one list)."""
    chain, deadline = headers.get(CHAIN_HEADER), headers.get(DEADLINE_HEADER)
    signature = headers.get(SIGNATURE_HEADER)
    if chain is None:
        problem = f"{DEADLINE_HEADER} without {CHAIN_HEADER}" if deadline is not None else None
        return Received(problem=problem)
    if len(chain.encode("utf-8", "surrogateescape")) > MAX_CHAIN_BYTES:
        return Received(problem=f"{CHAIN_HEADER} is longer than {MAX_CHAIN_BYTES} bytes")
    agents = [entry.strip(" \t") for entry in chain.split(",")]
    deadline_ms = None
    if deadline is not None:
        if not _DEADLINE.fullmatch(deadline.strip(" \t")):
            return Received(problem=f"{DEADLINE_HEADER} is not Unix milliseconds")
        deadline_ms = int(deadline)
    return _checked(agents, deadline_ms, signature, CHAIN_HEADER)


def from_envelope(chain: CallChain | None) -> Received:
    """The chain in an envelope's ``call_chain`` (None: none came)."""
    if chain is None:
        return Received()
    if sum(len(a.encode("utf-8", "surrogateescape")) + 1 for a in chain.agents) > MAX_CHAIN_BYTES:
        return Received(problem=f"call_chain.agents is longer than {MAX_CHAIN_BYTES} bytes")
    return _checked(chain.agents, chain.deadline_ms, chain.signature, "call_chain.agents")


def _checked(
    agents: Sequence[str], deadline_ms: int | None, signature: str | None, where: str
) -> Received:
    if len(agents) > MAX_CHAIN_AGENTS:
        return Received(problem=f"{where} has more than {MAX_CHAIN_AGENTS} agent ids")
    if not agents:
        return Received(problem=f"{where} is empty (leave it out to start a chain)")
    for index, agent in enumerate(agents, 1):
        if not AGENT_ID.fullmatch(agent):  # never echoed: it may be anything
            return Received(
                problem=f"entry {index} of {where} is not an agent id (letters, digits, "
                "'_', '.', '-'; at most 64 characters, starting with a letter or digit)"
            )
    return Received(tuple(agents), deadline_ms, signature)


def decide(
    seen: Mapping[str, str] | CallChain | None,
    *,
    own_agent: str,
    target_agent: str | None,
    now_ms: int,
    timeout_s: float,
    spec: ChainSpec,
    keys: SigningKeys = NO_KEYS,
) -> ChainDecision:
    """The chain decision of one call (module docstring, for the rules and their order).

    ``seen``: the request's headers (lower-case names) or the envelope's ``call_chain``
    (None: neither carried one); ``own_agent``: this sidecar's agent id; ``target_agent``:
    the called agent's id when the target is an agent, else None; ``now_ms``: the wall
    clock (Unix ms); ``timeout_s``: the call's own timeout (seconds); ``spec``: the
    policy's ``chain:``; ``keys``: the resolved signing keys. Never raises: a refusal is
    the decision's ``error`` (CALL_CHAIN_REFUSED, 409)."""
    received = from_headers(seen) if isinstance(seen, Mapping) else from_envelope(seen)
    received = _authenticated(received, spec, keys)
    if received.problem is not None:
        return _refused(received, (), None, "invalid_chain", received.problem)
    before = received.agents or ()
    agents = (*before, own_agent)
    ttl_ms = round(spec.ttl_s * 1000)
    deadline = received.deadline_ms if received.deadline_ms is not None else now_ms + ttl_ms
    if deadline > now_ms + ttl_ms + round(spec.max_clock_skew_s * 1000):
        problem = (
            "the chain's deadline is further ahead than chain.ttl_s allows (+ max_clock_skew_s)"
        )
        return _refused(received, (), None, "invalid_chain", problem)
    looped = next((a for a in (target_agent, own_agent) if a is not None and a in before), None)
    if looped is not None:
        loop = (*agents, looped) if looped == target_agent else agents
        message = f"agent {looped!r} is already in the call chain: the call would loop"
        return _refused(received, loop, deadline, "circular_call_detected", message)
    if len(agents) > spec.max_depth:
        message = (
            f"the call chain would be {len(agents)} agents deep (chain.max_depth: {spec.max_depth})"
        )
        return _refused(received, agents, deadline, "max_depth_exceeded", message)
    if deadline <= now_ms:
        message = f"the call chain's deadline passed {now_ms - deadline} ms ago"
        return _refused(received, agents, deadline, "ttl_expired", message)
    signature = keys.sign(agents, deadline)
    return ChainDecision(
        received=before,
        agents=agents,
        deadline_ms=deadline,
        signature=signature,
        verified=received.signature is not None and keys.current is not None,
        remaining_s=min(timeout_s, (deadline - now_ms) / 1000),
    )


def start(
    own_agent: str, now_ms: int, timeout_s: float, spec: ChainSpec, keys: SigningKeys = NO_KEYS
) -> ChainDecision | None:
    """:func:`decide`'s decision for a call that came with no chain (and goes to no agent):
    a chain of this agent alone, deadline ``now_ms + ttl``, signed with ``keys.current``
    when the fleet signs chains; the same decision, without reading headers or checking
    what cannot fail (a chain that came with none has no signature to check). None when
    the rules could refuse it after all (a ttl under a millisecond): :func:`decide` then."""
    agents, ttl_ms, ttl_s = _origin(own_agent, spec.ttl_s)
    if ttl_ms <= 0:
        return None
    deadline = now_ms + ttl_ms
    signature = None if keys is NO_KEYS else keys.sign_origin(own_agent, deadline)
    return ChainDecision((), agents, deadline, signature, False, min(timeout_s, ttl_s))


@functools.lru_cache(maxsize=16)  # one per policy's agent_id and chain.ttl_s
def _origin(own_agent: str, ttl_s: float) -> tuple[tuple[str, ...], int, float]:
    """What every chain ``own_agent`` starts shares: its agents, its life in ms (as
    :func:`decide` rounds it) and in seconds (that rounding's)."""
    ttl_ms = round(ttl_s * 1000)
    return (own_agent,), ttl_ms, ttl_ms / 1000


def _authenticated(received: Received, spec: ChainSpec, keys: SigningKeys) -> Received:
    """``received``, or its refusal when the fleet signs chains and its signature fails
    (or is missing under ``require_signed_inbound``)."""
    if received.problem is not None or received.agents is None or keys.current is None:
        return received
    if received.signature is not None and not verify(received, keys):
        return Received(problem="the chain's signature does not match the fleet's keys")
    if received.signature is None and spec.require_signed_inbound:
        return Received(problem="the chain is not signed (chain.require_signed_inbound)")
    return received


def _refused(
    received: Received,
    agents: tuple[str, ...],
    deadline_ms: int | None,
    reason: Reason,
    message: str,
) -> ChainDecision:
    """A refusal: ``details.call_chain`` the chain refused (null when unreadable)."""
    error = CallChainRefused(
        f"call chain refused ({reason}): {message}",
        details={"reason": reason, "call_chain": list(agents) if agents else None},
    )
    return ChainDecision(received.agents or (), agents, deadline_ms, error=error)


def seen_in(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The chain's headers among request ``headers`` (lower-case names), or None."""
    if CHAIN_HEADERS.isdisjoint(headers):  # the usual case, checked in C
        return None
    found = {name: headers[name] for name in CHAIN_HEADERS if name in headers}
    return found or None


def with_headers(headers: Mapping[str, str], decision: ChainDecision) -> dict[str, str]:
    """``headers`` with the chain's own (:meth:`ChainDecision.headers`) in place of any
    the agent set, whatever their case: the sidecar's chain is the only one sent."""
    if _CHAIN_HEADER_LENGTHS.isdisjoint(map(len, headers)):  # the usual case, checked in C
        return {**headers, **decision.headers()}
    kept = {k: v for k, v in headers.items() if k.lower() not in CHAIN_HEADERS}
    return {**kept, **decision.headers()}


def without_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """``headers`` less the chain's, whatever their case (a target with
    ``call_chain.propagate: false``: the chain stays inside the fleet)."""
    return {k: v for k, v in headers.items() if k.lower() not in CHAIN_HEADERS}


def admit(
    seen: Mapping[str, str] | None,
    *,
    own_agent: str,
    now_ms: int,
    timeout_s: float,
    spec: ChainSpec,
    keys: SigningKeys = NO_KEYS,
) -> ChainDecision:
    """The chain decision of a call *to* this sidecar's agent (the inbound route): the
    chain ``seen`` (request headers, or a message's ``metadata`` read as headers) is
    checked as :func:`decide` checks it, with this agent as the one called, and passed
    to the agent as it came (its ``agents``, deadline and signature: the agent's own
    calls extend it). Refused (``invalid_chain``) without a chain under
    ``chain.require_signed_inbound``; a call without a chain otherwise starts none.
    Never raises: a refusal is the decision's ``error``."""
    received = from_headers(seen) if seen is not None else Received()
    if received.agents is None and received.problem is None and spec.require_signed_inbound:
        received = Received(problem="the call carries no chain (chain.require_signed_inbound)")
    received = _authenticated(received, spec, keys)
    if received.problem is not None:
        return _refused(received, (), None, "invalid_chain", received.problem)
    agents = received.agents or ()
    if not agents:
        return ChainDecision((), (), None, remaining_s=timeout_s)
    deadline = received.deadline_ms
    ttl_ms = round(spec.ttl_s * 1000)
    if deadline is None:
        deadline = now_ms + ttl_ms
    elif deadline > now_ms + ttl_ms + round(spec.max_clock_skew_s * 1000):
        problem = "the chain's deadline is further ahead than chain.ttl_s allows"
        return _refused(received, (), None, "invalid_chain", problem)
    if own_agent in agents:
        message = f"agent {own_agent!r} is already in the call chain: the call would loop"
        return _refused(received, (*agents, own_agent), deadline, "circular_call_detected", message)
    if len(agents) + 1 > spec.max_depth:
        depth = len(agents) + 1
        message = f"the call chain would be {depth} agents deep (chain.max_depth: {spec.max_depth})"
        return _refused(received, (*agents, own_agent), deadline, "max_depth_exceeded", message)
    if deadline <= now_ms:
        message = f"the call chain's deadline passed {now_ms - deadline} ms ago"
        return _refused(received, agents, deadline, "ttl_expired", message)
    return ChainDecision(
        received=agents,
        agents=agents,
        deadline_ms=deadline,
        signature=received.signature,
        verified=received.signature is not None and keys.current is not None,
        remaining_s=min(timeout_s, (deadline - now_ms) / 1000),
    )
