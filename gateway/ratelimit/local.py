"""Rate-limit groups: a token bucket per group, waiters served in arrival order.

Guarantee (a bound you can check against any log of admission times, on the event
loop's clock): a group with ``burst`` B and ``requests_per_second`` r admits at most
``B + r*T`` calls in any window of T seconds (both ends included). In a half-open window
``[t, t+T)`` the count is strictly below ``B + r*T``. A true upstream window of "N calls
per W seconds" is therefore kept by any ``burst`` B in 1..N with
``requests_per_second = (N + 1 - B) / W`` (``burst: 1`` gives the highest steady rate);
if the upstream counts both ends of its window, or network jitter matters, use
``B + r*W <= N`` instead. See docs/resilience.md.

Waiting: a call waits at most ``min(max_queue_s, deadline - now)``. Whether it can be
admitted in time is computed when it arrives (the bucket is deterministic), so a call
that cannot make it gets :class:`CapacityExceeded` at once, with ``retry_after_s`` = the
time until the group could admit it. Waiters are served strictly first come, first
served: aiolimiter wakes waiters smallest-first, which would let small token requests
starve a large one, so only this module's FIFO ever waits; aiolimiter's bucket decides.

Token budget (``tokens_per_minute`` C): a second bucket of capacity C drained at C/60
tokens per second. :meth:`RateLimitGroup.acquire` reserves an estimate
(:func:`gateway.providers.estimate_tokens`); :meth:`RateLimitGroup.reconcile` refunds or
charges the difference once the real usage is known (a charge may take the bucket past C,
and later calls wait for it). Worst case: reservations admitted in any window of T seconds
total at most ``C + C*T/60``; real usage can exceed that by the under-estimate of the
calls not yet reconciled, i.e. at most ``sum over calls in flight of (actual - estimate)``.
With ``max_tokens`` set, output cannot exceed the estimate and a text prompt's tokens
cover at least one UTF-8 byte each, so a call is under-estimated by at most 3/4 of its
prompt bytes plus the provider's per-message framing (a few tokens per message); without
``max_tokens`` its output is unbounded by the estimate. K concurrent calls can thus
exceed the limit by K times that, once; the debt is charged back when they finish.

Provider feedback: :meth:`RateLimitGroup.hold_for` (fed by
:func:`gateway.ratelimit.headers.provider_hold_s`) makes the group admit nothing until
the provider's reset time, capped at ``MAX_PROVIDER_HOLD_S``.

Policy keys: ``rate_limit_groups.<name>.requests_per_second``, ``.burst``,
``.tokens_per_minute``, ``.max_queue_s``; ``targets.<name>.rate_limit_group``. Groups
with ``scope: cluster`` are built by the ``cluster`` factory given to
:class:`RateLimitGroups` (:class:`gateway.ratelimit.cluster.ClusterLimits`: shared through
Redis, with this module's limiter as the fail-open fallback); without one they are
limited per process.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from aiolimiter import AsyncLimiter

from gateway.errors import CapacityExceeded
from gateway.policy import RateLimitGroupSpec

__all__ = [
    "MAX_PROVIDER_HOLD_S",
    "AdmitHook",
    "GroupFactory",
    "RateLimitGroup",
    "RateLimitGroups",
]

#: A provider hold longer than this is cut to it (a bogus header must not freeze a group).
MAX_PROVIDER_HOLD_S: Final = 3600.0
# Float rounding can make the bucket disagree with a projection by ~1e-15 s; these keep
# a timer from spinning and a waiter from being refused over rounding.
_MIN_STEP_S: Final = 1e-6
_SLACK_S: Final = 1e-6

AdmitHook = Callable[[str, float], None]
#: Builds the group of a ``scope: cluster`` spec: ``(name, spec, on_admit) -> group``.
GroupFactory = Callable[[str, RateLimitGroupSpec, AdmitHook | None], "RateLimitGroup"]


def loop_deadline(deadline: float, loop: asyncio.AbstractEventLoop) -> float:
    """A ``time.monotonic()`` deadline on ``loop.time()``, the clock the buckets and their
    timers use (the same clock with asyncio's loop; uvloop keeps its own, in ms steps)."""
    return loop.time() + (deadline - time.monotonic())


class _Bucket(AsyncLimiter):
    """aiolimiter's leaky bucket (level rises by each admission, drains at ``rate_per_s``,
    admits while ``level + amount <= capacity``: :meth:`has_capacity`), plus what it
    lacks: adding at the instant of the check, refunds, charges past capacity, and the
    time of the last check. These touch aiolimiter 1.x's ``_leak()``, ``_level`` and
    ``_last_check`` (unchanged since 1.0; tests/test_ratelimit.py pins them)."""

    __slots__ = ()

    def __init__(self, capacity: float, rate_per_s: float) -> None:
        super().__init__(max_rate=capacity, time_period=capacity / rate_per_s)

    @property
    def rate_per_s(self) -> float:
        return self.max_rate / self.time_period

    @property
    def checked_at(self) -> float:
        """Loop time of the last :meth:`has_capacity` / :meth:`level` (the level's time)."""
        return self._last_check

    def level(self) -> float:
        self._leak()
        return self._level

    def add(self, amount: float) -> None:
        """Add ``amount`` at :attr:`checked_at`, even past capacity (so: right after
        :meth:`has_capacity` for an admission, after :meth:`level` for a charge)."""
        self._level += amount

    def refund(self, amount: float) -> None:
        self._leak()
        self._level = max(self._level - amount, 0.0)

    def projection(self) -> _Projection:
        return _Projection(self.level(), self.checked_at, self.rate_per_s, self.max_rate)


@dataclass(slots=True)
class _Projection:
    """A bucket's future, for computing admission times without waiting for them."""

    level: float
    at: float
    rate: float
    capacity: float

    def fit_at(self, amount: float, t: float) -> float:
        """Earliest time >= t at which ``amount`` fits."""
        if max(self.level - self.rate * (t - self.at), 0.0) + amount <= self.capacity:
            return t
        # While an amount does not fit the level is above zero, so it drains linearly.
        return self.at + (self.level + amount - self.capacity) / self.rate

    def add(self, amount: float, t: float) -> None:
        self.level = max(self.level - self.rate * (t - self.at), 0.0) + amount
        self.at = t


@dataclass(eq=False, slots=True)
class _Waiter:
    tokens: int
    arrived_at: float
    give_up_at: float
    limit: str  # "queue_timeout" or "deadline": which budget binds
    future: asyncio.Future[float] = field(repr=False)


class RateLimitGroup:
    """One rate-limit group: a request bucket, an optional token bucket, a FIFO of waiters.

    Use from one event loop. ``on_admit(group, loop_time)`` is called at each admission
    (for metrics and for checking the bound).
    """

    def __init__(
        self, name: str, spec: RateLimitGroupSpec, *, on_admit: AdmitHook | None = None
    ) -> None:
        self.name = name
        self.spec = spec
        self._requests = _Bucket(spec.burst, spec.requests_per_second)
        tpm = spec.tokens_per_minute
        self._tokens = _Bucket(tpm, tpm / 60.0) if tpm else None
        self._queue: deque[_Waiter] = deque()
        self._hold_until = -math.inf
        self._hold_reason = ""
        self._timer: asyncio.TimerHandle | None = None
        self._on_admit = on_admit

    @property
    def queued(self) -> int:
        """Calls waiting now."""
        return len(self._queue)

    async def acquire(
        self,
        *,
        tokens: int = 0,
        deadline: float,
        warnings: list[str] | None = None,
        shadow: list[str] | None = None,
    ) -> float:
        """Wait for capacity for one call reserving ``tokens``; return the seconds waited.

        ``deadline`` is absolute, on ``time.monotonic()`` (the call's clock; the group
        schedules on the event loop's, see :func:`loop_deadline`). Waits at most
        ``min(max_queue_s, deadline - now)``, behind every call that arrived earlier.
        Raises :class:`CapacityExceeded` (retryable, ``details.reason`` "queue_timeout",
        "deadline" or "provider_hold", ``retry_after_s`` = seconds until the group could
        admit it) at once if it cannot be admitted in time, or later if a provider hold
        or a token charge pushes it past its budget; non-retryable with reason
        "too_large" if ``tokens`` exceeds ``tokens_per_minute``. ``warnings``, if given,
        receives the call's warnings for its audit record (a local group has none).

        A group with ``mode: shadow`` never waits and never refuses: the call is booked
        at once (past capacity if need be: the group counts every call that went out,
        so after a first "would deny" it reports more than enforcement would refuse),
        and if the enforced group would have refused it, the group's name is appended
        to ``shadow`` (a wait it would have imposed goes to ``warnings``). Returns 0.
        """
        if self.spec.mode == "shadow":
            return self._shadow(tokens, deadline, warnings, shadow)
        tokens = self._checked_tokens(tokens)
        loop = asyncio.get_running_loop()
        return await self._acquire_local(tokens, loop_deadline(deadline, loop), loop.time())

    def _shadow(
        self,
        tokens: int,
        deadline: float,
        warnings: list[str] | None,
        shadow: list[str] | None,
    ) -> float:
        """:meth:`acquire` of a shadow group (see there), on this process's buckets."""
        try:
            tokens = self._checked_tokens(tokens)
        except CapacityExceeded:
            _note(shadow, self.name)  # too large for the group: enforcement refuses it
            return 0.0
        loop = asyncio.get_running_loop()
        now = loop.time()
        if now >= self._hold_until and self._try_admit(tokens) is not None:
            return 0.0
        budget, _ = self._budget(now, loop_deadline(deadline, loop), now)
        admit_at = self._project(now, tokens)
        if admit_at > now + budget + _SLACK_S:
            _note(shadow, self.name)
        elif warnings is not None:
            warnings.append(
                f"rate-limit group {self.name!r} (shadow) would have made the call wait "
                f"{admit_at - now:.3f} s"
            )
        # Booked now, past capacity if need be: the same level a later admission leaves.
        self._requests.level()
        self._requests.add(1)
        if tokens and self._tokens is not None:
            self._tokens.level()
            self._tokens.add(tokens)
        if self._on_admit is not None:
            self._on_admit(self.name, self._requests.checked_at)
        return 0.0

    def _checked_tokens(self, tokens: int) -> int:
        """``tokens`` to reserve (0 without a token budget); refuses impossible requests."""
        if tokens < 0:
            raise ValueError("tokens must be >= 0")
        if self._tokens is None:
            return 0
        if tokens > self._tokens.max_rate:
            raise CapacityExceeded(
                f"the call's token estimate ({tokens}) exceeds rate-limit group "
                f"{self.name!r}'s tokens_per_minute ({self.spec.tokens_per_minute}); "
                "lower max_tokens or shorten the prompt",
                details={"group": self.name, "reason": "too_large", "tokens": tokens},
                retryable=False,
            )
        return tokens

    def _budget(self, now: float, deadline: float, arrived_at: float) -> tuple[float, str]:
        """Seconds a call that arrived at ``arrived_at`` may still wait at ``now``, and
        which limit binds ("deadline" or "queue_timeout")."""
        queue_left = self.spec.max_queue_s - (now - arrived_at)
        if deadline - now < queue_left:
            return max(deadline - now, 0.0), "deadline"
        return max(queue_left, 0.0), "queue_timeout"

    async def _acquire_local(self, tokens: int, deadline: float, arrived_at: float) -> float:
        """:meth:`acquire` on this process's buckets for checked ``tokens``, counting the
        queue budget from ``arrived_at`` (loop time); the seconds waited from now."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        budget, limit = self._budget(now, deadline, arrived_at)
        if not self._queue and now >= self._hold_until:
            admitted_at = self._try_admit(tokens)
            if admitted_at is not None:
                return 0.0
        admit_at = self._project(now, tokens)
        if admit_at > now + budget:
            raise self._rejection(now, admit_at, now + budget, limit)
        waiter = _Waiter(tokens, now, now + budget, limit, loop.create_future())
        self._queue.append(waiter)
        self._pump()
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if waiter in self._queue:
                self._queue.remove(waiter)
                self._replan()
            raise

    def reconcile(self, reserved: int, actual: int) -> None:
        """Settle a call's token reservation with its real usage: refund ``reserved -
        actual`` or charge ``actual - reserved`` (possibly past capacity; waiters that a
        charge pushes past their budget get :class:`CapacityExceeded`). No-op without
        ``tokens_per_minute``. Call it once per admitted call (``actual=0`` if the call
        used no tokens, e.g. it never reached the provider)."""
        if self._tokens is None or actual == reserved:
            return
        if actual < reserved:
            self._tokens.refund(reserved - actual)
            self._pump()
        else:
            self._tokens.level()
            self._tokens.add(actual - reserved)
            self._replan()

    def hold_for(self, seconds: float, *, reason: str) -> None:
        """Admit nothing for ``seconds`` (capped at ``MAX_PROVIDER_HOLD_S``), because the
        provider said so (``reason``, e.g. "retry-after", goes into error details). A
        hold only ever extends. Waiters whose budget it exceeds get
        :class:`CapacityExceeded` with reason "provider_hold" at once."""
        if not seconds > 0:
            return
        until = asyncio.get_running_loop().time() + min(seconds, MAX_PROVIDER_HOLD_S)
        if until > self._hold_until:
            self._hold_until = until
            self._hold_reason = reason
            self._replan()

    def held_for_s(self) -> float:
        """Seconds left of the current provider hold (0 if none)."""
        return max(self._hold_until - asyncio.get_running_loop().time(), 0.0)

    # --- internals ------------------------------------------------------------------

    def _try_admit(self, tokens: int) -> float | None:
        """Admit now if both buckets have room; return the admission's loop time."""
        if not self._requests.has_capacity(1):
            return None
        if tokens and self._tokens is not None:
            if not self._tokens.has_capacity(tokens):
                return None
            self._tokens.add(tokens)
        # Booked at the instant of the check, so the bound holds on these times exactly.
        self._requests.add(1)
        admitted_at = self._requests.checked_at
        if self._on_admit is not None:
            self._on_admit(self.name, admitted_at)
        return admitted_at

    def _projections(self) -> tuple[_Projection, _Projection | None]:
        tok = self._tokens.projection() if self._tokens is not None else None
        return self._requests.projection(), tok

    @staticmethod
    def _fit(req: _Projection, tok: _Projection | None, tokens: int, t: float) -> float:
        t = req.fit_at(1, t)
        if tokens and tok is not None:
            # Draining only lowers the request bucket, so it still fits at the later time.
            t = tok.fit_at(tokens, t)
        return t

    @staticmethod
    def _add(req: _Projection, tok: _Projection | None, tokens: int, t: float) -> None:
        req.add(1, t)
        if tokens and tok is not None:
            tok.add(tokens, t)

    def _project(self, now: float, tokens: int) -> float:
        """When a call arriving now would be admitted, behind everyone queued."""
        req, tok = self._projections()
        t = max(req.at, self._hold_until)
        for w in self._queue:
            t = self._fit(req, tok, w.tokens, t)
            self._add(req, tok, w.tokens, t)
        return self._fit(req, tok, tokens, t)

    def _replan(self) -> None:
        """After a change that can delay waiters (hold, charge, a waiter leaving), refuse
        at once those that can no longer make it, and re-arm the timer."""
        now = asyncio.get_running_loop().time()
        req, tok = self._projections()
        t = max(req.at, self._hold_until)
        kept: deque[_Waiter] = deque()
        for w in self._queue:
            if w.future.done():
                continue
            at = self._fit(req, tok, w.tokens, t)
            if at > w.give_up_at + _SLACK_S:
                w.future.set_exception(self._rejection(now, at, w.give_up_at, w.limit))
                continue
            self._add(req, tok, w.tokens, at)
            t = at
            kept.append(w)
        self._queue = kept
        self._pump()

    def _pump(self) -> None:
        """Admit the head of the queue while it fits, then sleep until it will."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._queue:
            head = self._queue[0]
            if head.future.done():
                self._queue.popleft()
                continue
            if now >= self._hold_until:
                admitted_at = self._try_admit(head.tokens)
                if admitted_at is not None:
                    self._queue.popleft()
                    head.future.set_result(max(admitted_at - head.arrived_at, 0.0))
                    continue
            req, tok = self._projections()
            at = self._fit(req, tok, head.tokens, max(req.at, self._hold_until))
            if at > head.give_up_at + _SLACK_S:
                self._queue.popleft()
                head.future.set_exception(self._rejection(now, at, head.give_up_at, head.limit))
                continue
            self._timer = loop.call_at(max(at, now + _MIN_STEP_S), self._pump)
            return

    def _rejection(
        self, now: float, admit_at: float, give_up_at: float, limit: str
    ) -> CapacityExceeded:
        reason = "provider_hold" if self._hold_until > give_up_at else limit
        wait = admit_at - now
        details: dict[str, Any] = {"group": self.name, "reason": reason, "queued": len(self._queue)}
        if reason == "provider_hold":
            details["hold"] = self._hold_reason
        return CapacityExceeded(
            f"rate-limit group {self.name!r} cannot admit the call within its "
            f"{'deadline' if limit == 'deadline' else 'max_queue_s'}; "
            f"capacity in {wait:.3f} s, retry then",
            details=details,
            retry_after_s=wait,
        )

    def _inherit(self, old: RateLimitGroup) -> None:
        """Start from ``old``'s usage (clamped to the new sizes) so a reload is no free burst."""
        self._requests.level()
        self._requests.add(min(old._requests.level(), self._requests.max_rate))
        if self._tokens is not None and old._tokens is not None:
            self._tokens.level()
            self._tokens.add(min(old._tokens.level(), self._tokens.max_rate))
        self._hold_until, self._hold_reason = old._hold_until, old._hold_reason


def _note(shadow: list[str] | None, name: str) -> None:
    if shadow is not None and name not in shadow:
        shadow.append(name)


class RateLimitGroups:
    """The rate-limit groups of a policy (``rate_limit_groups``), by name.

    ``cluster`` builds the groups whose spec says ``scope: cluster``
    (:meth:`gateway.ratelimit.cluster.ClusterLimits.group`); without it every group is
    local to this process.
    """

    def __init__(
        self,
        specs: Mapping[str, RateLimitGroupSpec],
        *,
        on_admit: AdmitHook | None = None,
        cluster: GroupFactory | None = None,
    ) -> None:
        self._on_admit = on_admit
        self._cluster = cluster
        self._groups = {n: self._make(n, s) for n, s in specs.items()}

    def _make(self, name: str, spec: RateLimitGroupSpec) -> RateLimitGroup:
        if spec.scope == "cluster" and self._cluster is not None:
            return self._cluster(name, spec, self._on_admit)
        return RateLimitGroup(name, spec, on_admit=self._on_admit)

    def get(self, name: str) -> RateLimitGroup | None:
        return self._groups.get(name)

    def names(self) -> list[str]:
        return sorted(self._groups)

    def update(self, specs: Mapping[str, RateLimitGroupSpec]) -> None:
        """Hot reload (call on the event loop): unchanged groups keep their state (same
        object); changed groups start from the old group's usage clamped to the new
        sizes, and its hold; removed groups are dropped (calls already waiting on them
        finish there). A cluster group's shared state stays in Redis, under its name."""
        groups: dict[str, RateLimitGroup] = {}
        for name, spec in specs.items():
            old = self._groups.get(name)
            if old is not None and old.spec == spec:
                groups[name] = old
                continue
            group = self._make(name, spec)
            if old is not None:
                group._inherit(old)
            groups[name] = group
        self._groups = groups
