"""The repeated-call breaker (docs/features/stopping.md): an agent that sends the same
call again and again is looping.

"The same call" is the same agent, target, operation and canonical arguments: for an
MCP ``tools/call`` the tool's name and its ``arguments``; for any other call the method,
endpoint, parameters, query and body, hashed as the idempotency fingerprint hashes them
(:func:`gateway.idempotency.keys.fingerprint`, canonical JSON). MCP protocol traffic
(``initialize``, ``tools/list``, notifications) is not counted, nor are the endpoints
and tools ``controls.repeat_exempt`` names (polling a job's status is repeating by
design).

Every call is counted, refused ones too (an agent that keeps retrying a refused call is
still looping); a call seen more than ``max_repeats`` times within ``window_s`` seconds
is REPEATED_CALL (``details.count``: the calls seen in the window, this one included,
counted up to ``max_repeats + 1``; ``details.window_s``). ``mode: shadow`` records the
refusal (``decision: shadow_denied``, ``shadow_denials_total{kind="repeated_call"}``)
and lets the call go. Scope ``local`` counts in this sidecar's memory (bounded:
:data:`MAX_KEYS` calls, the oldest forgotten first); ``cluster`` in Redis (one sorted
set per call, expiring with its window), so that N replicas of one agent share the count.

A cluster count's Redis key is ``repeat:`` and the SHA-256 hex of ``AGENT\nDIGEST``
(:attr:`Operation.digest`): every sidecar of a fleet, of any version, names a call so.
A local count is keyed by the agent and the BLAKE2b-256 of the same canonical bytes
(never shared, so its hash is free to differ: about half SHA-256's cost in OpenSSL 3,
whose per-digest set-up dominates a short input; as collision-resistant). An HTTP call
with neither ``query`` nor ``body`` (the envelope's and the drop-in route's usual call)
is counted locally without its canonical JSON (:meth:`RepeatedCalls.check_here`): by the
agent, the target and the BLAKE2b-256 of orjson's sorted text of its parameters, its
method and endpoint (:func:`gateway.fastjson.sorted_text`: a text that names the
parameters exactly, keys in any order, as the canonical JSON does, without the
stdlib's float spelling to match). Equal calls give equal keys, different calls
different ones; a call whose parameters orjson cannot name so (a ``null``, which may be
NaN, integers past 64 bits) is counted by its canonical JSON, as every call once was.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Final

from gateway.errors import CapacityExceeded, RepeatedCall
from gateway.fastjson import sorted_text
from gateway.idempotency.keys import canonical_json, fingerprinted
from gateway.policy.controls import RepeatedCallsSpec
from gateway.policy.egress import endpoint_name
from gateway.providers.a2a import A2aExchange, said

if TYPE_CHECKING:
    from gateway.envelope import ExternalCallRequest
    from gateway.providers.mcp import McpExchange
    from gateway.stores.redis import RedisClient

#: Distinct calls the local counter remembers (each holds up to max_repeats + 1 times).
MAX_KEYS: Final = 10_000

#: A local count's key: the agent and the BLAKE2b-256 of the call's canonical JSON, or
#: the agent, the target and the BLAKE2b-256 of the sorted text of a plain HTTP call
#: (:meth:`RepeatedCalls.check_here`; of another length, so never equal to the first).
_LocalKey = tuple[str, bytes] | tuple[str, str, bytes]

_COUNT: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
redis.call('ZADD', KEYS[1], now, ARGV[3])
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -(tonumber(ARGV[2]) + 2))
redis.call('PEXPIRE', KEYS[1], window)
return redis.call('ZCARD', KEYS[1])
"""


@dataclass(frozen=True, slots=True)
class Operation:
    """One operation of a call, as the breaker counts it: ``name`` is the endpoint path
    or the MCP tool's name (what ``repeat_exempt`` matches); ``canonical`` the canonical
    JSON of the operation and its arguments (what is hashed, once, by the scope that
    counts it)."""

    name: str
    canonical: bytes

    @property
    def digest(self) -> str:
        """The SHA-256 hex of :attr:`canonical` (a cluster count's key is made of it)."""
        return hashlib.sha256(self.canonical).hexdigest()

    def local_key(self, agent: str) -> tuple[str, bytes]:
        """A local count's key: ``agent`` and the BLAKE2b-256 of :attr:`canonical`
        (bounded: an id and 32 bytes)."""
        return agent, hashlib.blake2b(self.canonical, digest_size=32).digest()


def operations(
    target: str, request: ExternalCallRequest, exchange: McpExchange | None, a2a: Any = None
) -> list[Operation]:
    """The operations a call is counted as: one per ``tools/call`` of an MCP request
    (none for protocol traffic), one for an A2A JSON-RPC request (``a2a``, its exchange:
    what it says, :func:`gateway.providers.a2a.said`; none for a card fetch, protocol
    traffic too), else one for the HTTP request (canonical as the idempotency
    fingerprint's, :func:`gateway.idempotency.keys.fingerprinted`)."""
    if a2a is not None:
        if not isinstance(a2a, A2aExchange):
            return []  # an Agent Card fetch: every client makes one
        return [Operation(a2a.method, canonical_json(["a2a", target, said(a2a)]))]
    if exchange is not None:
        found = []
        for message in exchange.requests:
            tool = message.tool
            if tool is None:
                continue
            args = message.params.get("arguments") if isinstance(message.params, dict) else None
            found.append(Operation(tool, canonical_json(["tool", target, tool, args])))
        return found
    body = request.body.model_dump() if request.body is not None else None
    name = endpoint_name(request.endpoint)  # one name for every spelling of the path
    canonical = fingerprinted(
        target, request.method, name, request.parameters, query=request.query, body=body
    )
    return [Operation(name, canonical)]


def call_names(request: ExternalCallRequest, exchange: McpExchange | None) -> list[str]:
    """What a call is, by name, as ``repeat_exempt`` and a budget's ``applies_to.tool``
    match it: the tools of an MCP request's ``tools/call`` messages (none for protocol
    traffic), else the endpoint path (:func:`~gateway.policy.egress.endpoint_name`: one
    name for every spelling of it)."""
    if exchange is not None:
        return [m.tool for m in exchange.requests if m.tool is not None]
    return [endpoint_name(request.endpoint)]


@lru_cache(maxsize=256)  # pure function of the policy's patterns; bounded
def _exempt(patterns: tuple[str, ...]) -> re.Pattern[str] | None:
    if not patterns:
        return None
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns))


def is_exempt(name: str, patterns: Sequence[str]) -> bool:
    """Whether ``repeat_exempt`` names the endpoint or tool ``name`` (``*`` globs)."""
    compiled = _exempt(tuple(patterns))
    return compiled is not None and compiled.match(name) is not None


def refusal(count: int, spec: RepeatedCallsSpec, name: str) -> RepeatedCall:
    """The REPEATED_CALL answer for a call seen ``count`` times in the window."""
    return RepeatedCall(
        f"the same call ({name}) was made {count} times within {spec.window_s:g} s, more "
        f"than the {spec.max_repeats} the policy allows: the agent looks stuck in a loop. "
        "Do not send it again with the same arguments.",
        details={
            "count": count,
            "window_s": spec.window_s,
            "max_repeats": spec.max_repeats,
            "operation": name,
        },
    )


class RepeatedCalls:
    """Counts calls per (agent, operation) and refuses the repeats (see the module
    docstring). Build with ``spec`` (None: off) and, for ``scope: cluster``, a Redis
    client."""

    def __init__(
        self,
        spec: RepeatedCallsSpec | None,
        exempt: Iterable[str] = (),
        *,
        redis: RedisClient | None = None,
    ) -> None:
        self._redis = redis
        self._local: OrderedDict[_LocalKey, deque[float]] = OrderedDict()
        self._script = redis.script(_COUNT) if redis is not None else None
        self.update(spec, exempt)

    def update(self, spec: RepeatedCallsSpec | None, exempt: Iterable[str]) -> None:
        """Take in a reloaded policy's rule; the counts so far are kept."""
        self.spec = spec
        self.exempt = tuple(exempt)
        self._exempt = _exempt(self.exempt)  # compiled once per policy, not per call

    def check_here(
        self,
        agent: str,
        target: str,
        request: ExternalCallRequest,
        exchange: McpExchange | None,
        a2a: Any = None,
    ) -> tuple[RepeatedCall, ...] | None:
        """:meth:`check` of the call's one operation without its canonical JSON, for a
        local count of an HTTP call with neither ``query`` nor ``body``: keyed by the
        agent, the target and the BLAKE2b-256 of the sorted text of its parameters
        (:func:`gateway.fastjson.sorted_text`; a JSON text has one end and holds no raw
        NUL, so the NUL-separated method and endpoint after it are told apart). None
        when it does not apply (cluster scope, an MCP or A2A exchange, a query or a body,
        parameters orjson cannot name exactly): the caller then awaits :meth:`check` of
        :func:`operations`."""
        spec = self.spec
        if (
            spec is None
            or spec.scope != "local"
            or exchange is not None
            or request.body is not None
            or request.query
            or a2a is not None
        ):
            return None
        name = endpoint_name(request.endpoint)
        if self._exempt is not None and self._exempt.match(name) is not None:
            return ()
        text = sorted_text(request.parameters)
        if text is None:
            return None
        # (The envelope refuses an endpoint with a lone surrogate: it has a UTF-8 form.)
        hashed = hashlib.blake2b(text, digest_size=32)
        hashed.update(f"\0{request.method}\0{name}".encode())  # no copy of the text
        digest = hashed.digest()
        count = self._count_local((agent, target, digest), spec)
        return (refusal(count, spec, name),) if count > spec.max_repeats else ()

    async def check(self, agent: str, ops: Sequence[Operation]) -> tuple[RepeatedCall, ...]:
        """Count each operation; the refusals they earn (empty: go ahead). Raises
        CAPACITY_EXCEEDED (retryable) when a cluster count cannot be taken and
        ``on_redis_error`` is ``fail_closed``."""
        spec = self.spec
        if spec is None:
            return ()
        refused = []
        exempt = self._exempt
        for op in ops:
            if exempt is not None and exempt.match(op.name) is not None:
                continue
            if spec.scope == "cluster":  # a Redis key of fixed length, as every sidecar's
                key = hashlib.sha256(f"{agent}\n{op.digest}".encode()).hexdigest()
                count = await self._count(key, op, agent, spec)
            else:
                count = self._count_local(op.local_key(agent), spec)
            if count > spec.max_repeats:
                refused.append(refusal(count, spec, op.name))
        return tuple(refused)

    async def _count(self, key: str, op: Operation, agent: str, spec: RepeatedCallsSpec) -> int:
        """The cluster count of Redis key ``key``; the local one of ``op`` when Redis
        cannot count it and ``on_redis_error`` lets the call go (``fail_open``)."""
        if spec.scope == "cluster" and self._redis is not None and self._script is not None:
            from gateway.stores.redis import RedisUnavailable

            try:
                args: list[str | int] = [
                    round(spec.window_s * 1000),
                    spec.max_repeats,
                    uuid.uuid4().hex,
                ]
                reply = await self._script([self._redis.key("repeat", key)], args)
                return int(reply)
            except RedisUnavailable as exc:
                if spec.on_redis_error == "fail_closed":
                    raise CapacityExceeded(
                        "the repeated-call breaker cannot count this call (Redis is "
                        "unavailable) and its on_redis_error is fail_closed",
                        details={"reason": "redis_unavailable"},
                        retry_after_s=1.0,
                    ) from exc
        return self._count_local(op.local_key(agent), spec)

    def _count_local(self, key: _LocalKey, spec: RepeatedCallsSpec) -> int:
        now = time.monotonic()
        local, limit = self._local, spec.max_repeats + 1
        seen = local.get(key)
        if seen is None:
            seen = local[key] = deque(maxlen=limit)  # most recent last
            if len(local) > MAX_KEYS:
                local.popitem(last=False)
        else:
            local.move_to_end(key)
            if seen.maxlen != limit:  # a reloaded policy changed max_repeats
                seen = local[key] = deque(seen, maxlen=limit)
            cutoff = now - spec.window_s
            while seen and seen[0] <= cutoff:
                seen.popleft()
        seen.append(now)
        return len(seen)
