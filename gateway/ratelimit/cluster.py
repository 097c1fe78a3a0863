"""Cluster-scope rate-limit groups: one token bucket per group, shared through Redis.

A group with ``scope: cluster`` keeps its request bucket, its token bucket and the
provider's hold in Redis, so every sidecar on the same Redis server, database and
``redis.key_prefix`` draws from one budget. Each admission is one Lua script (EVALSHA,
one round trip) that reads Redis' own clock (``TIME``), so sidecars on different hosts
need no synchronised clocks.

The buckets are GCRA (the generic cell rate algorithm, ITU-T I.371; the leaky bucket as
a meter). A bucket of capacity C draining at rho per second is stored as the instant it
would be empty, in integer microseconds: an amount ``a`` costs ``ceil(a * 1e6 / rho)``
microseconds, and fits at time t when ``max(empty_at, t) + cost - t <= depth`` with
``depth = C / rho`` seconds. Costs are rounded up, so the group is never looser than its
policy. The request bucket has C = ``burst`` and rho = ``requests_per_second``; the
token bucket C = ``tokens_per_minute`` and rho = C / 60.

Guarantee (on Redis' clock, over the admission instants the script books): at most
``burst + requests_per_second * T`` admissions in any window of T seconds, both ends
included, whatever the number of sidecars; the same bound as a local group
(:mod:`gateway.ratelimit`). What an upstream sees also spreads by the time from the
booked instant to the request's arrival there (event-loop lateness, network): with that
spread at most J seconds, at most ``burst + requests_per_second * (T + J)`` requests
reach the upstream in any window of T seconds. The token budget is the local one's:
reservations booked in any window of T seconds total at most ``C + C*T/60``, reconciled
with real usage after each call.

Waiting, and fairness: the script does not just say "no": a call that fits within its
budget (``min(max_queue_s, deadline - now)``) books the earliest instant both buckets
and any provider hold allow, and the caller sleeps until then, with no second round
trip. So calls are served in the order their scripts reach Redis, across all sidecars
(first come, first served at Redis), and a call needing many tokens is not overtaken by
later small ones. A call that would not fit gets :class:`CapacityExceeded` at once with
``retry_after_s`` = the script's computed wait. A call cancelled while it sleeps gives
its token reservation back (in the background) but not its request slot (that slot is
then unused: the group errs on the strict side).

Provider holds (:meth:`ClusterRateLimitGroup.hold_for`) go to a Redis key with an
expiry: every sidecar's next admission waits for them. A sidecar learns of a hold set
by another one at its next admission; calls it had already booked before the hold
proceed (they were within the bucket).

Redis unavailable (:class:`gateway.stores.redis.RedisUnavailable`), per group
``on_redis_error``:

* ``fail_open`` (default): the call is admitted by the group's local bucket instead
  (this class is a :class:`gateway.ratelimit.RateLimitGroup`, so that is its own
  limiter), with a warning in the call's audit record and the ``redis_fallbacks_total``
  metric. Each sidecar then enforces the whole limit alone: N sidecars may send N times
  the group's rate until Redis answers again.
* ``fail_closed``: :class:`CapacityExceeded` (retryable), ``details.reason``
  "redis_unavailable".

Keys (``P`` = ``redis.key_prefix``, ``G`` = the group name; the braces are a Redis Cluster
hash tag, keeping a group's keys in one slot): ``P:rl:{G}:req`` and ``P:rl:{G}:tok``
(strings: empty-at instant in microseconds, expiring 1 s after the bucket empties) and
``P:rl:{G}:hold`` (hash ``until``, ``reason``; expires with the hold).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Final

from gateway.audit import get_logger
from gateway.errors import CapacityExceeded
from gateway.policy import RateLimitGroupSpec
from gateway.ratelimit.local import MAX_PROVIDER_HOLD_S, AdmitHook, RateLimitGroup, loop_deadline
from gateway.stores.redis import RedisClient, RedisUnavailable

__all__ = ["REDIS_RETRY_AFTER_S", "ClusterLimits", "ClusterRateLimitGroup", "Reservation"]

#: ``suggested_retry_after`` of a fail-closed refusal while Redis is unavailable.
REDIS_RETRY_AFTER_S: Final = 1.0
#: Seconds :meth:`ClusterLimits.aclose` gives background writes (reconcile, holds).
CLOSE_GRACE_S: Final = 1.0
_US: Final = 1_000_000
_TOKEN_DEPTH_US: Final = 60 * _US  # a token bucket holds one minute of its rate

# KEYS: req, tok, hold. ARGV: req cost, req depth, tok cost (0: no token bucket), tok
# depth, longest wait the caller accepts (all microseconds), force (1: book even past
# that wait, for a shadow group).
# Reply: {booked 0|1 (2: booked past the wait), wait us, redis now us, hold until us,
# hold reason}.
_RESERVE: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local req_cost, req_depth = tonumber(ARGV[1]), tonumber(ARGV[2])
local tok_cost, tok_depth = tonumber(ARGV[3]), tonumber(ARGV[4])
local hold = redis.call('HMGET', KEYS[3], 'until', 'reason')
local hold_until = tonumber(hold[1]) or 0
local req_e = tonumber(redis.call('GET', KEYS[1])) or 0
local at = math.max(now, hold_until, req_e + req_cost - req_depth)
local tok_e = 0
if tok_cost > 0 then
  tok_e = tonumber(redis.call('GET', KEYS[2])) or 0
  at = math.max(at, tok_e + tok_cost - tok_depth)
end
local verdict = 1
if at - now > tonumber(ARGV[5]) then
  if ARGV[6] ~= '1' then return {0, at - now, now, hold_until, hold[2] or ''} end
  verdict = 2
end
local function book(key, e, cost)
  local empty = math.max(e, at) + cost
  redis.call('SET', key, string.format('%.0f', empty),
             'PX', string.format('%.0f', math.floor((empty - now) / 1000) + 1000))
end
book(KEYS[1], req_e, req_cost)
if tok_cost > 0 then book(KEYS[2], tok_e, tok_cost) end
return {verdict, at - now, now, hold_until, hold[2] or ''}
"""

# KEYS: tok. ARGV: signed cost in microseconds (> 0 charges, < 0 refunds).
_ADJUST: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local e = tonumber(redis.call('GET', KEYS[1])) or 0
local d = tonumber(ARGV[1])
local empty
if d >= 0 then empty = math.max(e, now) + d else empty = math.max(e + d, now) end
if empty <= now then
  redis.call('DEL', KEYS[1])
  return 0
end
redis.call('SET', KEYS[1], string.format('%.0f', empty),
           'PX', string.format('%.0f', math.floor((empty - now) / 1000) + 1000))
return empty - now
"""

# KEYS: hold. ARGV: hold length in microseconds, reason. A hold only ever extends.
_HOLD: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local hold_until = now + tonumber(ARGV[1])
local current = tonumber(redis.call('HGET', KEYS[1], 'until')) or 0
if hold_until > current then
  redis.call('HSET', KEYS[1], 'until', string.format('%.0f', hold_until), 'reason', ARGV[2])
  redis.call('PEXPIRE', KEYS[1], string.format('%.0f', math.floor(ARGV[1] / 1000) + 1))
end
return hold_until - now
"""

_log = get_logger("gateway.ratelimit")


@dataclass(frozen=True, slots=True)
class Reservation:
    """One admission script's answer. Instants on Redis' clock, in microseconds."""

    booked: bool  # True: admitted at at_us; False: refused, it would have needed wait_s
    forced: bool  # booked past the caller's longest wait (a shadow group's "would deny")
    now_us: int  # Redis' clock when the script ran (microseconds since the epoch)
    at_us: int  # the booked (or needed) admission instant
    hold_until_us: int  # the provider hold's end (0 if none was ever set)
    hold_reason: str

    @property
    def wait_s(self) -> float:
        """Seconds from the script's run to the admission instant."""
        return (self.at_us - self.now_us) / _US

    @property
    def hold_s(self) -> float:
        """Seconds of provider hold left when the script ran (0 if none)."""
        return max(self.hold_until_us - self.now_us, 0) / _US

    @classmethod
    def parse(cls, reply: Any) -> Reservation:
        booked, wait_us, now_us, hold_until_us, reason = reply
        return cls(
            booked=int(booked) >= 1,
            forced=int(booked) == 2,
            now_us=int(now_us),
            at_us=int(now_us) + int(wait_us),
            hold_until_us=int(hold_until_us),
            hold_reason=reason.decode() if isinstance(reason, bytes) else str(reason),
        )


class ClusterLimits:
    """Builds the cluster-scope groups of a policy over one :class:`RedisClient`, and
    owns their background writes (token reconciliation, provider holds).

    ``on_fallback(group)`` is called each time a fail-open group admits a call locally
    because Redis is unavailable (the ``redis_fallbacks_total`` metric). Pass
    :meth:`group` as ``RateLimitGroups(..., cluster=...)``; close with :meth:`aclose`.
    """

    def __init__(
        self, client: RedisClient, *, on_fallback: Callable[[str], None] | None = None
    ) -> None:
        self.client = client
        self.on_fallback = on_fallback
        self.reserve_script = client.script(_RESERVE)
        self.adjust_script = client.script(_ADJUST)
        self.hold_script = client.script(_HOLD)
        self._tasks: set[asyncio.Task[None]] = set()

    def group(
        self, name: str, spec: RateLimitGroupSpec, on_admit: AdmitHook | None = None
    ) -> ClusterRateLimitGroup:
        return ClusterRateLimitGroup(name, spec, limits=self, on_admit=on_admit)

    def spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Run ``work`` in the background, kept referenced until it ends."""
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        """Give pending background writes ``CLOSE_GRACE_S``, then cancel them. Idempotent."""
        pending = set(self._tasks)
        if not pending:
            return
        _, late = await asyncio.wait(pending, timeout=CLOSE_GRACE_S)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)


class ClusterRateLimitGroup(RateLimitGroup):
    """A rate-limit group shared through Redis (see the module docstring).

    Same API as :class:`gateway.ratelimit.RateLimitGroup`; ``acquire`` appends a
    warning to ``warnings`` when it fell back to the local bucket.
    """

    def __init__(
        self,
        name: str,
        spec: RateLimitGroupSpec,
        *,
        limits: ClusterLimits,
        on_admit: AdmitHook | None = None,
    ) -> None:
        super().__init__(name, spec, on_admit=on_admit)
        self._limits = limits
        base = limits.client.key("rl", "{" + name + "}")
        self.keys = (f"{base}:req", f"{base}:tok", f"{base}:hold")
        self._req_cost_us = math.ceil(_US / spec.requests_per_second)
        self._req_depth_us = spec.burst * self._req_cost_us
        self._sleeping = 0
        self._local_tokens = 0  # reserved through the local fallback, not yet reconciled

    @property
    def queued(self) -> int:
        """Calls of this sidecar waiting now (booked and sleeping, or queued locally)."""
        return len(self._queue) + self._sleeping

    def token_cost_us(self, tokens: int) -> int:
        """Microseconds of the token bucket that ``tokens`` take (rounded up)."""
        tpm = self.spec.tokens_per_minute
        return math.ceil(tokens * _TOKEN_DEPTH_US / tpm) if tpm and tokens else 0

    async def reserve(self, tokens: int, max_wait_s: float, *, force: bool = False) -> Reservation:
        """Run the admission script once: book one request and ``tokens`` at the earliest
        instant within ``max_wait_s`` (with ``force``, at the earliest instant whatever
        the wait), or report the wait. Raises RedisUnavailable."""
        tok_cost = self.token_cost_us(tokens)
        reply = await self._limits.reserve_script(
            self.keys,
            [
                self._req_cost_us,
                self._req_depth_us,
                tok_cost,
                _TOKEN_DEPTH_US if tok_cost else 0,
                max(math.floor(max_wait_s * _US), 0),
                1 if force else 0,
            ],
        )
        return Reservation.parse(reply)

    async def acquire(
        self,
        *,
        tokens: int = 0,
        deadline: float,
        warnings: list[str] | None = None,
        shadow: list[str] | None = None,
    ) -> float:
        """As :meth:`RateLimitGroup.acquire`, the group's buckets in Redis. Also raises
        :class:`CapacityExceeded` with ``details.reason`` "redis_unavailable" for a
        fail-closed group while Redis is unavailable. A shadow group books in Redis
        without waiting (one round trip; a booking past the call's wait is its "would
        deny"), and falls back to its local bucket while Redis is unavailable."""
        if self.spec.mode == "shadow":
            return await self._shadow_cluster(tokens, deadline, warnings, shadow)
        tokens = self._checked_tokens(tokens)
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        deadline = loop_deadline(deadline, loop)
        while True:
            now = loop.time()
            budget, limit = self._budget(now, deadline, arrived)
            hold_left = self._hold_until - now
            if hold_left > 0:  # a hold this sidecar knows of: its own, or seen in Redis
                if hold_left > budget:
                    raise self._refusal(hold_left, limit, hold=True)
                await self._sleep(hold_left)
                continue
            try:
                booking = await self.reserve(tokens, budget)
            except RedisUnavailable as exc:
                return await self._unavailable(exc, tokens, deadline, arrived, warnings)
            if booking.hold_s > 0:
                RateLimitGroup.hold_for(self, booking.hold_s, reason=booking.hold_reason)
            if not booking.booked:
                raise self._refusal(booking.wait_s, limit, hold=booking.hold_s > budget)
            if booking.wait_s > 0:
                known_hold = self._hold_until
                try:
                    await self._sleep(booking.wait_s)
                except asyncio.CancelledError:
                    self._refund(tokens)
                    raise
                if self._hold_until > known_hold and self._hold_until > loop.time():
                    # A hold came while sleeping: the booked slot falls inside it.
                    self._refund(tokens)
                    continue
            if self._on_admit is not None:
                self._on_admit(self.name, loop.time())
            return loop.time() - arrived

    def reconcile(self, reserved: int, actual: int) -> None:
        """As :meth:`RateLimitGroup.reconcile`, in Redis (a background write, so the call
        does not wait for it); on the local bucket if the call was admitted there or Redis
        is unavailable."""
        if self._tokens is None or actual == reserved:
            return
        if reserved and self._local_tokens >= reserved:
            self._local_tokens -= reserved
            super().reconcile(reserved, actual)
            return
        self._limits.spawn(self._adjust(reserved, actual), f"ratelimit-reconcile-{self.name}")

    def hold_for(self, seconds: float, *, reason: str) -> None:
        """As :meth:`RateLimitGroup.hold_for`, and the hold is written to Redis (in the
        background) for every sidecar's next admission."""
        if not seconds > 0:
            return
        seconds = min(seconds, MAX_PROVIDER_HOLD_S)
        super().hold_for(seconds, reason=reason)
        self._limits.spawn(self._write_hold(seconds, reason), f"ratelimit-hold-{self.name}")

    # --- internals ------------------------------------------------------------------

    async def _shadow_cluster(
        self,
        tokens: int,
        deadline: float,
        warnings: list[str] | None,
        shadow: list[str] | None,
    ) -> float:
        try:
            tokens = self._checked_tokens(tokens)
        except CapacityExceeded:
            if shadow is not None and self.name not in shadow:
                shadow.append(self.name)
            return 0.0
        loop = asyncio.get_running_loop()
        now = loop.time()
        budget, _ = self._budget(now, loop_deadline(deadline, loop), now)
        try:
            booking = await self.reserve(tokens, budget, force=True)
        except RedisUnavailable:
            if warnings is not None:
                warnings.append(
                    f"rate-limit group {self.name!r} (shadow): Redis unavailable, "
                    "evaluated by this sidecar's own limiter"
                )
            self._local_tokens += tokens
            return self._shadow(tokens, deadline, warnings, shadow)
        if booking.forced and shadow is not None and self.name not in shadow:
            shadow.append(self.name)
        if self._on_admit is not None:
            self._on_admit(self.name, loop.time())
        return 0.0

    async def _sleep(self, seconds: float) -> None:
        self._sleeping += 1
        try:
            await asyncio.sleep(seconds)
        finally:
            self._sleeping -= 1

    async def _unavailable(
        self,
        exc: RedisUnavailable,
        tokens: int,
        deadline: float,
        arrived: float,
        warnings: list[str] | None,
    ) -> float:
        if self.spec.on_redis_error == "fail_closed":
            raise CapacityExceeded(
                f"rate-limit group {self.name!r} (cluster scope) cannot admit the call: "
                f"{exc}; the group is fail_closed, so nothing is sent. Retry shortly",
                details={"group": self.name, "reason": "redis_unavailable", "scope": "cluster"},
                retry_after_s=REDIS_RETRY_AFTER_S,
            ) from None
        warning = (
            f"rate-limit group {self.name!r}: Redis unavailable, admitted by this "
            "sidecar's own limiter (fail_open)"
        )
        if warnings is not None and warning not in warnings:
            warnings.append(warning)
        if self._limits.on_fallback is not None:
            self._limits.on_fallback(self.name)
        await self._acquire_local(tokens, deadline, arrived)
        self._local_tokens += tokens
        return asyncio.get_running_loop().time() - arrived

    def _refund(self, tokens: int) -> None:
        if tokens and self._tokens is not None:
            self._limits.spawn(self._adjust(tokens, 0), f"ratelimit-refund-{self.name}")

    async def _adjust(self, reserved: int, actual: int) -> None:
        delta = actual - reserved
        cost = self.token_cost_us(abs(delta))
        try:
            await self._limits.adjust_script(self.keys[1:2], [cost if delta > 0 else -cost])
        except RedisUnavailable:
            super().reconcile(reserved, actual)  # at least this sidecar keeps the account

    async def _write_hold(self, seconds: float, reason: str) -> None:
        try:
            await self._limits.hold_script(self.keys[2:3], [math.ceil(seconds * _US), reason])
        except RedisUnavailable as exc:
            _log.warning("ratelimit_hold_not_shared", group=self.name, error=str(exc))

    def _refusal(self, wait_s: float, limit: str, *, hold: bool) -> CapacityExceeded:
        details: dict[str, Any] = {
            "group": self.name,
            "reason": "provider_hold" if hold else limit,
            "scope": "cluster",
        }
        if hold:
            details["hold"] = self._hold_reason
        return CapacityExceeded(
            f"rate-limit group {self.name!r} (cluster scope) cannot admit the call within "
            f"its {'deadline' if limit == 'deadline' else 'max_queue_s'}; capacity in "
            f"{wait_s:.3f} s, retry then",
            details=details,
            retry_after_s=wait_s,
        )
