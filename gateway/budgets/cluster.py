"""Cluster-scope budgets: spend buckets in Redis, one Lua script per admission.

Every sidecar on the same Redis server, database and ``redis.key_prefix`` books into the
same buckets. An admission is one script (EVALSHA, one round trip) that reads Redis's
clock (``TIME``: sidecars need no synchronised clocks), computes each budget's current
bucket (:mod:`gateway.budgets.windows`, the same arithmetic in Lua), sums its window,
and either refuses (an enforced budget cannot cover the reservation: nothing is booked)
or books the reservation in every budget at once. Settling a call is one more script,
run in the background (the call does not wait for it): it adds ``actual - reserved`` to
the bucket the reservation went to, if that bucket still exists.

Keys (``P`` = ``redis.key_prefix``, ``B`` = the budget's name): ``P:budget:{budgets}:B``,
a hash of bucket id -> nano-USD. The ``{budgets}`` hash tag keeps every budget in one
Redis Cluster slot, so that one script may book several atomically. A key expires a
minute after its newest bucket leaves the window; older fields are deleted as new ones
are written.

Redis unavailable (:class:`gateway.stores.redis.RedisUnavailable`), per budget
``on_redis_error``: ``fail_closed`` (default) refuses with CAPACITY_EXCEEDED
(retryable, ``details.reason`` "redis_unavailable", ``suggested_retry_after`` 1 s);
``fail_open`` (and any shadow budget) is counted by this sidecar alone until Redis
answers, with a warning in the audit record. A settlement that cannot reach Redis is
lost (logged once per outage by the client): a refund lost over-counts (safe), a charge
lost under-counts by that call's excess over its reservation.
"""

from __future__ import annotations

from typing import Any, Final

from gateway.audit import get_logger
from gateway.budgets import Applied, Booking, exceeded
from gateway.budgets.windows import KIND_CODES
from gateway.errors import CapacityExceeded
from gateway.ratelimit.cluster import REDIS_RETRY_AFTER_S, ClusterLimits
from gateway.stores.redis import RedisUnavailable

__all__ = ["ClusterBudgets"]

_ARGS_PER_BUDGET: Final = 5

# KEYS: one hash per budget. ARGV: amount (nano-USD), then per budget: limit (nano-USD),
# kind (0 daily, 1 monthly, 2 rolling), bucket width (s, rolling), buckets, enforce (1|0).
# Reply: {admitted 1|0, refused budget index (1-based, 0: none), wait s (string, "-1":
# never), the refused budget's spend, {shadow indexes}, {booked bucket per budget}}.
_ADMIT: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local amount = tonumber(ARGV[1])
local function civil(days)
  local z = days + 719468
  local era = math.floor((z >= 0 and z or z - 146096) / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
    - math.floor(doe / 146096)) / 365)
  local y = yoe + era * 400
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  if m <= 2 then y = y + 1 end
  return y, m
end
local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = math.floor((y >= 0 and y or y - 399) / 400)
  local yoe = y - era * 400
  local mp = m > 2 and m - 3 or m + 9
  local doy = math.floor((153 * mp + 2) / 5) + d - 1
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end
local function bucket_of(kind, width)
  if kind == 2 then return math.floor(now / width) end
  local days = math.floor(now / 86400)
  if kind == 0 then return days end
  local y, m = civil(days)
  return (y - 1970) * 12 + m - 1
end
local function leaves_at(kind, width, nb, b)
  if kind == 2 then return (b + nb) * width end
  if kind == 0 then return (b + 1) * 86400 end
  local ym = b + 1
  return days_from_civil(1970 + math.floor(ym / 12), ym % 12 + 1, 1) * 86400
end
local spec, buckets, shadow = {}, {}, {}
local refused, wait, refused_spent = 0, -1, 0
for i = 1, #KEYS do
  local a = 1 + (i - 1) * 5
  local s = {limit = tonumber(ARGV[a + 1]), kind = tonumber(ARGV[a + 2]),
             width = tonumber(ARGV[a + 3]), nb = tonumber(ARGV[a + 4]),
             enforce = ARGV[a + 5] == '1'}
  spec[i] = s
  local b = bucket_of(s.kind, s.width)
  buckets[i] = b
  local fields = {}
  for k = b - s.nb + 1, b do fields[#fields + 1] = string.format('%.0f', k) end
  local vals = redis.call('HMGET', KEYS[i], unpack(fields))
  local spent = 0
  for j = 1, #vals do spent = spent + (tonumber(vals[j]) or 0) end
  if spent + amount > s.limit then
    if not s.enforce then
      shadow[#shadow + 1] = i
    elseif refused == 0 then
      refused, refused_spent = i, spent
      if amount <= s.limit then
        local left = spent
        for j = 1, #vals do
          left = left - (tonumber(vals[j]) or 0)
          if left + amount <= s.limit then
            wait = math.max(leaves_at(s.kind, s.width, s.nb, b - s.nb + j) - now, 0)
            break
          end
        end
      end
    end
  end
end
if refused > 0 then
  return {0, refused, tostring(wait), refused_spent, shadow, buckets}
end
for i = 1, #KEYS do
  local s, b = spec[i], buckets[i]
  -- Integers go to Redis as the caller's strings or '%.0f': Lua's own number-to-string
  -- conversion (%.14g) would write large ones in exponent form.
  redis.call('HINCRBY', KEYS[i], string.format('%.0f', b), ARGV[1])
  local ttl = leaves_at(s.kind, s.width, s.nb, b) - now + 60
  redis.call('PEXPIRE', KEYS[i], string.format('%.0f', math.ceil(ttl * 1000)))
  if redis.call('HLEN', KEYS[i]) > s.nb then
    for _, f in ipairs(redis.call('HKEYS', KEYS[i])) do
      if tonumber(f) < b - s.nb + 1 then redis.call('HDEL', KEYS[i], f) end
    end
  end
end
return {1, 0, '0', 0, shadow, buckets}
"""

# KEYS: the budgets' hashes. ARGV: delta (nano-USD), then the booked bucket per key.
_SETTLE: Final = """
for i = 1, #KEYS do
  local f = ARGV[i + 1]
  if redis.call('HEXISTS', KEYS[i], f) == 1 then
    if redis.call('HINCRBY', KEYS[i], f, ARGV[1]) < 0 then redis.call('HSET', KEYS[i], f, 0) end
  end
end
return 1
"""

_log = get_logger("gateway.budgets")


class ClusterBudgets:
    """Books ``scope: cluster`` budgets in Redis through ``limits``' client; its
    background writes (settlements) are owned, and closed, by ``limits``."""

    def __init__(self, limits: ClusterLimits) -> None:
        self._limits = limits
        self._admit = limits.client.script(_ADMIT)
        self._settle = limits.client.script(_SETTLE)

    def key(self, name: str) -> str:
        return self._limits.client.key("budget", "{budgets}", name)

    async def admit(self, budgets: list[Applied], booking: Booking) -> list[Applied]:
        """Run the admission script for ``budgets``; fill ``booking.cluster`` and
        ``booking.shadow_denied``. Returns the budgets to count locally instead (Redis
        unavailable, fail_open or shadow). Raises BudgetExceeded or CapacityExceeded."""
        args: list[Any] = [booking.amount]
        for b in budgets:
            args += [b.limit, KIND_CODES[b.spec.window], repr(b.window.width_s or 1.0)]
            args += [b.window.buckets, 1 if b.enforce else 0]
        try:
            reply = await self._admit([self.key(b.name) for b in budgets], args)
        except RedisUnavailable as exc:
            closed = [b for b in budgets if b.enforce and b.spec.on_redis_error == "fail_closed"]
            if closed:
                raise CapacityExceeded(
                    f"budget {closed[0].name!r} (cluster scope) cannot be checked: {exc}; "
                    "it is fail_closed, so nothing is sent. Retry shortly",
                    details={
                        "budget": closed[0].name,
                        "reason": "redis_unavailable",
                        "scope": "cluster",
                    },
                    retry_after_s=REDIS_RETRY_AFTER_S,
                ) from None
            booking.warnings.append(
                "budgets " + ", ".join(b.name for b in budgets) + ": Redis unavailable, "
                "counted by this sidecar alone (fail_open)"
            )
            return budgets
        admitted, refused, wait, spent, shadow, buckets = reply
        booking.shadow_denied += [budgets[int(i) - 1].name for i in shadow]
        if not int(admitted):
            wait_s = float(wait.decode() if isinstance(wait, bytes) else wait)
            budget = budgets[int(refused) - 1]
            raise exceeded(budget, int(spent), booking.amount, wait_s if wait_s >= 0 else None)
        booking.cluster = [(b, int(k)) for b, k in zip(budgets, buckets, strict=True)]
        return []

    def settle(self, booking: Booking, delta: int) -> None:
        """Add ``delta`` nano-USD to each cluster bucket of ``booking`` (in the background)."""
        if not booking.cluster or delta == 0:
            return
        keys = [self.key(b.name) for b, _ in booking.cluster]
        args = [delta, *(bucket for _, bucket in booking.cluster)]
        self._limits.spawn(self._write(keys, args), "budget-settle")

    async def _write(self, keys: list[str], args: list[int]) -> None:
        try:
            await self._settle(keys, args)
        except RedisUnavailable as exc:
            _log.warning("budget_settlement_lost", error=str(exc), delta_nano_usd=args[0])
