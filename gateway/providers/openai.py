"""The OpenAI dialect (Chat Completions and the Responses API).

Sources:
* Usage: ``usage.prompt_tokens`` / ``completion_tokens`` / ``total_tokens``, cached in
  ``usage.prompt_tokens_details.cached_tokens`` (Chat Completions API reference); the
  Responses API's ``input_tokens`` / ``output_tokens`` / ``input_tokens_details``. Streams
  carry ``usage`` in the last chunk when ``stream_options.include_usage`` is set.
* Stream text: ``choices[0].delta.content`` of each chunk.
* Token caps: ``max_tokens``, ``max_completion_tokens`` (Chat), ``max_output_tokens``
  (Responses).
* Rate-limit headers, https://platform.openai.com/docs/guides/rate-limits ("Rate limits in
  headers"): ``x-ratelimit-remaining-requests`` / ``-tokens`` (a count) and
  ``x-ratelimit-reset-requests`` / ``-tokens`` (a duration such as ``1s``, ``6m0s``,
  ``20ms``, ``1h2m3.5s``; Azure OpenAI sends plain seconds). Azure sends ``-1`` for
  "unknown", which is not exhaustion.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from gateway.providers.base import (
    Dialect,
    ErrorHint,
    TokenUsage,
    count,
    error_object,
    last_reported,
    number,
    positive_cap,
)

_KINDS: Final = ("requests", "tokens")
_OUTPUT_KEYS: Final = ("max_tokens", "max_completion_tokens", "max_output_tokens")
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(h|ms|us|µs|ns|m|s)")
_UNIT_S: Final = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
#: ``error.code`` / ``error.type`` values that mean the account is out of quota or credit.
QUOTA_CODES: Final = frozenset(
    {
        "insufficient_quota",
        "credit_balance_exhausted",
        "organization_spend_limit_exceeded",
        "project_spend_limit_exceeded",
        "organization_usage_limit_exceeded",
        "billing_not_active",
        "billing_hard_limit_reached",
    }
)


def usage(body: Any) -> TokenUsage | None:
    """Usage of a Chat Completions or Responses answer (or one stream chunk)."""
    if not isinstance(body, dict):
        return None
    found = body.get("usage")
    if not isinstance(found, dict):
        return None
    inp = count(found.get("prompt_tokens", found.get("input_tokens")))
    out = count(found.get("completion_tokens", found.get("output_tokens")))
    details = found.get("prompt_tokens_details") or found.get("input_tokens_details") or {}
    cached = count(details.get("cached_tokens")) if isinstance(details, dict) else None
    total = count(found.get("total_tokens"))
    if total is None:
        if inp is None and out is None:
            return None
        total = (inp or 0) + (out or 0)
    return TokenUsage(inp, out, cached, total)


def stream_usage(events: list[Any]) -> TokenUsage | None:
    return last_reported(usage, events)


def delta_text(event: Any) -> str | None:
    if not isinstance(event, dict):
        return None
    choices = event.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        delta = choices[0].get("delta")
        if isinstance(delta, dict) and isinstance(delta.get("content"), str):
            return str(delta["content"])
    return None


def output_cap(parameters: Mapping[str, Any]) -> int:
    return max(positive_cap(parameters.get(key)) for key in _OUTPUT_KEYS)


def exhausted_holds(headers: Mapping[str, str], now: float) -> list[float]:
    """Seconds until each OpenAI limit whose ``remaining`` is 0 resets."""
    holds = []
    for kind in _KINDS:
        if number(headers.get(f"x-ratelimit-remaining-{kind}")) == 0:
            wait = duration_s(headers.get(f"x-ratelimit-reset-{kind}"))
            if wait is not None:
                holds.append(wait)
    return holds


def duration_s(value: str | None) -> float | None:
    """A Go-style duration (``6m0s``, ``20ms``, ``1h2m3.5s``) or plain seconds."""
    if value is None:
        return None
    value = value.strip()
    plain = number(value)
    if plain is not None:
        return plain if plain >= 0 else None
    parts = _DURATION_PART.findall(value)
    if not parts or "".join(n + u for n, u in parts) != value:
        return None
    return sum(float(n) * _UNIT_S[u] for n, u in parts)


def error_hint(status: int, headers: Mapping[str, str], body: Any) -> ErrorHint | None:
    """``quota`` for a 4xx OpenAI quota or billing error (module docstring), else None.
    ``error.code`` is read before ``error.type``: it is the finer of the two."""
    del headers  # x-should-retry is read for every dialect (gateway.providers.error_hint)
    error = error_object(body)
    if error is None or not 400 <= status < 500:
        return None
    for key in ("code", "type"):
        value = error.get(key)
        if isinstance(value, str) and value in QUOTA_CODES:
            return ErrorHint("quota", value)
    return None


DIALECT: Final = Dialect(
    name="openai",
    usage=usage,
    stream_usage=stream_usage,
    delta_text=delta_text,
    output_cap=output_cap,
    prompt_keys=("messages", "prompt", "input", "instructions", "tools"),
    exhausted_holds=exhausted_holds,
    error_hint=error_hint,
)
