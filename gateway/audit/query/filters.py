"""Record filters of the audit query tool (pure).

A :class:`Filters` holds what the operator asked for; :meth:`Filters.call_predicate`
compiles it into one fast predicate over call records (``event: egress_call``) and
:meth:`Filters.event_predicate` into one over other audit events (breaker state
changes, policy start and reload), which only the agent, target, policy and time filters
concern.

Text filters match exactly, or as a shell-style pattern (``fnmatch``: ``*``, ``?``,
``[...]``) when the value holds one of those characters; giving a filter several times
matches any of the values. Times are ISO 8601 (``2025-01-31T12:00:00Z``; without an
offset: UTC) or relative to now (``90s``, ``15m``, ``2h``, ``1d``, ``1w``).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from gateway.audit.schema import CALL_EVENT

Record = dict[str, Any]
Predicate = Callable[[Record], bool]

_RELATIVE: Final = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$")
_UNITS: Final = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_GLOB_CHARS: Final = frozenset("*?[")


def parse_when(text: str, now: datetime | None = None) -> datetime:
    """An aware UTC datetime from ISO 8601 or a relative age (``15m`` = now - 15 min).

    Raises ``ValueError`` with a message naming the accepted forms.
    """
    relative = _RELATIVE.match(text)
    if relative:
        seconds = float(relative.group(1)) * _UNITS[relative.group(2)]
        return (now or datetime.now(UTC)) - timedelta(seconds=seconds)
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            f"{text!r} is neither ISO 8601 (2025-01-31T12:00:00Z) nor relative (15m, 2h, 1d)"
        ) from None
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)


def record_time(record: Record) -> datetime | None:
    """The record's ``timestamp`` as an aware datetime, or ``None`` if absent/invalid."""
    stamp = record.get("timestamp")
    if not isinstance(stamp, str):
        return None
    try:
        when = datetime.fromisoformat(stamp)
    except ValueError:
        return None
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when


def _text_match(field: str, values: Sequence[str]) -> Predicate:
    exact = frozenset(v for v in values if not _GLOB_CHARS & set(v))
    patterns = tuple(v for v in values if _GLOB_CHARS & set(v))

    def match(record: Record) -> bool:
        value = record.get(field)
        if not isinstance(value, str):
            return False
        return value in exact or any(fnmatch.fnmatchcase(value, p) for p in patterns)

    return match


@dataclass(frozen=True, slots=True)
class Filters:
    """What to select. Empty tuples and ``None`` select everything."""

    trace: tuple[str, ...] = ()
    correlation: tuple[str, ...] = ()
    agent: tuple[str, ...] = ()
    target: tuple[str, ...] = ()
    endpoint: tuple[str, ...] = ()
    code: tuple[str, ...] = ()
    decision: tuple[str, ...] = ()
    #: ``policy_sha256``: calls and policy records (start, reload) of these policies.
    policy: tuple[str, ...] = ()
    failed: bool = False
    since: datetime | None = None
    until: datetime | None = None
    min_latency_ms: float | None = None

    def _common(self) -> list[Predicate]:
        checks = [
            _text_match(field, values)
            for field, values in (
                ("agent_id", self.agent),
                ("target_system", self.target),
                ("policy_sha256", self.policy),
            )
            if values
        ]
        if self.since is not None or self.until is not None:
            since, until = self.since, self.until

            def in_window(record: Record) -> bool:
                when = record_time(record)
                if when is None:
                    return False
                return (since is None or when >= since) and (until is None or when <= until)

            checks.append(in_window)
        return checks

    def call_predicate(self) -> Predicate:
        """True for call records (``event: egress_call``) that match every filter."""
        return _all_of([_is_call, *self._call_checks()])

    def call_filter(self) -> Predicate | None:
        """Like :meth:`call_predicate` for records known to be calls; ``None``: no filter."""
        checks = self._call_checks()
        return _all_of(checks) if checks else None

    def event_filter(self) -> Predicate | None:
        """:meth:`event_predicate`, or ``None`` when it selects everything."""
        checks = self._common()
        return _all_of(checks) if checks else None

    def _call_checks(self) -> list[Predicate]:
        checks = self._common()
        for field, values in (
            ("trace_id", self.trace),
            ("correlation_id", self.correlation),
            ("endpoint", self.endpoint),
            ("error_code", self.code),
            ("decision", self.decision),
        ):
            if values:
                checks.append(_text_match(field, values))
        if self.failed:
            checks.append(lambda record: record.get("success") is not True)
        if self.min_latency_ms is not None:
            floor = self.min_latency_ms

            def slow(record: Record) -> bool:
                latency = record.get("latency_ms")
                return isinstance(latency, int | float) and latency >= floor

            checks.append(slow)
        return checks

    def event_predicate(self) -> Predicate:
        """True for any record passing the agent, target and time filters."""
        return _all_of(self._common())


def _is_call(record: Record) -> bool:
    return record.get("event") == CALL_EVENT


def _all_of(checks: list[Predicate]) -> Predicate:
    if not checks:
        return lambda _: True
    if len(checks) == 1:
        return checks[0]
    return lambda record: all(check(record) for check in checks)
