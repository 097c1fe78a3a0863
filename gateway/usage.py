"""Token usage from LLM answers (pure), chosen by the target's ``usage`` key.

Sources:
* OpenAI: ``usage.prompt_tokens`` / ``completion_tokens`` / ``total_tokens``, cached in
  ``usage.prompt_tokens_details.cached_tokens`` (Chat Completions API reference); the
  Responses API's ``input_tokens`` / ``output_tokens`` too. Streams carry ``usage`` in the
  last chunk when ``stream_options.include_usage`` is set.
* Anthropic: ``usage.input_tokens`` + ``output_tokens``, plus
  ``cache_creation_input_tokens`` and ``cache_read_input_tokens`` (Messages API
  reference); streams carry input usage in ``message_start`` and output usage in
  ``message_delta``.
* Gemini: ``usageMetadata.promptTokenCount`` / ``candidatesTokenCount`` /
  ``totalTokenCount`` / ``cachedContentTokenCount`` (generateContent reference).

An answer that reports no usage gives ``None`` (not 0): absent is not zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class TokenUsage:
    """Token counts of one call. ``total`` is what ``tokens_used`` reports."""

    input: int | None
    output: int | None
    cached: int | None
    total: int


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def extract_usage(provider: str, data: Any) -> TokenUsage | None:
    """Usage reported in ``data`` (a parsed body, or the SSE shape of gateway.bodies)."""
    if provider == "none" or data is None:
        return None
    if isinstance(data, dict) and data.get("content_type") == "text/event-stream":
        return _from_stream(provider, data.get("events") or [])
    if not isinstance(data, dict):
        return None
    if provider == "openai":
        return _openai(data.get("usage"))
    if provider == "anthropic":
        return _anthropic([data.get("usage")])
    if provider == "gemini":
        return _gemini(data.get("usageMetadata"))
    return None


def _openai(usage: Any) -> TokenUsage | None:
    if not isinstance(usage, dict):
        return None
    inp = _int(usage.get("prompt_tokens", usage.get("input_tokens")))
    out = _int(usage.get("completion_tokens", usage.get("output_tokens")))
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
    total = _int(usage.get("total_tokens"))
    if total is None:
        if inp is None and out is None:
            return None
        total = (inp or 0) + (out or 0)
    return TokenUsage(inp, out, cached, total)


def _anthropic(usages: list[Any]) -> TokenUsage | None:
    inp = out = cached = None
    seen = False
    for usage in usages:
        if not isinstance(usage, dict):
            continue
        seen = True
        if (v := _int(usage.get("input_tokens"))) is not None:
            inp = max(inp or 0, v)
        if (v := _int(usage.get("output_tokens"))) is not None:
            out = max(out or 0, v)  # message_delta reports the cumulative output count
        cache = sum(
            v
            for k in ("cache_creation_input_tokens", "cache_read_input_tokens")
            if (v := _int(usage.get(k))) is not None
        )
        if cache:
            cached = max(cached or 0, cache)
    if not seen or (inp is None and out is None and cached is None):
        return None
    return TokenUsage(inp, out, cached, (inp or 0) + (out or 0) + (cached or 0))


def _gemini(meta: Any) -> TokenUsage | None:
    if not isinstance(meta, dict):
        return None
    inp = _int(meta.get("promptTokenCount"))
    out = _int(meta.get("candidatesTokenCount"))
    cached = _int(meta.get("cachedContentTokenCount"))
    total = _int(meta.get("totalTokenCount"))
    if total is None:
        if inp is None and out is None:
            return None
        total = (inp or 0) + (out or 0)
    return TokenUsage(inp, out, cached, total)


def _from_stream(provider: str, events: list[Any]) -> TokenUsage | None:
    dicts = [e for e in events if isinstance(e, dict)]
    if provider == "anthropic":
        usages = [e.get("usage") for e in dicts]
        usages += [e["message"].get("usage") for e in dicts if isinstance(e.get("message"), dict)]
        return _anthropic(usages)
    for event in reversed(dicts):
        found = extract_usage(provider, event)
        if found is not None:
            return found
    return None
