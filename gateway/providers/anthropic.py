"""The Anthropic dialect (Messages API).

Sources:
* Usage: ``usage.input_tokens`` + ``output_tokens``, plus ``cache_creation_input_tokens``
  and ``cache_read_input_tokens`` (Messages API reference). Streams carry input usage in
  ``message_start.message.usage`` and the cumulative output count in ``message_delta``,
  which may repeat the cache counts of ``message_start``: each is counted once.
* Stream text: ``content_block_delta`` events' ``delta.text``.
* Token cap: ``max_tokens``.
* Rate-limit headers, https://docs.anthropic.com/en/api/rate-limits ("Response headers"):
  ``anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-remaining`` and
  ``...-reset`` as an RFC 3339 time.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any, Final

from gateway.providers.base import Dialect, TokenUsage, count, number, positive_cap

_KINDS: Final = ("requests", "tokens", "input-tokens", "output-tokens")
_CACHE_KEYS: Final = ("cache_creation_input_tokens", "cache_read_input_tokens")


def combined_usage(usages: list[Any]) -> TokenUsage | None:
    """One usage from several ``usage`` objects of one answer (a stream's events)."""
    inp = out = cached = None
    seen = False
    for found in usages:
        if not isinstance(found, dict):
            continue
        seen = True
        if (v := count(found.get("input_tokens"))) is not None:
            inp = max(inp or 0, v)
        if (v := count(found.get("output_tokens"))) is not None:
            out = max(out or 0, v)  # message_delta reports the cumulative output count
        cache = sum(v for k in _CACHE_KEYS if (v := count(found.get(k))) is not None)
        if cache:
            cached = max(cached or 0, cache)
    if not seen or (inp is None and out is None and cached is None):
        return None
    return TokenUsage(inp, out, cached, (inp or 0) + (out or 0) + (cached or 0))


def usage(body: Any) -> TokenUsage | None:
    if not isinstance(body, dict):
        return None
    return combined_usage([body.get("usage")])


def stream_usage(events: list[Any]) -> TokenUsage | None:
    dicts = [e for e in events if isinstance(e, dict)]
    usages = [e.get("usage") for e in dicts]
    usages += [e["message"].get("usage") for e in dicts if isinstance(e.get("message"), dict)]
    return combined_usage(usages)


def delta_text(event: Any) -> str | None:
    if not isinstance(event, dict):
        return None
    delta = event.get("delta")
    if event.get("type") == "content_block_delta" and isinstance(delta, dict):
        text = delta.get("text")
        return text if isinstance(text, str) else None
    return None


def output_cap(parameters: Mapping[str, Any]) -> int:
    return positive_cap(parameters.get("max_tokens"))


def exhausted_holds(headers: Mapping[str, str], now: float) -> list[float]:
    """Seconds until each Anthropic limit whose ``remaining`` is 0 resets."""
    holds = []
    for kind in _KINDS:
        if number(headers.get(f"anthropic-ratelimit-{kind}-remaining")) == 0:
            wait = _rfc3339_until(headers.get(f"anthropic-ratelimit-{kind}-reset"), now)
            if wait is not None:
                holds.append(wait)
    return holds


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


DIALECT: Final = Dialect(
    name="anthropic",
    usage=usage,
    stream_usage=stream_usage,
    delta_text=delta_text,
    output_cap=output_cap,
    prompt_keys=("messages", "system", "tools"),
    exhausted_holds=exhausted_holds,
)
