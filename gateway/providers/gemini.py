"""The Gemini dialect (generateContent / streamGenerateContent).

Sources (Gemini API reference, ``generateContent``):
* Usage: ``usageMetadata.promptTokenCount`` / ``candidatesTokenCount`` /
  ``totalTokenCount`` / ``cachedContentTokenCount``; a stream repeats ``usageMetadata``
  and the last one counts.
* Token cap: ``generationConfig.maxOutputTokens``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from gateway.providers.base import Dialect, TokenUsage, count, last_reported, positive_cap


def usage(body: Any) -> TokenUsage | None:
    if not isinstance(body, dict):
        return None
    meta = body.get("usageMetadata")
    if not isinstance(meta, dict):
        return None
    inp = count(meta.get("promptTokenCount"))
    out = count(meta.get("candidatesTokenCount"))
    cached = count(meta.get("cachedContentTokenCount"))
    total = count(meta.get("totalTokenCount"))
    if total is None:
        if inp is None and out is None:
            return None
        total = (inp or 0) + (out or 0)
    return TokenUsage(inp, out, cached, total)


def stream_usage(events: list[Any]) -> TokenUsage | None:
    return last_reported(usage, events)


def output_cap(parameters: Mapping[str, Any]) -> int:
    config = parameters.get("generationConfig")
    return positive_cap(config.get("maxOutputTokens")) if isinstance(config, Mapping) else 0


DIALECT: Final = Dialect(
    name="gemini",
    usage=usage,
    stream_usage=stream_usage,
    output_cap=output_cap,
    prompt_keys=("contents", "systemInstruction", "tools"),
)
