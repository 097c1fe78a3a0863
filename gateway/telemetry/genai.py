"""What a call is in the OpenTelemetry GenAI semantic conventions (pure, no SDK).

Shared by the spans (:mod:`gateway.telemetry.otel`) and the ``gen_ai_*`` metrics
(:func:`gateway.call.metrics.observe`), so both describe a call the same way.

Conventions followed: the GenAI attribute registry and metrics of OpenTelemetry semantic
conventions 1.44.0 (status "Development"; the registry has since moved to the
open-telemetry/semantic-conventions-genai repository), as shipped in the Python package
``opentelemetry-semantic-conventions`` 0.66b2, against which the names are checked
(tests/test_telemetry_genai.py): ``gen_ai.provider.name`` (not the older
``gen_ai.system``), ``gen_ai.usage.cache_read.input_tokens``,
``gen_ai.usage.reasoning.output_tokens``, ``gen_ai.response.time_to_first_chunk``. The
HTTP span attributes are the stable HTTP conventions.
``gen_ai.usage.input_tokens`` counts cached tokens, as the conventions say (Anthropic's
``input_tokens`` does not: its cache reads and writes are added).

Never here: prompt or completion content, tool arguments, secrets, secret references.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from gateway.providers import GenAICall, TokenUsage, genai_call, response_model
from gateway.urls import URL

if TYPE_CHECKING:
    from gateway.envelope import ExternalCallRequest, ExternalCallResponse
    from gateway.policy import CompiledTarget
    from gateway.record import CallRecord

Attributes = dict[str, str | int | float | bool]

OPERATION: Final = "gen_ai.operation.name"
PROVIDER: Final = "gen_ai.provider.name"
REQUEST_MODEL: Final = "gen_ai.request.model"
RESPONSE_MODEL: Final = "gen_ai.response.model"
INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"
CACHE_READ_TOKENS: Final = "gen_ai.usage.cache_read.input_tokens"
REASONING_TOKENS: Final = "gen_ai.usage.reasoning.output_tokens"
TIME_TO_FIRST_CHUNK: Final = "gen_ai.response.time_to_first_chunk"
ERROR_TYPE: Final = "error.type"
#: Every GenAI name this package writes (the test holds them to the registry).
GENAI_ATTRIBUTES: Final = (
    OPERATION,
    PROVIDER,
    REQUEST_MODEL,
    RESPONSE_MODEL,
    INPUT_TOKENS,
    OUTPUT_TOKENS,
    CACHE_READ_TOKENS,
    REASONING_TOKENS,
    TIME_TO_FIRST_CHUNK,
)


@dataclass(frozen=True, slots=True)
class GenAIOutcome:
    """A model call and what its answer said: the call, the response model (None when
    the answer names none) and the usage (None when unknown)."""

    call: GenAICall
    response_model: str | None
    usage: TokenUsage | None


def request_of(
    request: ExternalCallRequest | None, target: CompiledTarget | None
) -> GenAICall | None:
    """The GenAI description of ``request`` on ``target``, None for a call that is not a
    model call (a target without ``usage``, another endpoint, or a call refused before
    the policy knew its target)."""
    if request is None or target is None:
        return None
    return genai_call(target.spec.usage, request.endpoint, request.parameters)


def outcome_of(record: CallRecord, response: ExternalCallResponse) -> GenAIOutcome | None:
    """:func:`request_of` of the call ``record`` describes, with the answer's model (a
    relayed stream's, else ``response``'s) and usage."""
    target = record.target
    call = request_of(record.request, target)
    if call is None:
        return None
    assert target is not None
    stream = record.stream
    model = (
        stream.response_model
        if stream is not None
        else response_model(target.spec.usage, response.data)
    )
    return GenAIOutcome(call, model, record.usage)


def token_counts(call: GenAICall, usage: TokenUsage) -> tuple[int | None, int | None]:
    """``(input, output)`` tokens as the conventions count them (input with cache)."""
    inp = usage.input
    if call.cached_outside_input and usage.cached:
        inp = (inp or 0) + usage.cached
    return inp, usage.output


def request_attributes(call: GenAICall | None) -> Attributes:
    """``gen_ai.operation.name``, ``gen_ai.provider.name``, ``gen_ai.request.model``."""
    if call is None:
        return {}
    attrs: Attributes = {OPERATION: call.operation, PROVIDER: call.provider}
    if call.request_model is not None:
        attrs[REQUEST_MODEL] = call.request_model
    return attrs


def outcome_attributes(outcome: GenAIOutcome | None) -> Attributes:
    """The request's attributes, the response model and the usage counts."""
    if outcome is None:
        return {}
    attrs = request_attributes(outcome.call)
    if outcome.response_model is not None:
        attrs[RESPONSE_MODEL] = outcome.response_model
    usage = outcome.usage
    if usage is not None:
        inp, out = token_counts(outcome.call, usage)
        if inp is not None:
            attrs[INPUT_TOKENS] = inp
        if out is not None:
            attrs[OUTPUT_TOKENS] = out
        if usage.cached is not None and not outcome.call.cached_outside_input:
            attrs[CACHE_READ_TOKENS] = usage.cached  # Anthropic's mixes reads and writes
        if usage.reasoning is not None:
            attrs[REASONING_TOKENS] = usage.reasoning
    return attrs


def span_name(call: GenAICall | None, fallback: str) -> str:
    """``{gen_ai.operation.name} {gen_ai.request.model}`` (the GenAI span name), else
    ``fallback``."""
    if call is None:
        return fallback
    return f"{call.operation} {call.request_model}" if call.request_model else call.operation


def http_client_attributes(method: str, url: URL, attempt: int) -> Attributes:
    """Stable HTTP client span attributes of one attempt (no query string: it may hold
    a search or a credential). ``attempt`` counts from 1; the resend count is attempt - 1."""
    attrs: Attributes = {
        "http.request.method": method,
        "server.address": url.host or "",
        "server.port": url.port or (443 if url.scheme == "https" else 80),
        "url.full": str(url.with_query(None).with_fragment(None).with_user(None)),
    }
    if attempt > 1:
        attrs["http.request.resend_count"] = attempt - 1
    return attrs
