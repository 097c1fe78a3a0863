"""The OpenAI dialect (Chat Completions and the Responses API).

Sources:
* Usage: ``usage.prompt_tokens`` / ``completion_tokens`` / ``total_tokens``, cached in
  ``usage.prompt_tokens_details.cached_tokens`` (Chat Completions API reference); the
  Responses API's ``input_tokens`` / ``output_tokens`` / ``input_tokens_details``. Streams
  carry ``usage`` in the last chunk when ``stream_options.include_usage`` is set.
* Stream text: ``choices[0].delta.content`` of each chunk.
* Stream end and errors (Chat Completions and Responses streaming references):
  ``data: [DONE]``, a ``finish_reason``, ``response.completed`` / ``response.incomplete``
  end a stream; ``{"error": ...}``, ``response.failed`` and ``error`` events fail it.
* Token caps: ``max_tokens``, ``max_completion_tokens`` (Chat), ``max_output_tokens``
  (Responses).
* Rate-limit headers, https://platform.openai.com/docs/guides/rate-limits ("Rate limits in
  headers"): ``x-ratelimit-remaining-requests`` / ``-tokens`` (a count) and
  ``x-ratelimit-reset-requests`` / ``-tokens`` (a duration such as ``1s``, ``6m0s``,
  ``20ms``, ``1h2m3.5s``; Azure OpenAI sends plain seconds). Azure sends ``-1`` for
  "unknown", which is not exhaustion.
* Error bodies (API reference, "Error codes"; openai-python ``_exceptions.py``):
  ``{"error": {"message", "type", "param", "code"}}``; the SDK raises its exception class
  by HTTP status (``_client.py``, ``_make_status_error``: 400 ``BadRequestError``, 401
  ``AuthenticationError``, 403 ``PermissionDeniedError``, 404, 409, 422, 429
  ``RateLimitError``, >= 500 ``InternalServerError``, any other ``APIStatusError``) with
  ``error.message`` in its text. Inside a stream, a ``data:`` event whose JSON has an
  ``error`` object makes it raise ``APIError`` (``_streaming.py``), for Chat Completions
  and the Responses API alike. Its SDK sends the key as ``Authorization: Bearer``
  (Azure OpenAI: ``api-key``) and beta flags as ``OpenAI-Beta``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from gateway import fastjson
from gateway.providers.base import (
    END,
    Dialect,
    ErrorHint,
    StreamFailure,
    StreamSignal,
    TokenUsage,
    body_model,
    count,
    error_object,
    failure,
    last_reported,
    model_name,
    number,
    positive_cap,
    sse_event,
)

_KINDS: Final = ("requests", "tokens")
_MAX_TOKENS, _MAX_COMPLETION, _MAX_OUTPUT = (
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
)
#: ``(remaining, reset)`` header names of each limit (read on every answer: built once).
_LIMIT_HEADERS: Final = tuple(
    (f"x-ratelimit-remaining-{kind}", f"x-ratelimit-reset-{kind}") for kind in _KINDS
)
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


_RESPONSES_DONE: Final = frozenset({"response.completed", "response.incomplete"})
_RATE_LIMITED: Final = frozenset({"rate_limit_exceeded", "rate_limit_error", "tokens", "requests"})
_OVERLOADED: Final = frozenset(
    {"server_error", "overloaded", "overloaded_error", "service_unavailable", "api_error"}
)
_REJECTED: Final = frozenset(
    {"invalid_request_error", "invalid_prompt", "context_length_exceeded", "content_filter"}
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
    out_details = found.get("completion_tokens_details") or found.get("output_tokens_details") or {}
    reasoning = (
        count(out_details.get("reasoning_tokens")) if isinstance(out_details, dict) else None
    )
    total = count(found.get("total_tokens"))
    if total is None:
        if inp is None and out is None:
            return None
        total = (inp or 0) + (out or 0)
    return TokenUsage(inp, out, cached, total, reasoning)


def _event_usage(event: Any) -> TokenUsage | None:
    """A chat chunk's ``usage``, or the Responses API's final ``response.usage``."""
    kind = event.get("type") if isinstance(event, dict) else None
    if kind.__class__ is str and kind in _RESPONSES_DONE:  # not always hashable
        return usage(event.get("response"))
    return usage(event)


def stream_usage(events: list[Any]) -> TokenUsage | None:
    """The last chat chunk with ``usage`` (``stream_options.include_usage``), or the
    Responses API's ``response.completed`` / ``response.incomplete`` ``response.usage``."""
    return last_reported(_event_usage, events)


def usage_event(data: Any) -> bool:
    if not isinstance(data, dict):
        return False
    kind = data.get("type")  # an upstream's value: not always hashable
    return isinstance(data.get("usage"), dict) or (
        kind.__class__ is str and kind in _RESPONSES_DONE
    )


def stream_signal(event: str | None, data: Any) -> StreamSignal | None:
    """Terminal markers: ``data: [DONE]`` and a chat chunk with a ``finish_reason``
    (Chat Completions streaming reference); ``response.completed`` and
    ``response.incomplete`` (Responses API streaming events). Failures: a chunk
    ``{"error": {...}}``, ``response.failed`` and the ``error`` event."""
    del event  # the Responses API repeats its event type in data.type
    if not isinstance(data, dict):
        return END if data == "[DONE]" else None
    kind = data.get("type")
    if kind is not None:  # a Responses API event (chat chunks have no type)
        if kind.__class__ is str and kind in _RESPONSES_DONE:  # not always hashable
            return END
        if kind == "response.failed":
            response = data.get("response")
            error = response.get("error") if isinstance(response, dict) else None
            error = error if isinstance(error, dict) else {}
            return _failure(error.get("code"), error.get("message"))
        if kind == "error":
            return _failure(data.get("code") or data.get("type"), data.get("message"))
    error = data.get("error")
    if isinstance(error, dict):
        return _failure(error.get("code") or error.get("type"), error.get("message"))
    choices = data.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict) and choice.get("finish_reason"):
                return END
    return None


def _failure(code: Any, message: Any) -> StreamFailure:
    code = code if isinstance(code, str) else ""
    if code in QUOTA_CODES:
        return failure("quota", code, message)
    if code in _RATE_LIMITED:
        return failure("rate_limited", code, message)
    if code in _OVERLOADED:
        return failure("overloaded", code, message)
    if code in _REJECTED:
        return failure("rejected", code, message)
    return failure("failed", code, message)


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
    get = parameters.get
    return max(positive_cap(get(_MAX_TOKENS)), positive_cap(get(_MAX_COMPLETION)),
               positive_cap(get(_MAX_OUTPUT)))  # fmt: skip


def choices(parameters: Mapping[str, Any]) -> int:
    """``n``: how many chat completions (each up to the output cap) a request asks for."""
    return max(positive_cap(parameters.get("n")), 1)


def exhausted_holds(headers: Mapping[str, str], now: float) -> list[float]:
    """Seconds until each OpenAI limit whose ``remaining`` is 0 resets."""
    holds = []
    for remaining, reset in _LIMIT_HEADERS:
        value = headers.get(remaining)
        if value is not None and number(value) == 0:
            wait = duration_s(headers.get(reset))
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


#: OpenAI's ``error.type`` for an HTTP status (others: ``invalid_request_error`` below
#: 500, ``server_error`` from 500).
_ERROR_TYPES: Final = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


def error_body(status: int, code: str, message: str) -> dict[str, Any]:
    """``{"error": {message, type, param, code}}``; ``code`` is the egress error code."""
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def stream_error(status: int, code: str, message: str) -> bytes:
    """``data: {"error": {...}}``, as OpenAI ends a failed stream."""
    return sse_event(None, error_body(status, code, message))


#: Endpoint endings and the GenAI operation each is (OpenAI API reference).
_OPERATIONS: Final = (
    ("/chat/completions", "chat"),
    ("/responses", "chat"),
    ("/completions", "text_completion"),
    ("/embeddings", "embeddings"),
)


def operation(endpoint: str) -> str | None:
    """The ``gen_ai.operation.name`` of a call to ``endpoint``, None if not a model call."""
    path = endpoint.rstrip("/")
    return next((op for end, op in _OPERATIONS if path.endswith(end)), None)


#: Endpoint endings whose duplicate costs tokens and nothing else. Not the Responses API
#: (``/responses``): it stores each response by default and may call remote MCP servers
#: and other tools on the provider's side.
_RESENDABLE: Final = ("/chat/completions", "/completions", "/embeddings")


def resendable(endpoint: str, parameters: Mapping[str, Any]) -> bool:
    """A Chat Completions, legacy Completions or Embeddings call that asks for nothing
    to be stored (``store: true`` keeps a completion on the provider's side)."""
    path = endpoint.rstrip("/")
    return path.endswith(_RESENDABLE) and parameters.get("store") is not True


def asking_usage(endpoint: str, parameters: Mapping[str, Any]) -> dict[str, Any] | None:
    """The parameters of a streamed chat completion that does not ask for its usage,
    asking for it (``stream_options.include_usage: true``, the agent's other stream
    options kept); None when the request is not such a stream (pure)."""
    if parameters.get("stream") is not True or not endpoint.rstrip("/").endswith(
        "/chat/completions"
    ):
        return None
    options = parameters.get("stream_options")
    if options is not None and not isinstance(options, dict):
        return None  # the agent's own (odd) value: the upstream judges it, untouched
    if options is not None and options.get("include_usage") is True:
        return None
    return {**parameters, "stream_options": {**(options or {}), "include_usage": True}}


#: ``"usage":null``, as OpenAI writes it in each chunk once usage is asked for.
_NULL_USAGE: Final = re.compile(rb',\s*"usage"\s*:\s*null')


def unasked_usage_removed(events: bytes) -> bytes:
    """Whole SSE ``events`` (bytes) of a chat stream whose usage the sidecar asked for,
    as the agent who did not ask would have had them: without the usage chunk (its
    ``choices`` empty, its ``usage`` an object) and without the ``"usage":null`` member
    of the other chunks (pure; any other event unchanged)."""
    if events.find(b'"usage"') < 0:  # not ``in``: see redaction._scrub_forms_bytes
        return events
    if events.find(b"\n\n") == len(events) - 2 and events.find(b"\r") < 0:
        pieces = [events]  # one event, the usual relayed chunk: what the split would give
    else:
        pieces = _EVENT_SPLIT.split(events)
    kept = []
    for event in pieces:
        if event.find(b'"usage"') >= 0:
            if _is_usage_chunk(event):
                continue
            event = _NULL_USAGE.sub(b"", event)
        kept.append(event)
    return b"".join(kept)


#: After each event's blank line (LF or CRLF line ends).
_EVENT_SPLIT: Final = re.compile(rb"(?<=\n\n)|(?<=\r\n\r\n)")


def _is_usage_chunk(event: bytes) -> bool:
    for line in event.splitlines():
        if line.startswith(b"data:"):
            try:  # every chunk of such a stream: orjson where it reads as json does
                data = fastjson.loads(line[5:])
            except ValueError:
                return False
            return (
                isinstance(data, dict)
                and data.get("choices") == []
                and isinstance(data.get("usage"), dict)
            )
    return False


def request_model(endpoint: str, parameters: Mapping[str, Any]) -> str | None:
    """The body's ``model``."""
    del endpoint
    return model_name(parameters.get("model"))


def response_model(data: Any) -> str | None:
    """``model`` of an answer or a chat stream chunk; ``response.model`` of a Responses
    stream's ``response.completed`` event."""
    if not isinstance(data, dict):
        return None
    inner = data.get("response")
    if isinstance(inner, dict):
        return model_name(inner.get("model"))
    return model_name(data.get("model"))


DIALECT: Final = Dialect(
    name="openai",
    usage=usage,
    stream_usage=stream_usage,
    delta_text=delta_text,
    output_cap=output_cap,
    # Billed as input besides the prompt: tool schemas (``functions`` is the legacy form
    # of ``tools``) and a structured output's schema (``response_format``).
    prompt_keys=(
        "messages",
        "prompt",
        "input",
        "instructions",
        "tools",
        "functions",
        "response_format",
    ),
    exhausted_holds=exhausted_holds,
    error_hint=error_hint,
    stream_signal=stream_signal,
    usage_event=usage_event,
    error_body=error_body,
    stream_error=stream_error,
    sdk_headers=("openai-beta",),
    credential_headers=("authorization", "api-key"),
    provider_name="openai",
    price_provider="openai",
    choices=choices,
    # The Responses API's stored conversation: its input tokens are not in the request.
    hidden_context_keys=("previous_response_id", "conversation"),
    operation=operation,
    request_model=request_model,
    asking_usage=asking_usage,
    unasked_usage_removed=unasked_usage_removed,
    response_model=response_model,
    with_model=body_model,
    resendable=resendable,
)
