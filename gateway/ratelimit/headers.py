"""Reading an upstream's rate-limit feedback from response headers (pure functions).

Sources:
- ``Retry-After``: RFC 9110 section 10.2.3, delay-seconds or an HTTP-date.
- ``retry-after-ms``: milliseconds; sent by OpenAI and Azure OpenAI (not standard).
- The providers' own "remaining / reset" headers: each dialect module of
  :mod:`gateway.providers` reads its own (``exhausted_holds``).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC
from email.utils import parsedate_to_datetime

from multidict import CIMultiDict, CIMultiDictProxy

from gateway.providers import exhausted_holds
from gateway.providers.base import number


def retry_after_s(headers: Mapping[str, str], now: float) -> float | None:
    """Seconds the upstream asks us to wait, from ``retry-after-ms`` (preferred: finer) or
    ``Retry-After`` (seconds or HTTP-date, RFC 9110 section 10.2.3); None if absent or
    unreadable. ``now`` is wall-clock time (``time.time()``), for HTTP-dates.
    A date in the past gives 0."""
    lower = _lowered(headers)
    millis = number(lower.get("retry-after-ms"))
    if millis is not None and millis >= 0:
        return millis / 1000.0
    value = lower.get("retry-after")
    if value is None:
        return None
    seconds = number(value)
    if seconds is not None:
        return seconds if seconds >= 0 else None
    try:
        when = parsedate_to_datetime(value.strip())
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # RFC 9110 dates are GMT
        when = when.replace(tzinfo=UTC)
    return max(when.timestamp() - now, 0.0)


def provider_hold_s(headers: Mapping[str, str], status: int, now: float) -> float | None:
    """How long a rate-limit group should admit nothing, from one upstream answer.

    The largest of: ``Retry-After`` / ``retry-after-ms`` when ``status`` is 429; and for
    every provider limit whose ``remaining`` header is 0, the time until its ``reset``
    header (:func:`gateway.providers.exhausted_holds`). None when the answer says nothing
    is exhausted. ``now`` is wall-clock time (``time.time()``), for HTTP-dates and RFC
    3339 times. Header names are matched case-insensitively.
    """
    lower = _lowered(headers)
    longest = 0.0
    if status == 429:
        wait = retry_after_s(lower, now)
        if wait is not None and wait > longest:
            longest = wait
    for hold in exhausted_holds(lower, now):
        if hold > longest:
            longest = hold
    return longest if longest > 0 else None


def _lowered(headers: Mapping[str, str]) -> Mapping[str, str]:
    if isinstance(headers, CIMultiDictProxy | CIMultiDict):
        return headers  # already case-insensitive (aiohttp's response headers)
    return {k.lower(): v for k, v in headers.items()}
