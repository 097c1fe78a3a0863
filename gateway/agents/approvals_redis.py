"""Approval requests in Redis (``approvals.scope: cluster``): every sidecar on the same
Redis and key prefix sees the same requests, and an approval is claimed by exactly one
call among them (:mod:`gateway.agents.approvals`).

Keys (under ``redis.key_prefix``): ``approval:{id}``, a hash of the request's fields
(kept for twice its ``ttl_s``, so that a late decision is told "expired", not
"unknown"); ``approval-binding:{sha256}``, the id of the live request of a call (for
``ttl_s``; deleted when its approval is used); ``approvals``, a sorted set of ids by
request time for the list (the newest 10,000; pruned of ids whose hash is gone). The
hash keys are named in ARGV, not KEYS: one Redis server (or a primary), not a Redis
Cluster. Every change is one Lua
script, atomic on the server: two sidecars opening the same call get one request, and
two claims of one approval give one True. Waiting polls the hash every
:data:`gateway.agents.approvals.POLL_S`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, Final

from gateway.agents.approvals import FIELDS, StoreUnavailable, Verdict
from gateway.stores.redis import RedisClient, RedisUnavailable

#: KEYS: binding key, index; ARGV: id, now, ttl_s, hash key prefix, field/value pairs.
_OPEN: Final = """
local id = redis.call('GET', KEYS[1])
if id then
  local st = redis.call('HMGET', ARGV[4] .. id, 'state', 'expires_at')
  if st[1] and st[1] ~= 'used' and tonumber(st[2]) > tonumber(ARGV[2]) then
    return {id, 0}
  end
end
local h = ARGV[4] .. ARGV[1]
redis.call('HSET', h, 'binding_key', KEYS[1], unpack(ARGV, 5))
redis.call('PEXPIRE', h, math.ceil(tonumber(ARGV[3]) * 2000))
redis.call('SET', KEYS[1], ARGV[1], 'PX', math.ceil(tonumber(ARGV[3]) * 1000))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('ZREMRANGEBYRANK', KEYS[2], 0, -10001)
return {ARGV[1], 1}
"""
#: KEYS: hash; ARGV: verdict, who, now.
_DECIDE: Final = """
local st = redis.call('HMGET', KEYS[1], 'state', 'expires_at', 'ttl_s', 'binding_key', 'id')
if not st[1] then return 'unknown' end
if st[1] ~= 'pending' then return 'already' end
if tonumber(st[2]) <= tonumber(ARGV[3]) then return 'expired' end
local ttl = tonumber(st[3])
local expires = tonumber(ARGV[3]) + ttl
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'decided_by', ARGV[2], 'decided_at', ARGV[3],
           'expires_at', string.format('%.6f', expires))
redis.call('PEXPIRE', KEYS[1], math.ceil(ttl * 2000))
if redis.call('GET', st[4]) == st[5] then
  redis.call('PEXPIRE', st[4], math.ceil(ttl * 1000))
end
return 'ok'
"""
#: KEYS: hash; ARGV: now.
_CLAIM: Final = """
local st = redis.call('HMGET', KEYS[1], 'state', 'expires_at', 'binding_key', 'id')
if st[1] ~= 'approved' or tonumber(st[2]) <= tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'state', 'used', 'used_at', ARGV[1])
if redis.call('GET', st[3]) == st[4] then redis.call('DEL', st[3]) end
return 1
"""
#: KEYS: index; ARGV: hash key prefix, limit.
_RECENT: Final = """
local ids = redis.call('ZREVRANGE', KEYS[1], 0, tonumber(ARGV[2]) - 1)
local out = {}
for _, id in ipairs(ids) do
  local h = redis.call('HGETALL', ARGV[1] .. id)
  if #h == 0 then redis.call('ZREM', KEYS[1], id) else table.insert(out, h) end
end
return out
"""


def _record(flat: list[bytes]) -> dict[str, str]:
    pairs = [value.decode() for value in flat]
    record = dict(zip(pairs[::2], pairs[1::2], strict=True))
    record.pop("binding_key", None)
    return record


class RedisApprovalStore:
    """:class:`gateway.agents.approvals.ApprovalStore` on a :class:`RedisClient` (not
    owned: the runtime closes it). Raises StoreUnavailable when Redis cannot answer."""

    def __init__(self, redis: RedisClient) -> None:
        self._redis = redis
        self._open = redis.script(_OPEN)
        self._decide = redis.script(_DECIDE)
        self._claim = redis.script(_CLAIM)
        self._recent = redis.script(_RECENT)
        self._get = redis.script("return redis.call('HGETALL', KEYS[1])")
        self._hash = redis.key("approval", "")

    async def open(
        self, binding: str, record: dict[str, str], ttl_s: float
    ) -> tuple[dict[str, str], bool]:
        pairs: list[str] = []
        for name in FIELDS:
            if name in record:
                pairs += [name, record[name]]
        keys = [self._redis.key("approval-binding", binding), self._redis.key("approvals")]
        args = [record["id"], record["requested_at"], repr(ttl_s), self._hash, *pairs]
        approval_id, created = await self._run(self._open(keys, args))
        if created:
            return dict(record), True
        known = await self.get(approval_id.decode())
        return (known, False) if known is not None else (dict(record), True)

    async def decide(self, approval_id: str, verdict: Verdict, who: str, now: float) -> str:
        outcome = await self._run(self._decide([self._hash + approval_id], [verdict, who, now]))
        return outcome.decode() if isinstance(outcome, bytes) else str(outcome)

    async def claim(self, approval_id: str, now: float) -> bool:
        return bool(await self._run(self._claim([self._hash + approval_id], [repr(now)])))

    async def get(self, approval_id: str) -> dict[str, str] | None:
        flat = await self._run(self._get([self._hash + approval_id], []))
        return _record(flat) if flat else None

    async def recent(self, limit: int) -> list[dict[str, str]]:
        rows = await self._run(self._recent([self._redis.key("approvals")], [self._hash, limit]))
        return [_record(row) for row in rows]

    async def wait(self, approval_id: str, timeout_s: float) -> None:
        await asyncio.sleep(max(timeout_s, 0.0))  # polled: the caller reads the state next

    @staticmethod
    async def _run(operation: Awaitable[Any]) -> Any:
        try:
            return await operation
        except RedisUnavailable as exc:
            raise StoreUnavailable(str(exc)) from None

    async def aclose(self) -> None:
        return None
