"""Reading a provider's rate-limit feedback from response headers (pure functions).

Sources:
- ``Retry-After``: RFC 9110 section 10.2.3, delay-seconds or an HTTP-date.
- ``retry-after-ms``: milliseconds; sent by OpenAI and Azure OpenAI (not standard).
- OpenAI, https://platform.openai.com/docs/guides/rate-limits ("Rate limits in
  headers"): ``x-ratelimit-remaining-requests`` / ``-tokens`` (a count) and
  ``x-ratelimit-reset-requests`` / ``-tokens`` (a duration such as ``1s``, ``6m0s``,
  ``20ms``, ``1h2m3.5s``; Azure OpenAI sends plain seconds). Azure sends ``-1`` for
  "unknown", which is not exhaustion.
- Anthropic, https://docs.anthropic.com/en/api/rate-limits ("Response headers"):
  ``anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-remaining`` and
  ``...-reset`` as an RFC 3339 time.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Final

from multidict import CIMultiDict, CIMultiDictProxy

_OPENAI_KINDS: Final = ("requests", "tokens")
_ANTHROPIC_KINDS: Final = ("requests", "tokens", "input-tokens", "output-tokens")
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(h|ms|us|µs|ns|m|s)")
_UNIT_S: Final = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def retry_after_s(headers: Mapping[str, str], now: float) -> float | None:
    """Seconds the provider asks us to wait, from ``retry-after-ms`` (preferred: finer) or
    ``Retry-After`` (seconds or HTTP-date, RFC 9110 section 10.2.3); None if absent or
    unreadable. ``now`` is wall-clock time (``time.time()``), for HTTP-dates.
    A date in the past gives 0."""
    lower = _lowered(headers)
    millis = _number(lower.get("retry-after-ms"))
    if millis is not None and millis >= 0:
        return millis / 1000.0
    value = lower.get("retry-after")
    if value is None:
        return None
    seconds = _number(value)
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
    every OpenAI or Anthropic limit whose ``remaining`` header is 0, the time until its
    ``reset`` header. None when the answer says nothing is exhausted. ``now`` is
    wall-clock time (``time.time()``), for HTTP-dates and RFC 3339 times. Header names
    are matched case-insensitively.
    """
    lower = _lowered(headers)
    holds: list[float] = []
    if status == 429:
        wait = retry_after_s(lower, now)
        if wait is not None:
            holds.append(wait)
    for kind in _OPENAI_KINDS:
        if _number(lower.get(f"x-ratelimit-remaining-{kind}")) == 0:
            wait = _duration_s(lower.get(f"x-ratelimit-reset-{kind}"))
            if wait is not None:
                holds.append(wait)
    for kind in _ANTHROPIC_KINDS:
        if _number(lower.get(f"anthropic-ratelimit-{kind}-remaining")) == 0:
            wait = _rfc3339_until(lower.get(f"anthropic-ratelimit-{kind}-reset"), now)
            if wait is not None:
                holds.append(wait)
    positive = [h for h in holds if h > 0]
    return max(positive) if positive else None


def _lowered(headers: Mapping[str, str]) -> Mapping[str, str]:
    if isinstance(headers, CIMultiDictProxy | CIMultiDict):
        return headers  # already case-insensitive (aiohttp's response headers)
    return {k.lower(): v for k, v in headers.items()}


def _number(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        number = float(value.strip())
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _duration_s(value: str | None) -> float | None:
    """A Go-style duration (``6m0s``, ``20ms``, ``1h2m3.5s``) or plain seconds."""
    if value is None:
        return None
    value = value.strip()
    plain = _number(value)
    if plain is not None:
        return plain if plain >= 0 else None
    parts = _DURATION_PART.findall(value)
    if not parts or "".join(n + u for n, u in parts) != value:
        return None
    return sum(float(n) * _UNIT_S[u] for n, u in parts)


def _rfc3339_until(value: str | None, now: float) -> float | None:
    if value is None:
        return None
    try:
        when = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.tzinfo is None:
        return None
    return when.timestamp() - now
