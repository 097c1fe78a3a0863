"""Cost budgets (the policy's ``budgets:``): reserve a call's upper cost before sending,
settle it with the real cost after.

Admission: every budget that applies to the call (:meth:`Budgets.applying`) is checked at
once; if an enforced one cannot cover ``spent + reservation <= limit_usd`` the call is
refused with :class:`gateway.errors.BudgetExceeded` (not retryable,
``suggested_retry_after`` = seconds until enough of the window has reset) and nothing is
booked anywhere. Otherwise the reservation is booked in each (shadow budgets too: they
count every call that went out) and the call proceeds; a shadow budget that would have
refused is named in :attr:`Booking.shadow_denied`.

Local budgets are booked in this process (one event loop: the check and the booking are
one synchronous step); cluster budgets in Redis with one Lua script per admission and
one per settlement (:mod:`gateway.budgets.cluster`). Settlement (:meth:`Budgets.settle`):
the real cost replaces the reservation (``actual_usd``), 0 releases it (nothing reached
the upstream), None keeps it (the upstream may have acted and the cost is unknown). It
is charged to the bucket the reservation was booked in (if that bucket has left its
window, the difference no longer matters to it).

Bound (README, "Cost and budgets"): the spend booked in a window never exceeds
``limit_usd`` at admission; real spend exceeds it only by what the calls in flight cost
beyond their reservations, i.e. at most ``K * max(actual - reserved)`` for K concurrent
calls, and 0 when every reservation is an upper bound (text prompts with an output cap,
at a known price: :mod:`gateway.cost`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any, Final

from gateway.budgets.windows import Window
from gateway.errors import BudgetExceeded
from gateway.policy.budgets import BudgetSpec

if TYPE_CHECKING:
    from gateway.budgets.cluster import ClusterBudgets
    from gateway.budgets.journal import BudgetJournal

__all__ = ["NANO_USD", "Applied", "Booking", "Budgets", "LocalLedger", "to_nano"]

#: Spend is counted in integer nano-USD (so sums are exact, in Python and in Lua).
NANO_USD: Final = 1_000_000_000


def to_nano(usd: float) -> int:
    """USD as nano-USD, rounded up (a reservation is never smaller than its estimate)."""
    return math.ceil(usd * NANO_USD)


@dataclass(frozen=True, slots=True)
class Applied:
    """A budget that applies to a call: its name, spec, window and limit in nano-USD."""

    name: str
    spec: BudgetSpec
    window: Window
    limit: int

    @property
    def enforce(self) -> bool:
        return self.spec.mode == "enforce"


@dataclass(slots=True)
class Booking:
    """One call's reservation: per budget, the bucket booked and the amount (nano-USD)."""

    amount: int
    local: list[tuple[Applied, int]] = field(default_factory=list)
    cluster: list[tuple[Applied, int]] = field(default_factory=list)
    shadow_denied: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    settled: bool = False


class LocalLedger:
    """Spend per budget and bucket, in this process; with a ``journal``, starting from
    what it recorded and recording every change to it before the call goes out (spend
    kept across a restart: :mod:`gateway.budgets.journal`)."""

    def __init__(self, journal: BudgetJournal | None = None) -> None:
        self._journal = journal
        self._spent: dict[str, dict[int, int]] = {}
        if journal is not None:
            self._spent = {name: dict(b) for name, b in journal.totals.items()}

    def _record(self, changes: list[tuple[str, int, int]]) -> None:
        if self._journal is not None and self._journal.record(changes):
            self._journal.compact(self._spent)

    def spent(self, budget: Applied, now_s: float) -> int:
        """The budget's spend in its current window (nano-USD)."""
        buckets = self._spent.get(budget.name, {})
        return budget.window.spent(buckets, budget.window.bucket(now_s))

    def admit(
        self, budgets: list[Applied], amount: int, now_s: float
    ) -> tuple[BudgetExceeded | None, list[tuple[Applied, int]], list[str]]:
        """Check every budget, then book ``amount`` in each, unless an enforced one
        refuses (then nothing is booked). Returns (refusal, bookings, shadow denials)."""
        shadow: list[str] = []
        refusal: BudgetExceeded | None = None
        current = {b.name: b.window.bucket(now_s) for b in budgets}
        for budget in budgets:
            buckets = self._spent.get(budget.name, {})
            spent = budget.window.spent(buckets, current[budget.name])
            if spent + amount <= budget.limit:
                continue
            if not budget.enforce:
                shadow.append(budget.name)
            elif refusal is None:
                wait = budget.window.retry_after_s(
                    buckets, current[budget.name], amount, budget.limit, now_s
                )
                refusal = exceeded(budget, spent, amount, wait)
        if refusal is not None:
            return refusal, [], shadow
        booked = []
        for budget in budgets:
            bucket = current[budget.name]
            buckets = self._spent.setdefault(budget.name, {})
            buckets[bucket] = buckets.get(bucket, 0) + amount
            self._forget(budget, buckets, bucket)
            booked.append((budget, bucket))
        self._record([(b.name, k, self._spent[b.name][k]) for b, k in booked])
        return None, booked, shadow

    def adjust(self, name: str, bucket: int, delta: int) -> None:
        buckets = self._spent.get(name)
        if buckets is None or bucket not in buckets:
            return  # the bucket has left its window
        buckets[bucket] = max(buckets[bucket] + delta, 0)
        self._record([(name, bucket, buckets[bucket])])

    def keep_only(self, names: set[str]) -> None:
        gone = set(self._spent) - names
        for name in gone:
            del self._spent[name]
        if gone and self._journal is not None:
            self._journal.compact(self._spent)

    @staticmethod
    def _forget(budget: Applied, buckets: dict[int, int], current: int) -> None:
        first = budget.window.first(current)
        if len(buckets) > budget.window.buckets:
            for k in [k for k in buckets if k < first]:
                del buckets[k]


def exceeded(budget: Applied, spent: int, amount: int, wait_s: float | None) -> BudgetExceeded:
    """The refusal of a call whose ``amount`` does not fit ``budget`` (spent so far)."""
    limit_usd = budget.spec.limit_usd or 0.0
    if wait_s is None:
        message = (
            f"the call's cost estimate ({amount / NANO_USD:.6f} USD) is more than budget "
            f"{budget.name!r}'s whole limit ({limit_usd:g} USD); lower max_tokens or "
            "shorten the prompt"
        )
    else:
        message = (
            f"budget {budget.name!r} ({limit_usd:g} USD per {_window_words(budget.spec)}) "
            f"cannot cover the call: {spent / NANO_USD:.6f} USD spent or reserved, the call "
            f"may cost up to {amount / NANO_USD:.6f} USD; it resets in {wait_s:.0f} s"
        )
    return BudgetExceeded(
        message,
        details={
            "reason": "too_large" if wait_s is None else "budget_spent",
            "budget": budget.name,
            "limit_usd": limit_usd,
            "spent_usd": round(spent / NANO_USD, 9),
            "estimate_usd": round(amount / NANO_USD, 9),
            "window": budget.spec.window,
            "scope": budget.spec.scope,
        },
        retry_after_s=wait_s,
    )


def _window_words(spec: BudgetSpec) -> str:
    if spec.window == "rolling":
        return f"{spec.per_hours:g} h (rolling)"
    return "UTC day" if spec.window == "daily" else "UTC month"


class Budgets:
    """The budgets of a policy, by name. ``cluster`` books the ``scope: cluster`` ones
    in Redis (without it they are counted per process); ``journal`` keeps the local
    spend across a restart; ``clock`` gives epoch seconds."""

    def __init__(
        self,
        specs: Mapping[str, BudgetSpec],
        *,
        cluster: ClusterBudgets | None = None,
        clock: Callable[[], float] = time.time,
        journal: BudgetJournal | None = None,
    ) -> None:
        self.cluster = cluster
        self.ledger = LocalLedger(journal)
        self._clock = clock
        self.update(specs)

    def update(self, specs: Mapping[str, BudgetSpec]) -> None:
        """Hot reload: a budget keeps its spend under its name (spend is spend). Budgets
        without ``limit_usd`` (only ``max_calls``: :mod:`gateway.agents.caps`) book no
        USD."""
        self._budgets = [
            Applied(name, spec, Window(spec.window, spec.per_hours), to_nano(spec.limit_usd))
            for name, spec in sorted(specs.items())
            if spec.limit_usd is not None
        ]
        self.ledger.keep_only({b.name for b in self._budgets})

    def __bool__(self) -> bool:
        return bool(self._budgets)

    def levels(self) -> list[tuple[str, str, float | None, float]]:
        """Each budget as (name, scope, spent USD in its current window or None, limit
        USD), for the metrics. Spent is None for a cluster budget (its spend is in Redis,
        read only by admissions); a cluster budget counted here because this sidecar runs
        without Redis reports this sidecar's spend."""
        now = self._clock()
        return [
            (
                b.name,
                b.spec.scope,
                None
                if b.spec.scope == "cluster" and self.cluster is not None
                else self.ledger.spent(b, now) / NANO_USD,
                b.limit / NANO_USD,
            )
            for b in self._budgets
        ]

    def snapshot(self) -> list[dict[str, Any]]:
        """Each budget as the operator's console shows it: ``name``, ``limit_usd``,
        ``spent_usd`` (booked in this process in the current window; a ``cluster``
        budget's shared spend is in Redis), ``window``, ``scope``."""
        now = self._clock()
        return [
            {
                "name": b.name,
                "limit_usd": b.spec.limit_usd,
                "spent_usd": round(self.ledger.spent(b, now) / NANO_USD, 6),
                "window": b.spec.window,
                "scope": b.spec.scope,
            }
            for b in self._budgets
        ]

    def applying(
        self, target: str, group: str | None, agent: str, tools: Sequence[str] = ()
    ) -> list[Applied]:
        """The budgets whose ``applies_to`` matches a call (every key given must match;
        ``tool`` matches when one of ``tools``, the call's MCP tools or its endpoint
        path, matches its glob)."""
        found = []
        for budget in self._budgets:
            where = budget.spec.applies_to
            if (
                (where.target is None or where.target == target)
                and (where.rate_limit_group is None or where.rate_limit_group == group)
                and (where.agent is None or where.agent == agent)
                and (where.tool is None or any(fnmatchcase(t, where.tool) for t in tools))
            ):
                found.append(budget)
        return found

    async def reserve(self, budgets: list[Applied], amount_usd: float) -> Booking:
        """Book ``amount_usd`` against ``budgets`` (see the module docstring). Raises
        :class:`BudgetExceeded`, or CapacityExceeded (retryable) when a fail-closed
        cluster budget cannot reach Redis."""
        booking = Booking(to_nano(amount_usd))
        cluster = [b for b in budgets if b.spec.scope == "cluster" and self.cluster is not None]
        local = [b for b in budgets if b not in cluster]
        booking.warnings += [
            f"budget {b.name!r} (scope: cluster) is counted by this sidecar alone: it runs "
            "without Redis (the redis section needs a restart)"
            for b in local
            if b.spec.scope == "cluster"
        ]
        if cluster:
            assert self.cluster is not None
            fallback = await self.cluster.admit(cluster, booking)
            local += fallback  # fail_open budgets while Redis is unavailable
        refusal, booked, shadow = self.ledger.admit(local, booking.amount, self._clock())
        if refusal is not None:
            if booking.cluster and self.cluster is not None:
                self.cluster.settle(booking, -booking.amount)  # give the cluster's back
            raise refusal
        booking.local = booked
        booking.shadow_denied += shadow
        return booking

    def settle(self, booking: Booking, actual_usd: float | None) -> None:
        """Replace the reservation with ``actual_usd`` (0 releases it; None keeps it).
        Once per booking; later calls do nothing."""
        if booking.settled or actual_usd is None:
            booking.settled = True
            return
        booking.settled = True
        delta = to_nano(actual_usd) - booking.amount
        if delta == 0:
            return
        for budget, bucket in booking.local:
            self.ledger.adjust(budget.name, bucket, delta)
        if booking.cluster and self.cluster is not None:
            self.cluster.settle(booking, delta)
