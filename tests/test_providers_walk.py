"""The per-call readers of the providers' knowledge give the figures of their definitions.

The output cap, the rate-limit holds of an answer's headers and the GenAI description of
a call are read on every call; their fast forms (one loop over prebuilt readers and
header names, a memo of each call's description) are held here to the plain
definitions they replaced, written out below as the reference, for every provider's
request and answer shapes and the edge values (pure, table-driven).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from gateway import providers
from gateway.providers import (
    DIALECTS,
    GenAICall,
    estimate_tokens,
    exhausted_holds,
    genai_call,
    output_cap,
    prompt_bytes,
)
from gateway.providers.base import positive_cap
from gateway.ratelimit import provider_hold_s, retry_after_s

NOW = 1_767_225_600.0  # 2026-01-01T00:00:00Z


def reference_cap(parameters: Mapping[str, Any]) -> int:
    """The definition (docs/features/rate-limits.md): the largest cap of any dialect."""
    config = parameters.get("generationConfig")
    gemini = positive_cap(config.get("maxOutputTokens")) if isinstance(config, Mapping) else 0
    keys = ("max_tokens", "max_completion_tokens", "max_output_tokens")
    return max([gemini, *(positive_cap(parameters.get(k)) for k in keys)])


REQUESTS: list[dict[str, Any]] = [
    {},
    {"channel": "C0FAKE", "text": "deploy done"},
    # OpenAI Chat Completions, the Responses API
    {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64},
    {"model": "o3", "messages": [], "max_completion_tokens": 500, "max_tokens": 20},
    {"model": "gpt-4.1", "input": "hello", "max_output_tokens": 7, "instructions": "be brief"},
    # Anthropic Messages
    {"model": "claude-sonnet-4", "max_tokens": 1024, "system": "terse", "messages": []},
    # Gemini generateContent
    {"contents": [{"parts": [{"text": "hi"}]}], "generationConfig": {"maxOutputTokens": 256}},
    {"contents": [], "generationConfig": {"temperature": 0}},
    {"generationConfig": "not an object", "max_tokens": 3},
    # Keys of several dialects in one body: the largest wins, whatever the target.
    {"max_tokens": 10, "generationConfig": {"maxOutputTokens": 99}},
    {"max_output_tokens": 40, "generationConfig": {"maxOutputTokens": 30}, "max_tokens": 50},
    # Values that are not caps.
    {"max_tokens": True, "max_completion_tokens": False},
    {"max_tokens": -5, "max_output_tokens": 0},
    {"max_tokens": 12.0, "generationConfig": {"maxOutputTokens": "64"}},
    {"max_tokens": None, "max_completion_tokens": 2**70},
]


@pytest.mark.parametrize("parameters", REQUESTS)
def test_output_cap_is_the_largest_of_every_dialect(parameters: dict[str, Any]) -> None:
    assert output_cap(parameters) == reference_cap(parameters)
    assert output_cap(parameters) == max(d.output_cap(parameters) for d in DIALECTS.values())
    expected = reference_cap(parameters) + math.ceil(prompt_bytes(parameters) / 4)
    assert estimate_tokens(parameters) == expected


def reference_holds(headers: Mapping[str, str], now: float) -> list[float]:
    """Every dialect's holds, read with the names spelt out (the definition)."""
    holds: list[float] = []
    for kind in ("requests", "tokens"):
        if providers.base.number(headers.get(f"x-ratelimit-remaining-{kind}")) == 0:
            wait = providers.openai.duration_s(headers.get(f"x-ratelimit-reset-{kind}"))
            if wait is not None:
                holds.append(wait)
    for kind in ("requests", "tokens", "input-tokens", "output-tokens"):
        name = f"anthropic-ratelimit-{kind}"
        if providers.base.number(headers.get(f"{name}-remaining")) == 0:
            wait = providers.anthropic._rfc3339_until(headers.get(f"{name}-reset"), now)
            if wait is not None:
                holds.append(wait)
    return holds


def reference_hold(headers: Mapping[str, str], status: int, now: float) -> float | None:
    lower = {k.lower(): v for k, v in headers.items()}
    holds = []
    if status == 429 and (wait := retry_after_s(lower, now)) is not None:
        holds.append(wait)
    positive = [h for h in [*holds, *reference_holds(lower, now)] if h > 0]
    return max(positive) if positive else None


HEADERS: list[dict[str, str]] = [
    {},
    {"content-type": "application/json"},
    # The benchmark's answer: a limit far from spent.
    {"x-ratelimit-remaining-requests": "999999", "x-ratelimit-reset-requests": "1ms"},
    {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "6m0s"},
    {
        "X-RateLimit-Remaining-Requests": "0",
        "X-RateLimit-Reset-Requests": "1s",
        "x-ratelimit-remaining-tokens": "0.0",
        "x-ratelimit-reset-tokens": "1h2m3.5s",
    },
    {"x-ratelimit-remaining-tokens": "-1", "x-ratelimit-reset-tokens": "20ms"},  # Azure
    {"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "soon"},
    {"x-ratelimit-remaining-tokens": " 0 ", "x-ratelimit-reset-tokens": "2.5"},
    {"x-ratelimit-remaining-requests": "", "x-ratelimit-reset-requests": "1s"},
    {
        "anthropic-ratelimit-requests-remaining": "0",
        "anthropic-ratelimit-requests-reset": "2026-01-01T00:00:30Z",
        "anthropic-ratelimit-output-tokens-remaining": "0",
        "anthropic-ratelimit-output-tokens-reset": "2026-01-01T00:01:00Z",
        "anthropic-ratelimit-tokens-remaining": "5000",
        "anthropic-ratelimit-tokens-reset": "2026-01-01T00:02:00Z",
    },
    {
        "anthropic-ratelimit-input-tokens-remaining": "0",
        "anthropic-ratelimit-input-tokens-reset": "2025-12-31T23:59:00Z",  # in the past
    },
    {"retry-after": "7", "x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "3s"},
    {"retry-after-ms": "2500", "retry-after": "60"},
    {"retry-after": "0"},
]


@pytest.mark.parametrize("headers", HEADERS)
@pytest.mark.parametrize("status", [200, 429, 503])
def test_holds_are_read_as_defined(headers: dict[str, str], status: int) -> None:
    lower = {k.lower(): v for k, v in headers.items()}
    assert exhausted_holds(lower, NOW) == reference_holds(lower, NOW)
    expected = reference_hold(headers, status, NOW)
    assert provider_hold_s(headers, status, NOW) == expected
    # aiohttp's response headers are read as they are, case-insensitively.
    proxy = CIMultiDictProxy(CIMultiDict(headers))
    assert provider_hold_s(proxy, status, NOW) == expected


CALLS: list[tuple[str, str, dict[str, Any], GenAICall | None]] = [
    ("openai", "/v1/chat/completions", {"model": "mini"}, GenAICall("openai", "chat", "mini")),
    ("openai", "/v1/chat/completions/", {}, GenAICall("openai", "chat", None)),
    ("openai", "/v1/responses", {"model": "o3"}, GenAICall("openai", "chat", "o3")),
    ("openai", "/v1/completions", {"model": 5}, GenAICall("openai", "text_completion", None)),
    ("openai", "/v1/embeddings", {"model": "e"}, GenAICall("openai", "embeddings", "e")),
    ("openai", "/v1/models/gpt-4o", {"model": "gpt-4o"}, None),
    (
        "anthropic",
        "/v1/messages",
        {"model": "claude-sonnet-4"},
        GenAICall("anthropic", "chat", "claude-sonnet-4", cached_outside_input=True),
    ),
    (
        "gemini",
        "/v1beta/models/gemini-2.0-flash:generateContent",
        {"model": "ignored"},
        GenAICall("gcp.gemini", "generate_content", "gemini-2.0-flash"),
    ),
    ("gemini", "/v1beta/models/gemini-2.0-flash:countTokens", {}, None),
    ("none", "/v1/chat/completions", {"model": "gpt-4o-mini"}, None),
]  # fmt: skip


@pytest.mark.parametrize(("provider", "endpoint", "parameters", "expected"), CALLS)
def test_a_calls_description_is_the_same_when_it_is_remembered(
    provider: str, endpoint: str, parameters: dict[str, Any], expected: GenAICall | None
) -> None:
    providers._KNOWN_CALLS.clear()
    first = genai_call(provider, endpoint, parameters)
    again = genai_call(provider, endpoint, parameters)
    assert first == again == expected
    # Another model on the same endpoint is another description, never the first one's.
    other = genai_call(provider, endpoint, {**parameters, "model": "another-model"})
    if expected is not None and provider != "gemini":  # Gemini names its model in the path
        assert other is not None
        assert other.request_model == "another-model"


def test_remembered_descriptions_are_bounded() -> None:
    providers._KNOWN_CALLS.clear()
    for i in range(providers._MAX_KNOWN_CALLS + 10):
        assert genai_call("openai", "/v1/chat/completions", {"model": f"m-{i}"}) == GenAICall(
            "openai", "chat", f"m-{i}"
        )
    assert len(providers._KNOWN_CALLS) <= providers._MAX_KNOWN_CALLS
    long_path = "/v1/files/" + "x" * 300 + "/chat/completions"
    assert genai_call("openai", long_path, {"model": "m"}) == GenAICall("openai", "chat", "m")
    assert all(endpoint != long_path for _, endpoint, _ in providers._KNOWN_CALLS)
