"""The idempotency store interface, shared by the in-memory and the Redis store.

A store maps an idempotency key to either a call in flight (owned by one caller, with a
lease) or a completed call's stored answer (bytes, kept for a TTL), together with the
request's fingerprint. Each method is one atomic step, so a Redis store can implement
it with one script (``SET NX PX`` plus compare-and-set on the owner token)::

    begin(key, fingerprint, lease_s)
      no live entry                -> Proceed(token): you own the key for lease_s
      entry with other fingerprint -> Conflict(): same key, different request
      completed entry              -> Replay(answer)
      entry in flight              -> InFlight(): wait(key, fingerprint, deadline)
    complete(key, token, answer, ttl_s) -> stores the answer (if token still owns it)
    abandon(key, token)                 -> frees the key (retryable failure, cancel)

An owner that disappears cannot block a key for longer than its lease: after
``lease_s`` the next ``begin`` proceeds (and the old owner's ``complete`` is refused).
Which answers are stored is the caller's decision; the store keeps bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeAlias, runtime_checkable

__all__ = ["Conflict", "IdempotencyStore", "InFlight", "Outcome", "Proceed", "Replay"]


@dataclass(frozen=True, slots=True)
class Proceed:
    """The caller owns the key: make the call, then ``complete`` or ``abandon`` it with
    ``token`` (opaque; proves ownership)."""

    token: str

    def __repr__(self) -> str:
        return "Proceed()"  # the token is a capability: keep it out of logs


@dataclass(frozen=True, slots=True)
class Replay:
    """A completed call with this key and fingerprint: ``answer`` is what was stored."""

    answer: bytes


@dataclass(frozen=True, slots=True)
class Conflict:
    """The key is in use (in flight or completed) by a request with another fingerprint."""


@dataclass(frozen=True, slots=True)
class InFlight:
    """Another caller owns the key for the same request; ``wait`` for its answer."""


Outcome: TypeAlias = Proceed | Replay | Conflict | InFlight


@runtime_checkable
class IdempotencyStore(Protocol):
    """What the pipeline needs from an idempotency store. All times are seconds."""

    async def begin(self, key: str, fingerprint: str, *, lease_s: float) -> Outcome:
        """Claim ``key`` for a request with ``fingerprint`` (see the module docstring).
        ``lease_s`` bounds how long the claim survives without ``complete``/``abandon``
        (set it to the call's remaining deadline). May raise
        :class:`gateway.errors.CapacityExceeded` if the store cannot hold another call."""
        ...

    async def complete(self, key: str, token: str, answer: bytes, *, ttl_s: float) -> bool:
        """Store ``answer`` for ``ttl_s`` and wake the waiters (they get ``answer``).
        False if ``token`` no longer owns the key (lease expired) or the answer was too
        large to keep; waiters still get it then."""
        ...

    async def abandon(self, key: str, token: str) -> None:
        """Give the key up without an answer; waiters wake with None. No-op if ``token``
        no longer owns it."""
        ...

    async def wait(self, key: str, fingerprint: str, *, deadline: float) -> bytes | None:
        """Wait until ``deadline`` (absolute, on ``time.monotonic()``) for the owner of ``key``
        to complete the request with ``fingerprint``. The answer, or None when there is
        none to give (deadline passed, the owner abandoned or lost its lease, the key now
        holds another request): then call ``begin`` again if time remains."""
        ...

    async def aclose(self) -> None:
        """Release resources; wake every waiter with None. Idempotent."""
        ...
