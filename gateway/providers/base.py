"""What every provider dialect module offers the call path (pure: no I/O).

A dialect is one module in :mod:`gateway.providers` that builds a :class:`Dialect`:

* ``usage(body)``: the :class:`TokenUsage` of a whole JSON answer, or None;
* ``stream_usage(events)``: the usage reported by a stream's parsed ``data:`` events;
* ``delta_text(event)``: the piece of generated text one stream event carries, or None;
* ``output_cap(parameters)``: the output-token cap a request body sets (0 when none);
  ``prompt_keys``: the body keys that hold the prompt, for the token estimate;
* ``exhausted_holds(headers, now)``: seconds until each rate limit that the answer's
  headers report as spent resets (``now`` is wall-clock time, for absolute resets).

Absent is not zero: an answer that reports no usage gives None, never 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class TokenUsage:
    """Token counts of one call. ``total`` is what ``tokens_used`` reports."""

    input: int | None
    output: int | None
    cached: int | None
    total: int


def count(value: Any) -> int | None:
    """``value`` if it is a token count (a non-negative int, not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def number(value: str | None) -> float | None:
    """A header value as a finite number, or None."""
    if value is None:
        return None
    try:
        parsed = float(value.strip())
    except ValueError:
        return None
    return parsed if math.isfinite(parsed) else None


def _no_usage(_: Any) -> TokenUsage | None:
    return None


def _no_stream_usage(_: list[Any]) -> TokenUsage | None:
    return None


def _no_text(_: Any) -> str | None:
    return None


def _no_cap(_: Mapping[str, Any]) -> int:
    return 0


def _no_holds(_: Mapping[str, str], __: float) -> list[float]:
    return []


@dataclass(frozen=True, slots=True)
class Dialect:
    """One provider's knowledge, as the call path uses it (see the module docstring)."""

    name: str
    usage: Callable[[Any], TokenUsage | None] = _no_usage
    stream_usage: Callable[[list[Any]], TokenUsage | None] = _no_stream_usage
    delta_text: Callable[[Any], str | None] = _no_text
    output_cap: Callable[[Mapping[str, Any]], int] = _no_cap
    prompt_keys: tuple[str, ...] = ()
    exhausted_holds: Callable[[Mapping[str, str], float], list[float]] = _no_holds


def last_reported(
    usage: Callable[[Any], TokenUsage | None], events: list[Any]
) -> TokenUsage | None:
    """The usage of the last stream event that reports one (OpenAI's final usage chunk,
    Gemini's last ``usageMetadata``)."""
    for event in reversed(events):
        if isinstance(event, dict):
            found = usage(event)
            if found is not None:
                return found
    return None


def positive_cap(value: Any) -> int:
    """A ``max_tokens``-like value as a cap: a positive int, else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
