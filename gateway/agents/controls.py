"""The operator's stop switch (docs/features/stopping.md; design.md, "Stopping a runaway
agent").

A stop holds one agent (``scope: agent``), one target (``scope: target``) or every call of
the fleet (``scope: all``), with the operator's reason, who asked and when. While a stop
holds, a new call it covers is refused with AGENT_STOPPED (423, ``details.scope``,
``details.reason``) before any I/O, and the calls it covers that are in flight are
cancelled and answered the same (their open streams end with an error event: the edge
writes it, as for any failure after the first relayed byte).

Two stores, by ``controls.stop_switch.scope``:

* ``local``: this sidecar's memory; a restart forgets it.
* ``cluster``: a Redis hash (``{prefix}:controls:stops``, one field per stop) written
  and published (channel of the same name) in one script. Each sidecar reads the hash
  at start (a sidecar started later obeys at once), again on every published notice,
  and at least every ``poll_interval_s`` (a missed notice is caught within it). Redis
  down: the last state read holds (``on_redis_error: fail_open``), or every call is
  refused with AGENT_STOPPED, ``details.scope: all``, ``details.reason:
  stop_state_unavailable`` (``fail_closed``, and ``fail_open`` too until the first read:
  a sidecar started while Redis is down has no state to keep, and a stop may hold). A
  stop or resume asked while Redis is down is applied here at once and written to Redis
  when it answers again.

The decision (:func:`stop_for`) is pure; :class:`StopSwitch` holds the state, the
registry of calls in flight (task -> agent and target) and the Redis watcher;
:class:`Controls` is what the call path consults: the stop switch, then the repeated-call
breaker (:mod:`gateway.agents.repeats`), then the tool caps (:mod:`gateway.agents.caps`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

from gateway.agents.caps import CallCaps
from gateway.agents.repeats import RepeatedCalls, call_names, operations
from gateway.audit import get_logger
from gateway.errors import AgentStopped
from gateway.policy.controls import StopSwitchSpec

if TYPE_CHECKING:
    from gateway.envelope import ExternalCallRequest
    from gateway.providers.mcp import McpExchange
    from gateway.stores.redis import RedisClient

StopScope = Literal["agent", "target", "all"]
SCOPES: Final[tuple[StopScope, ...]] = ("agent", "target", "all")
#: ``details.reason`` of the refusal ``on_redis_error: fail_closed`` gives while the
#: cluster state cannot be read.
STATE_UNAVAILABLE: Final = "stop_state_unavailable"
#: Longest reason kept (it goes into every refusal and audit record).
MAX_REASON: Final = 500
_log = get_logger("gateway.agents.controls")

_WRITE: Final = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PUBLISH', KEYS[1], ARGV[1])
return 1
"""
_DELETE: Final = """
local n = redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('PUBLISH', KEYS[1], ARGV[1])
return n
"""
_READ: Final = "return redis.call('HGETALL', KEYS[1])"


@dataclass(frozen=True, slots=True)
class Stop:
    """One stop: its scope, the agent or target it names (``""`` for ``all``), the
    operator's reason, who asked (the request's ``by``, e.g. the operator's user name)
    and when (Unix seconds)."""

    scope: StopScope
    name: str
    reason: str
    by: str
    at: float

    @property
    def key(self) -> str:
        return stop_key(self.scope, self.name)

    def error(self) -> AgentStopped:
        """The refusal this stop gives (AGENT_STOPPED)."""
        what = "every call" if self.scope == "all" else f"{self.scope} {self.name!r}"
        return AgentStopped(
            f"an operator stopped {what}: {self.reason}. Do not retry until it is resumed.",
            details={"scope": self.scope, "name": self.name or None, "reason": self.reason},
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Stop:
        """Raises ValueError for a value that is not a stop (a foreign writer)."""
        raw = json.loads(text)
        if not isinstance(raw, dict) or raw.get("scope") not in SCOPES:
            raise ValueError("not a stop")
        return cls(
            scope=raw["scope"],
            name=str(raw.get("name", "")),
            reason=str(raw.get("reason", "")),
            by=str(raw.get("by", "")),
            at=float(raw.get("at", 0.0)),
        )


def stop_key(scope: StopScope, name: str) -> str:
    """``all``, ``agent:NAME`` or ``target:NAME`` (names cannot contain ``:``)."""
    return "all" if scope == "all" else f"{scope}:{name}"


def stop_for(stops: Mapping[str, Stop], agent: str, target: str | None) -> Stop | None:
    """The stop that holds a call of ``agent`` to ``target``, or None: ``all`` first,
    then the agent's, then the target's."""
    if not stops:
        return None
    keys = ["all", f"agent:{agent}"] + ([f"target:{target}"] if target else [])
    for key in keys:
        stop = stops.get(key)
        if stop is not None:
            return stop
    return None


def check_reason(reason: str) -> str:
    """The operator's reason, stripped. Raises ValueError when it is empty, longer than
    :data:`MAX_REASON` characters or holds a control character (it is copied into
    answers and audit records)."""
    text = reason.strip()
    if not text:
        raise ValueError("a reason is required")
    if len(text) > MAX_REASON:
        raise ValueError(f"the reason is longer than {MAX_REASON} characters")
    if any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 or c in "\u2028\u2029" for c in text):
        raise ValueError("the reason holds a control character")
    return text


class _Tracked:
    """:meth:`StopSwitch.track`'s block, one per switch: ``track`` has registered the
    task, and the block's end finds it again as the current task, so a call makes no
    object of its own (a class, not a generator context manager: it wraps every call)."""

    __slots__ = ("_switch",)

    def __init__(self, switch: StopSwitch) -> None:
        self._switch = switch

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> None:
        task = asyncio.current_task()
        if task is None:  # not in a task: nothing was registered
            return
        switch = self._switch
        switch._inflight.pop(task, None)
        stop = switch._cancelled.pop(task, None)
        if kind is not None and issubclass(kind, asyncio.CancelledError):
            if stop is None or task.uncancel() > 0:
                return  # another cancellation: it propagates
            raise stop.error() from None


class StopSwitch:
    """The stops in force on this sidecar, the calls in flight they can cancel, and (with
    ``cluster``, a :class:`~gateway.stores.redis.RedisClient`) the shared state.

    ``on_change(stops)`` is called after each change of the state (metrics)."""

    def __init__(
        self,
        spec: StopSwitchSpec,
        *,
        redis: RedisClient | None = None,
        on_change: Callable[[Mapping[str, Stop]], None] | None = None,
    ) -> None:
        self.spec = spec
        self._redis = redis if spec.scope == "cluster" else None
        self._on_change = on_change
        self.stops: dict[str, Stop] = {}
        #: Changes asked while Redis was down, written when it answers (key -> stop, or
        #: None for a resume).
        self._pending: dict[str, Stop | None] = {}
        self._unavailable = False
        #: Whether the shared state was read once (always, for a local switch): until
        #: then there is no "last state read" for fail_open to keep.
        self._read_once = self._redis is None
        self._inflight: dict[asyncio.Task[Any], tuple[str, str | None]] = {}
        self._cancelled: dict[asyncio.Task[Any], Stop] = {}
        self._task: asyncio.Task[None] | None = None
        self._tracked = _Tracked(self)
        if self._redis is not None:
            self._hash = self._redis.key("controls", "stops")
            self._write = self._redis.script(_WRITE)
            self._delete = self._redis.script(_DELETE)
            self._read = self._redis.script(_READ)

    # -- the call path ----------------------------------------------------------------

    def check(self, agent: str, target: str | None) -> None:
        """Raise AGENT_STOPPED when a stop holds a call of ``agent`` to ``target`` (or
        the cluster state is unreadable under ``fail_closed``)."""
        stop = stop_for(self.stops, agent, target)
        if stop is not None:
            raise stop.error()
        if self._unavailable and (self.spec.on_redis_error == "fail_closed" or not self._read_once):
            why = "is fail_closed" if self._read_once else "has no state read to keep"
            raise AgentStopped(
                "the stop switch's shared state cannot be read (Redis is unavailable) and "
                f"controls.stop_switch.on_redis_error {why} (a stop of the fleet may hold)",
                details={"scope": "all", "name": None, "reason": STATE_UNAVAILABLE},
            )

    def track(self, agent: str, target: str | None) -> _Tracked:
        """Register the current task as a call of ``agent`` to ``target`` while the block
        runs: a stop that covers it cancels it, and the block raises AGENT_STOPPED
        instead of CancelledError (another cancellation, such as the agent hanging up or
        the shutdown, still propagates). The task is registered now: use it as ``with
        switch.track(...):``, in the task it registers."""
        task = asyncio.current_task()
        if task is not None:  # not in a task: nothing to cancel
            self._inflight[task] = (agent, target)
        return self._tracked

    def moved(self, agent: str, target: str) -> None:
        """The current task's call (:meth:`track`) goes on to ``target`` (a fallback):
        raise AGENT_STOPPED when a stop holds a call of ``agent`` to it, else register
        the task as a call to it, so that a stop of ``target`` cancels it from now on."""
        self.check(agent, target)
        task = asyncio.current_task()
        if task is not None and task in self._inflight:
            self._inflight[task] = (agent, target)

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    # -- operator's changes -----------------------------------------------------------

    async def stop(self, stop: Stop) -> bool:
        """Put ``stop`` in force here at once, and in Redis with cluster scope. Returns
        False when Redis could not be written (the stop holds here and is written when
        Redis answers again)."""
        return await self._change(stop.key, stop)

    async def resume(self, scope: StopScope, name: str) -> tuple[bool, bool]:
        """Lift the stop of ``scope``/``name``: (it was in force here, Redis written)."""
        key = stop_key(scope, name)
        existed = key in self.stops
        return existed, await self._change(key, None)

    async def _change(self, key: str, stop: Stop | None) -> bool:
        self._apply_one(key, stop)
        if self._redis is None:
            return True
        self._pending[key] = stop
        return await self._flush()

    async def _flush(self) -> bool:
        from gateway.stores.redis import RedisUnavailable

        try:
            for key, stop in list(self._pending.items()):
                if stop is None:
                    await self._delete([self._hash], [key])
                else:
                    await self._write([self._hash], [key, stop.to_json()])
                if self._pending.get(key) is stop:
                    del self._pending[key]
        except RedisUnavailable as exc:
            _log.warning("stop_switch_write_failed", error=str(exc), pending=len(self._pending))
            return False
        return True

    def _apply_one(self, key: str, stop: Stop | None) -> None:
        stops = dict(self.stops)
        if stop is None:
            stops.pop(key, None)
        else:
            stops[key] = stop
        self._replace(stops)

    def _replace(self, stops: dict[str, Stop]) -> None:
        changed = stops != self.stops
        self.stops = stops
        if not changed:
            return
        for task, (agent, target) in list(self._inflight.items()):
            stop = stop_for(stops, agent, target)
            if stop is not None and task not in self._cancelled and not task.done():
                self._cancelled[task] = stop
                task.cancel("agent stopped")
        if self._on_change is not None:
            self._on_change(stops)

    # -- the cluster watcher ----------------------------------------------------------

    async def start(self) -> None:
        """With cluster scope: read the shared state once (a sidecar started after a stop
        obeys it at once), then watch it in a background task."""
        if self._redis is None:
            return
        await self._refresh()
        self._task = asyncio.create_task(self._watch(), name="stop-switch-watcher")

    async def _refresh(self) -> None:
        from gateway.stores.redis import RedisUnavailable

        assert self._redis is not None
        if self._pending and not await self._flush():
            self._unavailable = True
            return
        try:
            reply = await self._read([self._hash], [])
        except RedisUnavailable:
            self._unavailable = True  # the last state read holds
            return
        self._unavailable, self._read_once = False, True
        stops: dict[str, Stop] = {}
        for field, value in zip(reply[::2], reply[1::2], strict=True):
            try:
                stop = Stop.from_json(value)
            except (ValueError, TypeError, KeyError):
                _log.warning("stop_switch_bad_entry", key=field.decode(errors="replace"))
                continue
            stops[stop.key] = stop
        self._replace(stops)

    async def _watch(self) -> None:
        from gateway.stores.redis import RedisUnavailable

        assert self._redis is not None
        interval = self.spec.poll_interval_s
        subscription = self._redis.subscription(self._hash)
        try:
            while True:
                try:
                    await subscription.wait(interval)
                except RedisUnavailable:
                    await asyncio.sleep(interval)  # polling alone until it subscribes again
                await self._refresh()
        finally:
            await subscription.aclose()

    async def aclose(self) -> None:
        """Stop the watcher. Idempotent."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def now() -> float:
    """Unix seconds, for :attr:`Stop.at`."""
    return time.time()


class Controls:
    """The operator's controls the call path consults: the stop switch, the
    repeated-call breaker (:mod:`gateway.agents.repeats`) and the tool caps
    (:mod:`gateway.agents.caps`)."""

    def __init__(
        self,
        stops: StopSwitch | None = None,
        repeats: RepeatedCalls | None = None,
        caps: CallCaps | None = None,
    ) -> None:
        self.stops = stops if stops is not None else StopSwitch(StopSwitchSpec())
        self.repeats = repeats if repeats is not None else RepeatedCalls(None)
        self.caps = caps if caps is not None else CallCaps({})

    def check_here(
        self,
        agent: str,
        target: str,
        request: ExternalCallRequest,
        exchange: McpExchange | None,
        a2a: Any = None,
    ) -> list[str] | None:
        """:meth:`check` without a coroutine when no tool cap is set and the breaker is
        off (the stop switch alone) or counts the call here
        (:meth:`RepeatedCalls.check_here`): the same refusals raised and shadow refusals
        returned. None when it does not apply, having counted nothing (the stop switch
        was looked at, which changes nothing): the caller then awaits :meth:`check`."""
        if self.caps:
            return None
        self.stops.check(agent, target)
        spec = self.repeats.spec
        if spec is None:  # the stop switch alone
            return []
        refused = self.repeats.check_here(agent, target, request, exchange, a2a)
        if refused is None:
            return None
        if refused and spec.mode == "enforce":
            raise refused[0]
        return [f"repeated_call:{target}"] if refused else []

    async def check(
        self,
        agent: str,
        target: str,
        request: ExternalCallRequest,
        exchange: McpExchange | None,
        a2a: Any = None,
    ) -> list[str]:
        """Before any I/O of a call: raise AGENT_STOPPED when a stop holds it, REPEATED_CALL
        when the breaker (``mode: enforce``) refuses it, BUDGET_EXCEEDED when a tool cap
        is full, CAPACITY_EXCEEDED when the breaker or a cap cannot count it (cluster,
        Redis down, fail_closed). Returns the shadow refusals to record
        (``repeated_call:TARGET``, ``budget:NAME``)."""
        self.stops.check(agent, target)
        shadow = []
        spec = self.repeats.spec
        if spec is not None:  # off by default: no fingerprint to compute
            refused = self.repeats.check_here(agent, target, request, exchange, a2a)
            if refused is None:  # not a plain HTTP call counted here: its canonical JSON
                ops = operations(target, request, exchange, a2a)
                refused = await self.repeats.check(agent, ops)
            if refused and spec.mode == "enforce":
                raise refused[0]
            if refused:
                shadow.append(f"repeated_call:{target}")
        if self.caps:
            shadow += await self.caps.check(target, agent, call_names(request, exchange))
        return shadow

    def track(self, agent: str, target: str | None) -> _Tracked:
        """See :meth:`StopSwitch.track`."""
        return self.stops.track(agent, target)
