"""The GenAI description of a call (pure): provider readers, attribute names held to the
semantic conventions' own registry, Anthropic's cached tokens counted into the input."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as registry
from opentelemetry.semconv._incubating.metrics import gen_ai_metrics

from gateway.metrics import Metrics
from gateway.providers import GenAICall, TokenUsage, genai_call, response_model
from gateway.telemetry import genai as g

REGISTERED = {v for k, v in vars(registry).items() if k.startswith("GEN_AI_")}


def test_every_genai_attribute_written_is_in_the_registry() -> None:
    assert set(g.GENAI_ATTRIBUTES) <= REGISTERED
    # The provider names the dialects use are the registry's well-known values.
    providers = {v.value for v in registry.GenAiProviderNameValues}
    assert {genai_call(p, e, {}).provider for p, e in CALLS_OF_EACH} <= providers  # type: ignore[union-attr]
    operations = {v.value for v in registry.GenAiOperationNameValues}
    assert {op for *_, op, _ in CASES if op} <= operations


def test_the_metric_names_are_the_conventions_translated_to_prometheus() -> None:
    names = {f.name for f in Metrics().registry.collect()}
    # OpenTelemetry -> Prometheus: dots to underscores, unit "s" -> _seconds, {token} dropped.
    for name, unit in (
        (gen_ai_metrics.GEN_AI_CLIENT_TOKEN_USAGE, ""),
        (gen_ai_metrics.GEN_AI_CLIENT_OPERATION_DURATION, "_seconds"),
        (gen_ai_metrics.GEN_AI_CLIENT_OPERATION_TIME_TO_FIRST_CHUNK, "_seconds"),
    ):
        assert name.replace(".", "_") + unit in names


CALLS_OF_EACH = [
    ("openai", "/v1/chat/completions"),
    ("anthropic", "/v1/messages"),
    ("gemini", "/v1beta/models/gemini-2.0-flash:generateContent"),
]
CASES: list[tuple[str, str, dict[str, Any], str | None, str | None]] = [
    ("openai", "/v1/chat/completions", {"model": "gpt-4o"}, "chat", "gpt-4o"),
    ("openai", "/v1/responses", {"model": "o3"}, "chat", "o3"),
    ("openai", "/v1/completions", {"model": "davinci"}, "text_completion", "davinci"),
    ("openai", "/v1/embeddings", {"model": "te-3"}, "embeddings", "te-3"),
    ("openai", "/v1/chat/completions", {"model": 5}, "chat", None),
    ("openai", "/v1/models/gpt-4o", {}, None, None),
    ("anthropic", "/v1/messages", {"model": "claude-x"}, "chat", "claude-x"),
    ("anthropic", "/v1/complete", {"model": "claude-2"}, "text_completion", "claude-2"),
    ("anthropic", "/v1/messages/count_tokens", {"model": "c"}, None, None),
    ("gemini", "/v1beta/models/gemini-2.0-flash:generateContent", {}, "generate_content",
     "gemini-2.0-flash"),
    ("gemini", "/v1beta/models/g-1:streamGenerateContent", {}, "generate_content", "g-1"),
    ("gemini", "/v1beta/models/te-4:embedContent", {}, "embeddings", "te-4"),
    ("gemini", "/v1beta/models/g-1", {}, None, None),
    ("none", "/v1/chat/completions", {"model": "gpt-4o"}, None, None),
]  # fmt: skip


@pytest.mark.parametrize(("provider", "endpoint", "params", "operation", "model"), CASES)
def test_operation_and_request_model_by_dialect(
    provider: str, endpoint: str, params: dict[str, Any], operation: str | None, model: str | None
) -> None:
    call = genai_call(provider, endpoint, params)
    assert (call.operation if call else None) == operation
    assert (call.request_model if call else None) == model


@pytest.mark.parametrize(
    ("provider", "data", "model"),
    [
        ("openai", {"model": "gpt-4o-2024-08-06", "choices": []}, "gpt-4o-2024-08-06"),
        ("openai", {"type": "response.completed", "response": {"model": "o3-1"}}, "o3-1"),
        ("openai", {"content_type": "text/event-stream", "events": [{"choices": []},
                    {"model": "m-2", "usage": {}}, "[DONE]"]}, "m-2"),
        ("anthropic", {"model": "claude-x-1", "content": []}, "claude-x-1"),
        ("anthropic", [{"type": "message_start", "message": {"model": "claude-y"}}], "claude-y"),
        ("gemini", {"modelVersion": "gemini-2.0-flash-001"}, "gemini-2.0-flash-001"),
        ("gemini", [{"candidates": []}, {"modelVersion": "g-2"}], "g-2"),
        ("openai", {"model": "x" * 300}, None),
        ("openai", None, None),
        ("none", {"model": "gpt-4o"}, None),
    ],
)  # fmt: skip
def test_response_model_by_dialect(provider: str, data: Any, model: str | None) -> None:
    assert response_model(provider, data) == model


def test_usage_attributes_count_cached_tokens_in_the_input() -> None:
    usage = TokenUsage(input=10, output=5, cached=30, total=45, reasoning=None)
    anthropic = g.GenAIOutcome(GenAICall("anthropic", "chat", "c", True), "c-1", usage)
    attrs = g.outcome_attributes(anthropic)
    assert attrs[g.INPUT_TOKENS] == 40  # Anthropic's input excludes cache reads and writes
    assert g.CACHE_READ_TOKENS not in attrs  # its count mixes reads and writes
    openai = g.GenAIOutcome(GenAICall("openai", "chat", "m", False), None, usage)
    attrs = g.outcome_attributes(openai)
    assert (attrs[g.INPUT_TOKENS], attrs[g.CACHE_READ_TOKENS]) == (10, 30)
    assert g.RESPONSE_MODEL not in attrs
    assert g.span_name(openai.call, "egress t") == "chat m"
    assert g.span_name(GenAICall("openai", "embeddings", None), "egress t") == "embeddings"
    assert g.span_name(None, "egress t") == "egress t"
