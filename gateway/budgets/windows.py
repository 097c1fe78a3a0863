"""Budget windows as buckets of spend (pure: no I/O, no clock of its own).

A window is kept as integer buckets of spend (nano-USD), each with an id:

* ``daily``: one bucket per UTC calendar day, id = days since 1970-01-01; the window is
  today's bucket, and it resets at 00:00 UTC.
* ``monthly``: one bucket per UTC calendar month, id = months since 1970-01; resets at
  00:00 UTC on the 1st.
* ``rolling`` (``per_hours`` H): 60 buckets of H minutes each (H * 3600 / 60 seconds),
  id = floor(epoch seconds / width); the window is the current bucket and the 59
  before it. A spend is counted for at least ``H * 59/60`` hours and at most H hours
  after it happened (it leaves with its whole bucket), so the limit holds over any
  period of ``H * 59/60`` hours; over exactly H hours up to one bucket's spend more can
  fall inside (the bucket that left at the start).

The same arithmetic runs inside Redis's Lua for cluster scope
(:mod:`gateway.budgets.cluster`); :func:`days_to_civil` and :func:`civil_to_days` are the
algorithms it uses (Howard Hinnant, "chrono-Compatible Low-Level Date Algorithms"),
tested here against :mod:`datetime`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

__all__ = [
    "ROLLING_BUCKETS",
    "Window",
    "civil_to_days",
    "days_to_civil",
]

#: Buckets of a rolling window.
ROLLING_BUCKETS: Final = 60
_DAY_S: Final = 86_400
#: Kind codes, as the Lua script reads them.
KIND_CODES: Final = {"daily": 0, "monthly": 1, "rolling": 2}


def days_to_civil(days: int) -> tuple[int, int, int]:
    """(year, month 1..12, day 1..31) of ``days`` since 1970-01-01 (proleptic Gregorian)."""
    z = days + 719_468
    era = (z if z >= 0 else z - 146_096) // 146_097
    doe = z - era * 146_097
    yoe = (doe - doe // 1460 + doe // 36_524 - doe // 146_096) // 365
    y = yoe + era * 400
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    d = doy - (153 * mp + 2) // 5 + 1
    m = mp + 3 if mp < 10 else mp - 9
    return (y + 1 if m <= 2 else y), m, d


def civil_to_days(year: int, month: int, day: int) -> int:
    """Days since 1970-01-01 of a (year, month, day) (proleptic Gregorian)."""
    y = year - 1 if month <= 2 else year
    era = (y if y >= 0 else y - 399) // 400
    yoe = y - era * 400
    mp = month - 3 if month > 2 else month + 9
    doy = (153 * mp + 2) // 5 + day - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146_097 + doe - 719_468


@dataclass(frozen=True, slots=True)
class Window:
    """One budget's window: its kind and, for ``rolling``, its length in hours."""

    kind: Literal["daily", "monthly", "rolling"]
    per_hours: float | None = None

    @property
    def width_s(self) -> float:
        """A rolling bucket's width in seconds (0 for calendar windows)."""
        return (self.per_hours or 0.0) * 3600 / ROLLING_BUCKETS

    @property
    def buckets(self) -> int:
        """How many buckets the window sums."""
        return ROLLING_BUCKETS if self.kind == "rolling" else 1

    def bucket(self, now_s: float) -> int:
        """The id of the bucket that epoch second ``now_s`` falls in."""
        if self.kind == "rolling":
            return math.floor(now_s / self.width_s)
        days = math.floor(now_s / _DAY_S)
        if self.kind == "daily":
            return days
        year, month, _ = days_to_civil(days)
        return (year - 1970) * 12 + month - 1

    def leaves_at(self, bucket: int) -> float:
        """Epoch seconds at which ``bucket`` stops counting (its window resets)."""
        if self.kind == "rolling":
            return (bucket + ROLLING_BUCKETS) * self.width_s
        if self.kind == "daily":
            return float((bucket + 1) * _DAY_S)
        year, month = divmod(bucket + 1, 12)
        return float(civil_to_days(1970 + year, month + 1, 1) * _DAY_S)

    def first(self, current: int) -> int:
        """The oldest bucket id still counted when ``current`` is the current one."""
        return current - self.buckets + 1

    def spent(self, buckets: Mapping[int, int], current: int) -> int:
        """The window's spend (nano-USD) given its buckets' spends."""
        if self.kind != "rolling":
            return buckets.get(current, 0)
        first = self.first(current)
        return sum(v for k, v in buckets.items() if first <= k <= current)

    def retry_after_s(
        self, buckets: Mapping[int, int], current: int, amount: int, limit: int, now_s: float
    ) -> float | None:
        """Seconds from ``now_s`` until ``amount`` fits under ``limit`` as buckets leave
        (and nothing more is spent); None if it never fits (``amount > limit``)."""
        if amount > limit:
            return None
        first = self.first(current)
        left = self.spent(buckets, current)
        for k in range(first, current + 1):
            left -= buckets.get(k, 0)
            if left + amount <= limit:
                return max(self.leaves_at(k) - now_s, 0.0)
        return max(self.leaves_at(current) - now_s, 0.0)  # pragma: no cover - loop ends it
