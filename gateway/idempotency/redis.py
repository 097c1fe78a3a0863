"""The Redis idempotency store (``idempotency.scope: cluster``): one upstream call per
idempotency key across every sidecar on the same Redis server, database and key prefix.

Implements :class:`gateway.idempotency.base.IdempotencyStore`. Each entry is one Redis
hash ``P:idem:<target>:<idempotency key>`` (``P`` = ``redis.key_prefix``) with fields
``fp`` (the request's fingerprint), ``token`` (the owner's, random, 128 bits), ``state``
(``inflight`` or ``done``) and ``answer`` (the stored answer, once done). Every method is
one Lua script, so each step is atomic on the server:

* ``begin``: creates the entry in flight with the caller's token and an expiry of
  ``lease_s`` (the ``SET NX PX`` of a Redis lock), or reports Conflict / Replay /
  InFlight. A sidecar that crashes holding a key blocks it for at most its lease (the
  call's remaining deadline); after that the next ``begin`` proceeds, and the old
  owner's ``complete`` is refused (compare-and-set on the token).
* ``complete``: compare-and-set on the token; stores the answer and sets the expiry to
  ``ttl_s`` (``targets.<name>.idempotency.ttl_s``). The answer is kept in Redis whole:
  its size is bounded by ``server.max_response_bytes`` plus the envelope.
* ``abandon``: compare-and-set delete.

``begin`` and ``complete`` are safe to repeat (redis-py retries a command once on a
dropped connection): a repeated ``begin`` with the same token proceeds again, a
repeated ``complete`` reports success.

``wait`` polls the entry (one small script per poll) every 5 ms at first, doubling up to
``MAX_POLL_S`` (100 ms): a waiter on another sidecar sees the owner's answer at most
100 ms after it was stored. Waiters in the sidecar that owns the key are woken at once by
``complete`` / ``abandon`` (an in-process event), without waiting for the next poll.
Polling rather than pub/sub keeps every operation on the shared pool (a subscriber needs
a connection of its own per process) and cannot miss a notification.

Redis unavailable: idempotency fails closed. ``begin`` and ``wait`` raise
:class:`DependencyFailed` (retryable, ``details.reason`` "redis_unavailable"); nothing is
sent upstream without the key. ``complete`` returns False and ``abandon`` does nothing
(each logs a warning): the call's answer still reaches the agent, and the entry expires
with its lease.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from typing import Any, Final

from gateway.audit import get_logger
from gateway.errors import DependencyFailed
from gateway.idempotency.base import Conflict, InFlight, Outcome, Proceed, Replay
from gateway.stores.redis import RedisClient, RedisUnavailable

__all__ = ["MAX_POLL_S", "MIN_POLL_S", "RedisIdempotencyStore"]

#: First and longest interval between two polls of ``wait``, seconds.
MIN_POLL_S: Final = 0.005
MAX_POLL_S: Final = 0.1

# KEYS: entry. ARGV: fingerprint, token, lease ms. Reply: {kind[, answer]}.
_BEGIN: Final = """
local e = redis.call('HMGET', KEYS[1], 'fp', 'token', 'state')
if not e[1] then
  redis.call('HSET', KEYS[1], 'fp', ARGV[1], 'token', ARGV[2], 'state', 'inflight')
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {'proceed'}
end
if e[1] ~= ARGV[1] then return {'conflict'} end
if e[3] == 'done' then return {'replay', redis.call('HGET', KEYS[1], 'answer')} end
if e[2] == ARGV[2] then return {'proceed'} end
return {'inflight'}
"""

# KEYS: entry. ARGV: token, answer, ttl ms. Reply: 1 stored, 0 not the owner.
_COMPLETE: Final = """
local e = redis.call('HMGET', KEYS[1], 'token', 'state')
if e[1] ~= ARGV[1] then return 0 end
if e[2] == 'done' then return 1 end
redis.call('HSET', KEYS[1], 'state', 'done', 'answer', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

# KEYS: entry. ARGV: token. Reply: 1 deleted, 0 not the owner.
_ABANDON: Final = """
local e = redis.call('HMGET', KEYS[1], 'token', 'state')
if e[1] == ARGV[1] and e[2] == 'inflight' then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""

# KEYS: entry. ARGV: fingerprint. Reply: {'done', answer} | {'inflight'} | {'none'}.
_PEEK: Final = """
local e = redis.call('HMGET', KEYS[1], 'fp', 'state')
if e[1] ~= ARGV[1] then return {'none'} end
if e[2] == 'done' then return {'done', redis.call('HGET', KEYS[1], 'answer')} end
return {'inflight'}
"""

_log = get_logger("gateway.idempotency")


def _ms(seconds: float) -> int:
    return max(math.ceil(seconds * 1000), 1)


def _kind(reply: Any) -> str:
    head = reply[0]
    return head.decode() if isinstance(head, bytes) else str(head)


class RedisIdempotencyStore:
    """Implements :class:`gateway.idempotency.base.IdempotencyStore` in Redis (see the
    module docstring). Does not own ``client``: the runtime closes it. ``wait`` polls
    first after ``min_poll_s`` and at most every ``max_poll_s`` seconds (tests set both
    long, to show that only ``complete`` / ``abandon`` woke a waiter)."""

    def __init__(
        self,
        client: RedisClient,
        *,
        min_poll_s: float = MIN_POLL_S,
        max_poll_s: float = MAX_POLL_S,
    ) -> None:
        self.client = client
        self._poll_s = (min_poll_s, max_poll_s)
        self._begin = client.script(_BEGIN)
        self._complete = client.script(_COMPLETE)
        self._abandon = client.script(_ABANDON)
        self._peek = client.script(_PEEK)
        self._events: dict[str, asyncio.Event] = {}  # keys this process's waiters watch
        self._closed = False

    def redis_key(self, key: str) -> str:
        """The Redis key of store key ``key``."""
        return self.client.key("idem", key)

    async def begin(self, key: str, fingerprint: str, *, lease_s: float) -> Outcome:
        token = secrets.token_urlsafe(16)
        reply = await self._fail_closed(
            self._begin([self.redis_key(key)], [fingerprint, token, _ms(lease_s)])
        )
        kind = _kind(reply)
        if kind == "proceed":
            return Proceed(token)
        if kind == "replay":
            return Replay(bytes(reply[1]))
        if kind == "conflict":
            return Conflict()
        return InFlight()

    async def complete(self, key: str, token: str, answer: bytes, *, ttl_s: float) -> bool:
        try:
            stored = await self._complete([self.redis_key(key)], [token, answer, _ms(ttl_s)])
        except RedisUnavailable as exc:
            _log.warning("idempotency_answer_not_stored", error=str(exc))
            return False
        finally:
            self._wake(key)
        return bool(stored)

    async def abandon(self, key: str, token: str) -> None:
        try:
            await self._abandon([self.redis_key(key)], [token])
        except RedisUnavailable as exc:
            _log.warning("idempotency_key_not_released", error=str(exc))
        finally:
            self._wake(key)

    async def wait(self, key: str, fingerprint: str, *, deadline: float) -> bytes | None:
        interval, longest = self._poll_s
        while not self._closed:
            reply = await self._fail_closed(self._peek([self.redis_key(key)], [fingerprint]))
            kind = _kind(reply)
            if kind == "done":
                return bytes(reply[1])
            if kind != "inflight":
                return None  # abandoned, expired, or now another request's
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._closed:
                return None
            event = self._events.setdefault(key, asyncio.Event())
            try:
                async with asyncio.timeout(min(interval, remaining)):
                    await event.wait()
            except TimeoutError:
                pass
            interval = min(interval * 2, longest)
        return None

    async def aclose(self) -> None:
        """Wake every waiter of this process (they return None). Idempotent."""
        self._closed = True
        for event in self._events.values():
            event.set()
        self._events.clear()

    def _wake(self, key: str) -> None:
        event = self._events.pop(key, None)
        if event is not None:
            event.set()

    async def _fail_closed(self, operation: Any) -> Any:
        try:
            return await operation
        except RedisUnavailable as exc:
            raise DependencyFailed(
                f"the idempotency store is unavailable: {exc}; the call was not sent "
                "(a cluster-scope idempotency key cannot be checked). Retry shortly",
                details={"reason": "redis_unavailable"},
                retry_after_s=1.0,
            ) from None
