"""An upstream's stream event may hold any JSON where a string is expected: the judge
reads it as what it is not (no marker, no failure, no crash), and usage beside it still
counts (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.call.sse import SseEvent
from gateway.call.stream import StreamJudge
from gateway.providers import TokenUsage

ODD: list[Any] = [[], {}, ["response.completed"], {"a": 1}, 3, True, None]


@pytest.mark.parametrize("provider", ["openai", "anthropic", "gemini"])
@pytest.mark.parametrize("kind", ODD, ids=repr)
def test_an_event_type_that_is_not_a_string_is_no_signal(provider: str, kind: Any) -> None:
    judge = StreamJudge(provider, "t")
    judge.observe_data(None, {"type": kind, "choices": [{"index": 0, "delta": {}}]})
    assert (judge.complete, judge.failure, judge.malformed) == (False, None, 0)


@pytest.mark.parametrize("kind", ODD, ids=repr)
def test_openai_usage_beside_an_odd_type_still_counts(kind: Any) -> None:
    judge = StreamJudge("openai", "t")
    judge.observe(
        SseEvent(None, '{"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":1}}')
    )
    judge.observe_data(None, {"type": kind, "usage": {"prompt_tokens": 4, "completion_tokens": 3}})
    assert judge.usage() == TokenUsage(4, 3, None, 7)
