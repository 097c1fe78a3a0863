"""Per-agent, per-target and per-model figures over a stream of audit records (pure,
streaming).

A call's model is the one sent (``model_sent``, after a pin), else the one priced
(``cost_model``); a call that names neither is not counted per model. Drift is a record's
``model_drift`` (the answer named another model than the one sent).

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

from gateway.audit.query.filters import Predicate, Record
from gateway.audit.schema import BREAKER_EVENT, CALL_EVENT

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


_NUMBERS: Final = frozenset({int, float})


class GroupStats:
    """Figures of one agent, one target, or all calls."""

    __slots__ = (
        "breaker_opens",
        "calls",
        "cost_unknown",
        "cost_usd",
        "error_codes",
        "latencies_ms",
        "rate_limit_wait_ms",
        "rate_limit_waits",
        "replays",
        "retries",
        "shadow_denied",
        "succeeded",
        "tokens_cached",
        "tokens_input",
        "tokens_output",
    )

    def __init__(self) -> None:
        self.calls = self.succeeded = self.replays = self.retries = 0
        self.shadow_denied = 0  # answered, and a mode: shadow rule would have refused it
        self.tokens_input = self.tokens_output = self.tokens_cached = 0
        self.rate_limit_waits = 0
        self.rate_limit_wait_ms = 0.0
        self.breaker_opens = 0
        self.cost_usd = 0.0  # spend: the sum of the records' known cost_usd
        self.cost_unknown = 0  # answered calls whose cost_usd is null
        self.error_codes: dict[str, int] = {}
        self.latencies_ms = array("d")

    def merge(self, other: GroupStats) -> None:
        """Add ``other``'s figures to these."""
        self.calls += other.calls
        self.succeeded += other.succeeded
        self.replays += other.replays
        self.shadow_denied += other.shadow_denied
        self.retries += other.retries
        self.tokens_input += other.tokens_input
        self.tokens_output += other.tokens_output
        self.tokens_cached += other.tokens_cached
        self.rate_limit_waits += other.rate_limit_waits
        self.rate_limit_wait_ms += other.rate_limit_wait_ms
        self.breaker_opens += other.breaker_opens
        self.cost_usd += other.cost_usd
        self.cost_unknown += other.cost_unknown
        for code, count in other.error_codes.items():
            self.error_codes[code] = self.error_codes.get(code, 0) + count
        self.latencies_ms.extend(other.latencies_ms)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready figures; latencies in ms, success_rate in [0, 1] (None: no calls)."""
        ordered = sorted(self.latencies_ms)
        return {
            "calls": self.calls,
            "succeeded": self.succeeded,
            "success_rate": self.succeeded / self.calls if self.calls else None,
            "replays": self.replays,
            "shadow_denied": self.shadow_denied,
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
            # Spend in USD (known costs only) and the answered calls of unknown cost.
            "cost_usd": round(self.cost_usd, 9),
            "cost_unknown_calls": self.cost_unknown,
        }


class ModelStats:
    """Figures of one model: calls, known spend in USD, drifted answers by the model
    the answer named."""

    __slots__ = ("calls", "cost_usd", "drift")

    def __init__(self) -> None:
        self.calls = 0
        self.cost_usd = 0.0
        self.drift: dict[str, int] = {}

    def add(self, record: Record) -> None:
        """Count one call record of this model."""
        self.calls += 1
        cost: Any = record.get("cost_usd")
        if type(cost) in _NUMBERS:
            self.cost_usd += cost
        drift = record.get("model_drift")
        if isinstance(drift, dict):
            answered = _name(drift.get("answered"))
            self.drift[answered] = self.drift.get(answered, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        """``{calls, cost_usd, drift: {answered model: count}, drifted}``."""
        return {
            "calls": self.calls,
            "cost_usd": round(self.cost_usd, 9),
            "drifted": sum(self.drift.values()),
            "drift": dict(sorted(self.drift.items())),
        }


def _name(value: Any) -> str:
    if type(value) is str and value:
        return value
    return NONE_KEY if value is None or value == "" else str(value)


@dataclass
class Summary:
    """Figures per (agent, target) pair, merged per agent, per target and in total.

    One group per pair keeps the per-record work to one update; :meth:`agents`,
    :meth:`targets` and :meth:`total` merge the pairs when asked (once each).
    """

    pairs: dict[tuple[str, str], GroupStats] = field(default_factory=dict)
    #: Figures per model (the model sent, else the one priced).
    models: dict[str, ModelStats] = field(default_factory=dict)
    _merged: dict[str, Any] = field(default_factory=dict, repr=False)

    def _pair(self, record: Record) -> GroupStats:
        key = (_name(record.get("agent_id")), _name(record.get("target_system")))
        group = self.pairs.get(key)
        if group is None:
            group = self.pairs[key] = GroupStats()
        return group

    def add_call(self, record: Record) -> None:
        """Count one call record (``event: egress_call``)."""
        get = record.get
        group = self._pair(record)
        group.calls += 1
        if get("success") is True:
            group.succeeded += 1
        else:
            code = get("error_code")
            code = code if type(code) is str else _name(code)
            group.error_codes[code] = group.error_codes.get(code, 0) + 1
        if get("replayed") is True:
            group.replays += 1
        if get("decision") == "shadow_denied":
            group.shadow_denied += 1
        value: Any = get("latency_ms")
        group.latencies_ms.append(value if type(value) in _NUMBERS else 0.0)
        value = get("attempts")
        if type(value) is int and value > 1:
            group.retries += value - 1
        value = get("tokens_input")
        if type(value) is int:
            group.tokens_input += value
        value = get("tokens_output")
        if type(value) is int:
            group.tokens_output += value
        value = get("tokens_cached")
        if type(value) is int:
            group.tokens_cached += value
        value = get("cost_usd")
        if type(value) in _NUMBERS:
            group.cost_usd += value
        elif get("status_code") is not None and get("cost_reason") != "no_dialect":
            group.cost_unknown += 1  # the upstream answered, and nobody knows the cost
        value = get("rate_limit_wait_ms")
        if type(value) in _NUMBERS and value > 0:
            group.rate_limit_waits += 1
            group.rate_limit_wait_ms += value
        value = get("model_sent") or get("cost_model")
        if type(value) is str:
            stats = self.models.get(value)
            if stats is None:
                stats = self.models[value] = ModelStats()
            stats.add(record)

    def add_breaker_open(self, record: Record) -> None:
        """Count one ``breaker_state_change`` event whose ``new_state`` is ``open``."""
        self._pair(record).breaker_opens += 1

    def _merge(self, by: int | None) -> dict[str, GroupStats]:
        merged: dict[str, GroupStats] = {}
        for key, group in sorted(self.pairs.items()):
            name = "all" if by is None else key[by]
            merged.setdefault(name, GroupStats()).merge(group)
        return merged

    def agents(self) -> dict[str, GroupStats]:
        """Figures per ``agent_id``, by name."""
        if "agents" not in self._merged:
            self._merged["agents"] = self._merge(0)
        return self._merged["agents"]  # type: ignore[no-any-return]

    def targets(self) -> dict[str, GroupStats]:
        """Figures per ``target_system``, by name."""
        if "targets" not in self._merged:
            self._merged["targets"] = self._merge(1)
        return self._merged["targets"]  # type: ignore[no-any-return]

    def total(self) -> GroupStats:
        """Figures of every call."""
        if "total" not in self._merged:
            self._merged["total"] = self._merge(None).get("all", GroupStats())
        return self._merged["total"]  # type: ignore[no-any-return]

    def to_dict(self) -> dict[str, Any]:
        """``{"agents": {name: figures}, "targets": {...}, "models": {model: ModelStats
        figures}, "total": figures}``."""
        return {
            "agents": {k: v.to_dict() for k, v in self.agents().items()},
            "targets": {k: v.to_dict() for k, v in self.targets().items()},
            "models": {k: v.to_dict() for k, v in sorted(self.models.items())},
            "total": self.total().to_dict(),
        }


def summarize(
    records: Iterable[Record], calls: Predicate | None = None, events: Predicate | None = None
) -> Summary:
    """Summarise ``records``: calls passing ``calls``, breaker opens passing ``events``.

    ``None`` selects all. Only ``egress_call`` records are counted as calls, whatever
    the predicates say.
    """
    summary = Summary()
    add_call, add_open = summary.add_call, summary.add_breaker_open
    for record in records:
        event = record.get("event")
        if event == CALL_EVENT:
            if calls is None or calls(record):
                add_call(record)
        elif (
            event == BREAKER_EVENT
            and record.get("new_state") == "open"
            and (events is None or events(record))
        ):
            add_open(record)
    return summary
