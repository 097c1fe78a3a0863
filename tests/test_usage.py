"""Token usage from provider answers, in the shapes their API references document."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.call.bodies import parse_body
from gateway.providers import TokenUsage, extract_usage

OPENAI_CHAT = {
    "id": "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT",
    "object": "chat.completion",
    "created": 1741569952,
    "model": "gpt-4o-2024-08-06",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello!", "refusal": None},
            "finish_reason": "stop",
        }
    ],
    "usage": {
        "prompt_tokens": 19,
        "completion_tokens": 10,
        "total_tokens": 29,
        "prompt_tokens_details": {"cached_tokens": 6, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0},
    },
}

OPENAI_RESPONSES = {
    "id": "resp_67ccd2bed1ec8190b14f964abc0542670bb6a6b452d3795b",
    "object": "response",
    "status": "completed",
    "output": [{"type": "message", "content": [{"type": "output_text", "text": "Hi"}]}],
    "usage": {
        "input_tokens": 36,
        "input_tokens_details": {"cached_tokens": 12},
        "output_tokens": 87,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 123,
    },
}

ANTHROPIC_MESSAGE = {
    "id": "msg_013Zva2CMHLNnXjNJJKqJ2EF",
    "type": "message",
    "role": "assistant",
    "content": [{"type": "text", "text": "Hi!"}],
    "model": "claude-sonnet-4-20250514",
    "stop_reason": "end_turn",
    "usage": {
        "input_tokens": 2095,
        "output_tokens": 503,
        "cache_creation_input_tokens": 2051,
        "cache_read_input_tokens": 100,
    },
}

GEMINI = {
    "candidates": [{"content": {"parts": [{"text": "Hi"}], "role": "model"}}],
    "usageMetadata": {
        "promptTokenCount": 4,
        "candidatesTokenCount": 120,
        "totalTokenCount": 130,  # includes thoughtsTokenCount
        "thoughtsTokenCount": 6,
        "cachedContentTokenCount": 2,
    },
    "modelVersion": "gemini-2.0-flash",
}


@pytest.mark.parametrize(
    ("provider", "body", "expected"),
    [
        ("openai", OPENAI_CHAT, TokenUsage(input=19, output=10, cached=6, total=29, reasoning=0)),
        (
            "openai",
            OPENAI_RESPONSES,
            TokenUsage(input=36, output=87, cached=12, total=123, reasoning=0),
        ),
        # Anthropic's input_tokens excludes cache writes and reads: the total adds them.
        (
            "anthropic",
            ANTHROPIC_MESSAGE,
            TokenUsage(
                input=2095, output=503, cached=2151, total=2095 + 503 + 2151, cache_write=2051
            ),
        ),
        ("gemini", GEMINI, TokenUsage(input=4, output=120, cached=2, total=130, reasoning=6)),
    ],
    ids=["openai-chat", "openai-responses", "anthropic", "gemini"],
)
def test_documented_shapes(provider: str, body: dict[str, Any], expected: TokenUsage) -> None:
    assert extract_usage(provider, body) == expected


@pytest.mark.parametrize(
    ("provider", "body", "expected"),
    [
        # a total only from its parts when the provider gives none
        (
            "openai",
            {"usage": {"prompt_tokens": 3, "completion_tokens": 4}},
            TokenUsage(3, 4, None, 7),
        ),
        ("openai", {"usage": {"prompt_tokens": 3}}, TokenUsage(3, None, None, 3)),
        ("openai", {"usage": {"total_tokens": 9}}, TokenUsage(None, None, None, 9)),
        ("openai", {"usage": {"input_tokens": 2, "output_tokens": 5}}, TokenUsage(2, 5, None, 7)),
        ("gemini", {"usageMetadata": {"promptTokenCount": 4}}, TokenUsage(4, None, None, 4)),
        ("anthropic", {"usage": {"input_tokens": 7}}, TokenUsage(7, None, None, 7)),
        ("anthropic", {"usage": {"output_tokens": 7}}, TokenUsage(None, 7, None, 7)),
        # zero is a count, not an absence
        (
            "openai",
            {"usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}},
            TokenUsage(0, 0, None, 0),
        ),
        (
            "anthropic",
            {"usage": {"input_tokens": 0, "output_tokens": 0}},
            TokenUsage(0, 0, None, 0),
        ),
        ("gemini", {"usageMetadata": {"totalTokenCount": 0}}, TokenUsage(None, None, None, 0)),
        # an embeddings answer has prompt and total tokens only
        (
            "openai",
            {"object": "list", "usage": {"prompt_tokens": 8, "total_tokens": 8}},
            TokenUsage(8, None, None, 8),
        ),
    ],
)
def test_partial_usage(provider: str, body: dict[str, Any], expected: TokenUsage) -> None:
    assert extract_usage(provider, body) == expected


@pytest.mark.parametrize(
    ("provider", "data"),
    [
        ("openai", {"id": "chatcmpl-1", "choices": []}),
        ("openai", {"usage": None}),
        ("openai", {"usage": {}}),
        ("openai", {"usage": "29"}),
        ("anthropic", {"type": "message", "content": []}),
        ("anthropic", {"usage": None}),
        ("anthropic", {"usage": {}}),
        ("gemini", {"candidates": []}),
        ("gemini", {"usageMetadata": {}}),
        ("gemini", {"usage": {"total_tokens": 5}}),  # another provider's shape
        ("openai", {"usageMetadata": {"totalTokenCount": 5}}),
        ("openai", None),
        ("openai", [OPENAI_CHAT]),
        ("openai", "usage: 5"),
        ("openai", {"content_type": "text/html", "text": "<html>502</html>"}),
        ("none", OPENAI_CHAT),
        ("none", ANTHROPIC_MESSAGE),
        ("mistral", OPENAI_CHAT),
    ],
)
def test_absent_usage_is_none_not_zero(provider: str, data: Any) -> None:
    assert extract_usage(provider, data) is None


@pytest.mark.parametrize(
    ("provider", "body", "expected"),
    [
        ("openai", {"usage": {"prompt_tokens": True, "completion_tokens": False}}, None),
        ("openai", {"usage": {"total_tokens": True}}, None),
        ("openai", {"usage": {"prompt_tokens": -5, "completion_tokens": -1}}, None),
        ("openai", {"usage": {"prompt_tokens": "19", "completion_tokens": 1.5}}, None),
        (
            "openai",
            {"usage": {"prompt_tokens": True, "completion_tokens": 5}},
            TokenUsage(None, 5, None, 5),
        ),
        (
            "openai",
            {"usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": -1}},
            TokenUsage(3, 4, None, 7),
        ),
        (
            "openai",
            {"usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": True}}},
            TokenUsage(3, None, None, 3),
        ),
        (
            "anthropic",
            {
                "usage": {
                    "input_tokens": True,
                    "output_tokens": -3,
                    "cache_read_input_tokens": False,
                }
            },
            None,
        ),
        (
            "anthropic",
            {"usage": {"input_tokens": 5, "cache_creation_input_tokens": -100}},
            TokenUsage(5, None, None, 5),
        ),
        ("gemini", {"usageMetadata": {"promptTokenCount": -1, "totalTokenCount": True}}, None),
    ],
)
def test_bool_negative_and_non_integer_counts_are_ignored(
    provider: str, body: dict[str, Any], expected: TokenUsage | None
) -> None:
    assert extract_usage(provider, body) == expected


def sse(*events: Any, done: bool = False) -> bytes:
    chunks = [f"data: {json.dumps(e)}\n\n" for e in events]
    if done:
        chunks.append("data: [DONE]\n\n")
    return "".join(chunks).encode()


def openai_chunk(content: str | None, usage: Any = None) -> dict[str, Any]:
    choices = [] if content is None else [{"index": 0, "delta": {"content": content}}]
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "choices": choices,
        "usage": usage,
    }


def test_openai_stream_usage_comes_from_the_final_chunk() -> None:
    body = sse(
        openai_chunk("Hel"),
        openai_chunk("lo"),
        openai_chunk(None, {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}),
        done=True,
    )
    data, _ = parse_body("text/event-stream", body, 200)
    assert data["content"] == "Hello"
    assert extract_usage("openai", data) == TokenUsage(9, 2, None, 11)


def test_openai_stream_without_include_usage_reports_none() -> None:
    data, _ = parse_body("text/event-stream", sse(openai_chunk("Hi"), done=True), 200)
    assert extract_usage("openai", data) is None


def anthropic_stream(cache_read: int | None = None) -> bytes:
    start_usage: dict[str, Any] = {"input_tokens": 25, "output_tokens": 1}
    if cache_read is not None:
        start_usage |= {"cache_creation_input_tokens": 0, "cache_read_input_tokens": cache_read}
    events = [
        ("message_start", {"type": "message_start",
                           "message": {"id": "msg_1", "usage": start_usage}}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
        ("ping", {"type": "ping"}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": "Hello"}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": "!"}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                           "usage": {"output_tokens": 15}}),
        ("message_stop", {"type": "message_stop"}),
    ]  # fmt: skip
    return "".join(f"event: {name}\ndata: {json.dumps(e)}\n\n" for name, e in events).encode()


def test_anthropic_stream_joins_message_start_and_message_delta() -> None:
    data, _ = parse_body("text/event-stream", anthropic_stream(), 200)
    assert data["content"] == "Hello!"
    # input from message_start, the cumulative output count from message_delta
    assert extract_usage("anthropic", data) == TokenUsage(25, 15, None, 40)


def test_anthropic_stream_counts_cache_tokens() -> None:
    data, _ = parse_body("text/event-stream", anthropic_stream(cache_read=100), 200)
    assert extract_usage("anthropic", data) == TokenUsage(25, 15, 100, 140, cache_write=0)


def test_stream_without_any_usage_is_none() -> None:
    data, _ = parse_body("text/event-stream", b"data: hello\n\ndata: [DONE]\n\n", 200)
    for provider in ("openai", "anthropic", "gemini"):
        assert extract_usage(provider, data) is None


def test_gemini_stream_takes_the_last_usage_metadata() -> None:
    body = sse(
        {"candidates": [], "usageMetadata": {"promptTokenCount": 4, "totalTokenCount": 4}},
        {"candidates": [], "usageMetadata": {"promptTokenCount": 4, "candidatesTokenCount": 8,
                                             "totalTokenCount": 12}},
    )  # fmt: skip
    data, _ = parse_body("text/event-stream", body, 200)
    assert extract_usage("gemini", data) == TokenUsage(4, 8, None, 12)
