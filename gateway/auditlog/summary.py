"""Per-agent and per-target figures over a stream of audit records (pure, streaming).

Memory grows with the number of agents and targets and with 8 bytes per call for the
latencies (``array('d')``, kept exactly so that percentiles are exact), never with the
size of the records.

Percentiles use linear interpolation between closest ranks (Hyndman & Fan type 7, the
default of numpy and R, ``statistics.quantiles(method="inclusive")``): for sorted
``x[0..n-1]`` and ``q`` in [0, 1], ``h = (n - 1) * q`` and
``p = x[floor(h)] + (h - floor(h)) * (x[floor(h) + 1] - x[floor(h)])``.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from gateway.audit_schema import BREAKER_EVENT, CALL_EVENT
from gateway.auditlog.filters import Predicate, Record

NONE_KEY: Final = "(none)"
PERCENTILES: Final = (("p50", 0.50), ("p95", 0.95), ("p99", 0.99))


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ascending ``sorted_values``; ``None`` if empty."""
    n = len(sorted_values)
    if n == 0:
        return None
    h = (n - 1) * q
    low = math.floor(h)
    if low + 1 >= n:
        return float(sorted_values[-1])
    return sorted_values[low] + (h - low) * (sorted_values[low + 1] - sorted_values[low])


def _number(value: Any) -> float:
    return value if isinstance(value, int | float) and not isinstance(value, bool) else 0


class GroupStats:
    """Figures of one agent, one target, or all calls."""

    __slots__ = (
        "breaker_opens",
        "calls",
        "error_codes",
        "latencies_ms",
        "rate_limit_wait_ms",
        "rate_limit_waits",
        "replays",
        "retries",
        "succeeded",
        "tokens_cached",
        "tokens_input",
        "tokens_output",
    )

    def __init__(self) -> None:
        self.calls = self.succeeded = self.replays = self.retries = 0
        self.tokens_input = self.tokens_output = self.tokens_cached = 0
        self.rate_limit_waits = 0
        self.rate_limit_wait_ms = 0.0
        self.breaker_opens = 0
        self.error_codes: dict[str, int] = {}
        self.latencies_ms = array("d")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready figures; latencies in ms, success_rate in [0, 1] (None: no calls)."""
        ordered = sorted(self.latencies_ms)
        return {
            "calls": self.calls,
            "succeeded": self.succeeded,
            "success_rate": self.succeeded / self.calls if self.calls else None,
            "replays": self.replays,
            "error_codes": dict(sorted(self.error_codes.items(), key=lambda kv: (-kv[1], kv[0]))),
            "latency_ms": {name: percentile(ordered, q) for name, q in PERCENTILES},
            "retries": self.retries,
            "tokens": {
                "input": self.tokens_input,
                "output": self.tokens_output,
                "cached": self.tokens_cached,
            },
            "rate_limit_waits": {
                "count": self.rate_limit_waits,
                "total_ms": self.rate_limit_wait_ms,
            },
            "breaker_opens": self.breaker_opens,
        }


@dataclass
class Summary:
    """Figures per agent (``agent_id``), per target (``target_system``) and in total."""

    agents: dict[str, GroupStats] = field(default_factory=dict)
    targets: dict[str, GroupStats] = field(default_factory=dict)
    total: GroupStats = field(default_factory=GroupStats)

    def _groups(self, record: Record) -> tuple[GroupStats, GroupStats, GroupStats]:
        agent = record.get("agent_id") or NONE_KEY
        target = record.get("target_system") or NONE_KEY
        by_agent = self.agents.get(agent)
        if by_agent is None:
            by_agent = self.agents[agent] = GroupStats()
        by_target = self.targets.get(target)
        if by_target is None:
            by_target = self.targets[target] = GroupStats()
        return by_agent, by_target, self.total

    def add_call(self, record: Record) -> None:
        """Count one call record (``event: egress_call``)."""
        ok = record.get("success") is True
        code = "" if ok else str(record.get("error_code") or NONE_KEY)
        replayed = record.get("replayed") is True
        latency = _number(record.get("latency_ms"))
        retries = max(int(_number(record.get("attempts"))) - 1, 0)
        tokens_in = int(_number(record.get("tokens_input")))
        tokens_out = int(_number(record.get("tokens_output")))
        tokens_cached = int(_number(record.get("tokens_cached")))
        wait = _number(record.get("rate_limit_wait_ms"))
        for group in self._groups(record):
            group.calls += 1
            if ok:
                group.succeeded += 1
            else:
                group.error_codes[code] = group.error_codes.get(code, 0) + 1
            if replayed:
                group.replays += 1
            group.latencies_ms.append(latency)
            group.retries += retries
            group.tokens_input += tokens_in
            group.tokens_output += tokens_out
            group.tokens_cached += tokens_cached
            if wait > 0:
                group.rate_limit_waits += 1
                group.rate_limit_wait_ms += wait

    def add_breaker_open(self, record: Record) -> None:
        """Count one ``breaker_state_change`` event whose ``new_state`` is ``open``."""
        for group in self._groups(record):
            group.breaker_opens += 1

    def to_dict(self) -> dict[str, Any]:
        """``{"agents": {name: figures}, "targets": {...}, "total": figures}``."""
        return {
            "agents": {k: v.to_dict() for k, v in sorted(self.agents.items())},
            "targets": {k: v.to_dict() for k, v in sorted(self.targets.items())},
            "total": self.total.to_dict(),
        }


def summarize(records: Iterable[Record], calls: Predicate, events: Predicate) -> Summary:
    """Summarise ``records``: calls passing ``calls``, breaker opens passing ``events``."""
    summary = Summary()
    add_call, add_open = summary.add_call, summary.add_breaker_open
    for record in records:
        event = record.get("event")
        if event == CALL_EVENT:
            if calls(record):
                add_call(record)
        elif event == BREAKER_EVENT and record.get("new_state") == "open" and events(record):
            add_open(record)
    return summary
