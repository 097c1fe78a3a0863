"""Who is calling: the identity the sidecar establishes, never the agent's word
(design.md, "Who is calling: agent identity"; docs/kubernetes.md).

Sources, strongest first (``agent_auth`` in the audit record):

    uid     the kernel's word about the calling process: ``SO_PEERCRED`` on the Unix-socket
            listener, or the owner of the loopback TCP socket the call came from
            (:mod:`gateway.agents.peers`), matched against the policy's ``agents.*.uid``
    token   header ``x-egress-agent-token`` equal, compared in constant time, to the value
            of an agent's ``token_ref`` (a secret reference mounted only into its container)
    policy  the policy's ``agent_id``, when the policy has no ``agents:`` (one agent per
            sidecar)

With ``agents:`` a caller recognised as none of them is refused (PERMISSION_DENIED,
``details.reason: unknown_agent``, with the UID the kernel gave, never a token), as is a
token that matches no agent: never a default agent. A claim (header ``x-egress-agent``,
the envelope's ``agent_id``) equal to the established id is fine; a different one is
PERMISSION_DENIED ``agent_mismatch`` with both ids; an agent calling a target outside its
``targets`` is PERMISSION_DENIED ``target_not_allowed``.

:func:`establish` is pure; :func:`identify` is the one hook every API calls with the
request's socket and headers.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import socket
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol

from multidict import istr

from gateway.agents import peers
from gateway.errors import PermissionDenied

#: The header of a per-agent token (never forwarded, never audited).
TOKEN_HEADER: Final = "x-egress-agent-token"  # noqa: S105 - a header name
#: The header of a claimed agent id (checked, never believed).
CLAIM_HEADER: Final = "x-egress-agent"
#: The two headers as multidict's case-insensitive keys, read on every call: aiohttp's
#: header mapping lowers a plain ``str`` key at each lookup (~1,700 instructions), an
#: ``istr`` it takes as it is; a plain mapping reads it as the ``str`` it also is.
_TOKEN_KEY: Final = istr(TOKEN_HEADER)
_CLAIM_KEY: Final = istr(CLAIM_HEADER)
#: The ``agent_id`` of a caller recognised as no agent (not a policy name: those start
#: with a letter or digit).
UNKNOWN_AGENT: Final = "_unknown"
#: A claim is kept (audit record, error details) cut to this many characters.
_CLAIM_LIMIT: Final = 256

AgentAuth = Literal["uid", "token", "policy"]
Listener = Literal["tcp", "unix"]


@dataclass(frozen=True, slots=True)
class Agent:
    """One entry of the policy's ``agents:``: its id, the UID and the SHA-256 of the
    token that recognise it, and the targets it may call (None: every target)."""

    agent_id: str
    uid: int | None = None
    token_sha256: bytes | None = None
    targets: frozenset[str] | None = None


@dataclass(frozen=True, slots=True)
class Agents:
    """The agents a policy knows, built once per policy (start and reload). Without any
    (``agents:`` absent) every caller is ``default``, the policy's ``agent_id``."""

    default: str
    agents: tuple[Agent, ...] = ()
    #: Whether some agent has a ``uid`` (:attr:`reads_uid`), and the agents by the
    #: SHA-256 of their token: both derived from ``agents`` once, not per call.
    _reads_uid: bool = field(init=False, repr=False, compare=False)
    _by_token_sha256: dict[bytes, Agent] = field(init=False, repr=False, compare=False)
    #: The identity each token gives a caller whose UID is not asked (immutable: made
    #: once per agent, not per call), by the token's SHA-256.
    _token_identities: dict[bytes, Identity] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_digest: dict[bytes, Agent] = {}
        for agent in self.agents:
            if agent.token_sha256 is not None:
                by_digest[agent.token_sha256] = agent  # the last one, as the loop found
        object.__setattr__(self, "_reads_uid", any(a.uid is not None for a in self.agents))
        object.__setattr__(self, "_by_token_sha256", by_digest)
        identities = {
            d: Identity(a.agent_id, "token", None, a.targets) for d, a in by_digest.items()
        }
        object.__setattr__(self, "_token_identities", identities)

    @property
    def default_identity(self) -> Identity:
        """The identity of every caller without ``agents:`` (``agent_auth: policy``)."""
        return policy_identity(self.default)

    @property
    def enabled(self) -> bool:
        return bool(self.agents)

    @property
    def reads_uid(self) -> bool:
        """Whether the callers' UIDs are asked of the kernel (some agent has a ``uid``)."""
        return self._reads_uid

    def by_uid(self, uid: int | None) -> Agent | None:
        if uid is None or not self._reads_uid:
            return None
        return next((a for a in self.agents if a.uid == uid), None)

    def by_token(self, token: str) -> Agent | None:
        """The agent whose token is ``token``: found by the SHA-256 of ``token``, then
        that digest compared to the agent's in constant time (``hmac.compare_digest``).

        Why a dict lookup keyed by the digest leaks nothing of a token: what the lookup
        compares (a SipHash of the digest, then the digest's bytes) depends on the
        SHA-256 of the presented value, never on the stored token's bytes directly. An
        attacker timing it learns at most how many leading bytes of a *digest* matched,
        and turning that into a token would take SHA-256 preimages; the tokens
        themselves are never kept (only their digests). One digest per call, whatever
        the number of agents (a loop compared each)."""
        presented = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        found = self._by_token_sha256.get(presented)
        if found is None or found.token_sha256 is None:
            return None
        return found if hmac.compare_digest(presented, found.token_sha256) else None

    def token_identity(self, token: str) -> Identity | None:
        """What :func:`establish` decides for a caller whose UID is not asked and who
        sent ``token`` and no claim: the identity of the agent :meth:`by_token` finds
        (the same digest and constant-time compare), made once per agent; None when no
        agent's token it is."""
        found = self.by_token(token)
        if found is None or found.token_sha256 is None:
            return None
        return self._token_identities[found.token_sha256]

    def acting_for(self, agent_id: str) -> Identity:
        """The identity of a call the sidecar makes for ``agent_id`` itself (an
        operator's replay of its dead letter): held to the targets the policy gives it
        now; refused (``unknown_agent``) for an agent the policy no longer has. Without
        ``agents:``, the policy's identity under that id."""
        if not self.agents:
            return policy_identity(agent_id)
        found = next((a for a in self.agents if a.agent_id == agent_id), None)
        if found is None:
            return _unknown(Seen("tcp"), f"the policy has no agent {agent_id[:_CLAIM_LIMIT]!r}")
        return Identity(found.agent_id, "policy", None, found.targets)


def token_digest(value: str) -> bytes:
    """The SHA-256 of a token value, as :class:`Agent` keeps it."""
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).digest()


@dataclass(frozen=True, slots=True)
class Seen:
    """What the sidecar saw of a caller: the listener, the UID the kernel gave (None: not
    asked, or the kernel could not say), and the identity headers' values."""

    listener: Listener
    peer_uid: int | None = None
    token: str | None = None
    claim: str | None = None


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a call is from. ``agent_auth`` None: not established, and ``refusal`` is the
    PERMISSION_DENIED the call is answered with. ``claimed``: a claim that differed."""

    agent_id: str
    agent_auth: AgentAuth | None
    peer_uid: int | None = None
    targets: frozenset[str] | None = None
    claimed: str | None = None
    refusal: PermissionDenied | None = None

    def with_claim(self, claim: str | None) -> Identity:
        """This identity, checked against ``claim`` (an envelope's ``agent_id``): a
        different claim makes it refused with ``agent_mismatch``."""
        if claim is None or claim == self.agent_id or self.refusal is not None:
            return self
        claim = claim[:_CLAIM_LIMIT]
        return dataclasses.replace(self, claimed=claim, refusal=_mismatch(self, claim))

    def admit(self, target: str) -> None:
        """Raise the refusal, if any, or PERMISSION_DENIED (``target_not_allowed``) for a
        ``target`` outside the agent's ``targets``."""
        if self.refusal is not None:
            raise self.refusal
        if self.targets is not None and target not in self.targets:
            raise PermissionDenied(
                f"agent {self.agent_id!r} may not call target {target!r} "
                "(its targets in the policy's agents: section)",
                details={
                    "reason": "target_not_allowed",
                    "agent_id": self.agent_id,
                    "target_system": target[:_CLAIM_LIMIT],
                },
            )


@functools.lru_cache(maxsize=64)  # immutable, one per policy agent_id: built once, not per call
def policy_identity(agent_id: str) -> Identity:
    """The identity of a sidecar without ``agents:``: its policy's ``agent_id``."""
    return Identity(agent_id, "policy")


def establish(seen: Seen, agents: Agents) -> Identity:
    """Who sent the call ``seen`` describes, under ``agents`` (module docstring). Never
    raises: a caller that is not recognised, or whose claim differs, gets an
    :class:`Identity` whose ``refusal`` says so."""
    if not agents.enabled:
        identity = agents.default_identity
        if seen.peer_uid is not None:
            identity = dataclasses.replace(identity, peer_uid=seen.peer_uid)
    else:
        identity = _recognise(seen, agents)
    if seen.claim is not None and identity.agent_auth is not None:
        return identity.with_claim(seen.claim)
    return identity


def _recognise(seen: Seen, agents: Agents) -> Identity:
    by_uid = agents.by_uid(seen.peer_uid)
    by_token = agents.by_token(seen.token) if seen.token is not None else None
    if seen.token is not None and by_token is None:
        return _unknown(seen, "the agent token matches no agent of the policy")
    agent, auth = (by_uid, "uid") if by_uid is not None else (by_token, "token")
    if agent is None:
        return _unknown(seen, _unrecognised(seen))
    identity = Identity(agent.agent_id, auth, seen.peer_uid, agent.targets)  # type: ignore[arg-type]
    if by_token is not None and by_token is not agent:
        # The UID says one agent, the token another: the token is only a claim then.
        return identity.with_claim(by_token.agent_id)
    return identity


def _unrecognised(seen: Seen) -> str:
    if seen.peer_uid is None:
        return (
            f"the owner of the calling {seen.listener} socket cannot be read (the process "
            "exited, or the call did not come from this pod) and no agent token was sent"
        )
    return f"no agent of the policy has UID {seen.peer_uid} and no agent token was sent"


def _unknown(seen: Seen, why: str) -> Identity:
    refusal = PermissionDenied(
        f"the caller is not an agent of this sidecar's policy: {why}",
        details={"reason": "unknown_agent", "peer_uid": seen.peer_uid, "listener": seen.listener},
    )
    return Identity(UNKNOWN_AGENT, None, seen.peer_uid, frozenset(), refusal=refusal)


def _mismatch(identity: Identity, claim: str) -> PermissionDenied:
    return PermissionDenied(
        f"the call claims agent {claim!r} but comes from agent {identity.agent_id!r} "
        f"(established by {identity.agent_auth}); send no agent id, or this one",
        details={
            "reason": "agent_mismatch",
            "claimed": claim,
            "agent_id": identity.agent_id,
            "agent_auth": identity.agent_auth,
        },
    )


#: A TCP connection's owner, read once per connection and kept while its transport lives
#: (a socket's UID is fixed at its creation): /proc/net/tcp* lists every socket of the pod.
_TCP_OWNERS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


class Transport(Protocol):
    """What :func:`identify` needs of a connection: asyncio's ``BaseTransport``."""

    def get_extra_info(self, name: str, default: Any = None) -> Any: ...


def identify(transport: Transport | None, headers: Mapping[str, str], agents: Agents) -> Identity:
    """The identity of a request that came in on ``transport`` (its ``socket``) with
    ``headers`` (a mapping whose ``get`` ignores case, as aiohttp's): the one hook of
    every API and listener. Asks the kernel (:func:`gateway.agents.peers.peer_uid`) only
    when the caller is on the Unix socket or some agent is recognised by UID; a TCP
    connection's owner once per connection (``transport`` weakly referenced)."""
    listener = _listener_of(transport)
    if not agents.agents and listener == "tcp":
        # No agents: section, a TCP caller: the policy's identity (no UID, no token to
        # read), checked against a claim; what establish() decides, without its inputs.
        claim = headers.get(_CLAIM_KEY)
        identity = agents.default_identity
        return identity if claim is None else identity.with_claim(claim)
    if listener == "tcp" and not agents.reads_uid:
        # No UID to ask: a token and no claim is the agent's identity, made once
        # (Agents.token_identity); anything else is establish()'s to decide.
        token = _only(headers, _TOKEN_KEY)
        claim = _only(headers, _CLAIM_KEY)
        if token is not None and claim is None:
            known = agents.token_identity(token)
            if known is not None:
                return known
        return establish(Seen(listener, None, token, claim), agents)
    uid = None
    if listener == "unix" or agents.reads_uid:  # the socket only when the kernel is asked
        uid = _TCP_OWNERS.get(transport) if listener == "tcp" else None
        if uid is None:
            sock = transport.get_extra_info("socket") if transport is not None else None
            uid = peers.peer_uid(sock)
            if uid is not None and listener == "tcp":
                _TCP_OWNERS[transport] = uid
    seen = Seen(listener, uid, _only(headers, _TOKEN_KEY), _only(headers, _CLAIM_KEY))
    return establish(seen, agents)


#: Transport classes whose listener is fixed by the class (uvloop's), by module and name:
#: no socket object to build and no AddressFamily enum to convert per request.
_FIXED_LISTENERS: Final[dict[tuple[str, str], Listener]] = {
    ("uvloop.loop", "TCPTransport"): "tcp",
    ("uvloop.loop", "UnixTransport"): "unix",
}
#: Transport class -> its listener (None: it serves both, ask its socket), learnt per class.
_LISTENER_OF_CLASS: dict[type, Listener | None] = {}


def _listener_of(transport: Transport | None) -> Listener:
    """``"unix"`` for a connection on the Unix-socket listener, else ``"tcp"``: by the
    transport's class when that says it (uvloop's), else by its socket's family
    (asyncio's transports serve both)."""
    if transport is None:
        return "tcp"
    kind = type(transport)
    try:
        listener = _LISTENER_OF_CLASS[kind]
    except KeyError:
        listener = _LISTENER_OF_CLASS[kind] = _FIXED_LISTENERS.get(
            (kind.__module__, kind.__qualname__)
        )
    if listener is not None:
        return listener
    sock = transport.get_extra_info("socket")
    return "unix" if sock is not None and sock.family == socket.AF_UNIX else "tcp"


def _only(headers: Mapping[str, str], name: str) -> str | None:
    """The value of header ``name``; a header sent more than once with different values
    is all of them, comma-joined (RFC 9110, section 5.3), which no token or agent id
    matches: refused, never decided by its first copy alone."""
    try:
        getall = headers.getall  # type: ignore[attr-defined]
    except AttributeError:  # a plain mapping: one value per name
        return headers.get(name)
    values = getall(name, ())
    if not values:
        return None
    if len(values) > 1 and len(set(values)) > 1:
        return ",".join(values)
    first: str = values[0]  # the first, as get() gives
    return first


def build_agents(
    default: str, entries: Iterable[tuple[str, int | None, str | None, Iterable[str] | None]]
) -> Agents:
    """:class:`Agents` from ``(agent_id, uid, token value or None, targets or None)``."""
    return Agents(
        default,
        tuple(
            Agent(
                agent_id,
                uid,
                token_digest(token) if token is not None else None,
                frozenset(targets) if targets is not None else None,
            )
            for agent_id, uid, token, targets in entries
        ),
    )
