"""What every provider dialect module offers the call path (pure: no I/O).

A dialect is one module in :mod:`gateway.providers` that builds a :class:`Dialect`:

* ``usage(body)``: the :class:`TokenUsage` of a whole JSON answer, or None;
* ``stream_usage(events)``: the usage reported by a stream's parsed ``data:`` events;
* ``delta_text(event)``: the piece of generated text one stream event carries, or None;
* ``output_cap(parameters)``: the output-token cap a request body sets (0 when none);
  ``prompt_keys``: the body keys that hold the prompt, for the token estimate;
* ``provider_name``, ``operation(endpoint)``, ``request_model(endpoint, parameters)`` and
  ``response_model(data)``: how the OpenTelemetry GenAI semantic conventions name the
  provider, the operation an endpoint is (``chat``, ``embeddings``...; None for an
  endpoint that is not a model call), the model a request asks for and the model an
  answer (a JSON body, or one stream event) says it came from; ``with_model(endpoint,
  parameters, model)``: the request asking for ``model`` instead (a new endpoint and
  body; the inputs are not changed), how a pin or a fallback rewrites the model before
  sending; ``cached_outside_input``:
  the dialect's ``input`` count leaves the cached tokens out (the conventions count them
  in), and its ``cached`` count is cache reads and writes together;
  ``reasoning_outside_output``: its ``reasoning`` count is not part of ``output`` (and
  is billed as output); ``price_provider``: the provider's id in genai-prices
  (:mod:`gateway.cost`), "" when it has none; ``choices(parameters)``: how many answers
  a request asks for (each up to the output cap); ``hidden_context_keys``: request keys
  that bring in input kept on the provider's side (not in the request's bytes);
  ``resendable(endpoint, parameters)``: a duplicate of the request costs tokens and
  nothing else (an inference call that stores nothing, acts on no other system);
* ``exhausted_holds(headers, now)``: seconds until each rate limit that the answer's
  headers report as spent resets (``now`` is wall-clock time, for absolute resets);
* ``error_hint(status, headers, body)``: what a non-2xx answer's body says about
  retrying it (an :class:`ErrorHint`, or None when it says nothing the status does not);
* ``stream_signal(event, data)``: what one stream event (its SSE ``event:`` type and its
  ``data``, parsed when JSON) says about the stream: :data:`END` (the terminal marker),
  a :class:`StreamFailure` (an error event inside a 200 stream), or None;
  ``usage_event(data)``: whether the event carries usage that ``stream_usage`` reads (the
  relay keeps only those, so memory stays bounded whatever the stream's length).

For the drop-in routes (design.md, "Drop-in provider routes"), what the provider's SDKs
expect of an answer and send in a request:

* ``error_body(status, code, message)``: the sidecar's own refusal (its HTTP status, the
  egress error code, the message) as a JSON error body in the provider's shape, so that
  its SDK raises its usual exception class for ``status`` with ``message``;
* ``stream_error(status, code, message)``: the same as one SSE event that ends a stream
  the SDK is reading (bytes, ending with a blank line), so that it raises instead of
  returning a partial answer as complete;
* ``sdk_headers``: request headers its SDKs send that the provider needs (API version,
  beta flags: lower case); ``credential_headers`` and ``credential_query``: where its
  SDKs put the agent's own key (never forwarded); ``marker_headers``: headers only its
  SDKs send, to pick the error shape when the target does not say.

Absent is not zero: an answer that reports no usage gives None, never 0.

Shared by every dialect: :func:`should_retry_header` reads ``x-should-retry``, the
header with which the OpenAI and Anthropic APIs tell their SDKs whether to retry.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

#: What an error answer says about retrying it (see :class:`ErrorHint`).
Verdict = Literal["quota", "retry", "no_retry"]


@dataclass(frozen=True, slots=True)
class TokenUsage:
    """Token counts of one call. ``total`` is what ``tokens_used`` reports; ``reasoning``
    (OpenAI's ``reasoning_tokens``, part of the output) is kept for the audit record;
    ``cache_write``: the part of ``cached`` that was written to the cache (Anthropic's
    ``cache_creation_input_tokens``, billed at another rate than reads), None if unknown."""

    input: int | None
    output: int | None
    cached: int | None
    total: int
    reasoning: int | None = None
    cache_write: int | None = None


@dataclass(frozen=True, slots=True)
class GenAICall:
    """A model call as the OpenTelemetry GenAI semantic conventions name it:
    ``gen_ai.provider.name``, ``gen_ai.operation.name``, ``gen_ai.request.model`` (None
    when the request names none), and whether the dialect's input count leaves the cached
    tokens out (:class:`Dialect`)."""

    provider: str
    operation: str
    request_model: str | None
    cached_outside_input: bool = False


#: How a failed stream is answered: ``overloaded`` (DEPENDENCY_FAILED, retryable),
#: ``rate_limited`` (CAPACITY_EXCEEDED, retryable), ``quota`` (QUOTA_EXHAUSTED),
#: ``rejected`` (UPSTREAM_REJECTED: the request itself was refused) and ``failed``
#: (DEPENDENCY_FAILED, retryable: any other error the provider reports mid-stream).
FailureKind = Literal["overloaded", "rate_limited", "quota", "rejected", "failed"]


@dataclass(frozen=True, slots=True)
class StreamFailure:
    """An error event inside a 200 stream: its kind, the provider's own word for it
    (an error type or code) and its message (cut to 500 characters)."""

    kind: FailureKind
    reason: str
    message: str


class _End:
    """The type of :data:`END`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "END"


#: The provider's terminal marker: the stream is complete.
END: Final = _End()
StreamSignal = _End | StreamFailure


def count(value: Any) -> int | None:
    """``value`` if it is a token count (a non-negative int, not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def number(value: str | None) -> float | None:
    """A header value as a finite number, or None."""
    if value is None:
        return None
    try:
        parsed = float(value.strip())
    except ValueError:
        return None
    return parsed if math.isfinite(parsed) else None


@dataclass(frozen=True, slots=True)
class ErrorHint:
    """What an upstream's error answer says about retrying it, beyond its status.

    ``verdict``: ``"quota"`` (the account is out of quota, credit or spend: the answer is
    QUOTA_EXHAUSTED, never retried), ``"retry"`` (the upstream allows a retry whatever the
    status), ``"no_retry"`` (it forbids one), or None (the status and ``retry_on``
    decide). ``reason`` is the provider's own word for it (an error code or type, a
    quota id, ``x-should-retry: false``), reported in ``details.upstream_reason``.
    ``retry_after_s`` is a wait the body names (seconds, e.g. Gemini's ``RetryInfo``),
    used when the headers name none.
    """

    verdict: Verdict | None
    reason: str
    retry_after_s: float | None = None


def should_retry_header(headers: Mapping[str, str]) -> bool | None:
    """The upstream's ``x-should-retry`` (lower-case header names): True for ``true``,
    False for ``false``, None when absent or anything else.

    Source: the OpenAI and Anthropic Python SDKs (``_base_client.py``, ``_should_retry``:
    "If the server explicitly says whether or not to retry, obey"), which compare the
    value exactly to ``"true"`` / ``"false"`` and let it override the status (a
    ``true`` retries a 409 or a 400, a ``false`` stops a 429 or a 5xx), still within
    their retry budget. Surrounding whitespace is not part of a field value (RFC 9110
    section 5.5) and is ignored; the case of the value is not.
    """
    value = headers.get("x-should-retry")
    if value is None:
        return None
    return {"true": True, "false": False}.get(value.strip())


def error_object(body: Any) -> dict[str, Any] | None:
    """The ``error`` object of a JSON error body (``{"error": {...}}``, the shape of all
    three providers), or None. A JSON array of one such body (Gemini's non-SSE stream
    endpoint) is read by its first element."""
    if isinstance(body, list) and body:
        body = body[0]
    if not isinstance(body, dict):
        return None
    error = body.get("error")
    return error if isinstance(error, dict) else None


def text_of(value: Any) -> str:
    """``value`` if it is a string, else ``""`` (error fields are not always strings)."""
    return value if isinstance(value, str) else ""


def _no_usage(_: Any) -> TokenUsage | None:
    return None


def _no_stream_usage(_: list[Any]) -> TokenUsage | None:
    return None


def _no_text(_: Any) -> str | None:
    return None


def _no_cap(_: Mapping[str, Any]) -> int:
    return 0


def _no_holds(_: Mapping[str, str], __: float) -> list[float]:
    return []


def _no_hint(_: int, __: Mapping[str, str], ___: Any) -> ErrorHint | None:
    return None


def _no_signal(_: str | None, __: Any) -> StreamSignal | None:
    return None


def _no_usage_event(_: Any) -> bool:
    return False


def _generic_error_body(status: int, code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "status": status}}


def _generic_stream_error(status: int, code: str, message: str) -> bytes:
    return sse_event(None, _generic_error_body(status, code, message))


#: The domain that drop-in error bodies name as the source of a refusal (where a shape
#: has a place for one: Gemini's ``google.rpc.ErrorInfo``).
ERROR_DOMAIN: Final = "egress-gateway"


def sse_event(event: str | None, data: Any, *, newline: bytes = b"\n") -> bytes:
    """One server-sent event: an ``event:`` line when ``event`` is given, one ``data:``
    line of compact JSON (ASCII, so no line break can hide in it), a blank line."""
    head = b"event: " + event.encode() + newline if event else b""
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=True).encode()
    return head + b"data: " + text + newline + newline


def _no_operation(_: str) -> str | None:
    return None


def _asks_nothing(_: str, __: Mapping[str, Any]) -> dict[str, Any] | None:
    return None


def _unchanged(events: bytes) -> bytes:
    return events


def _no_request_model(_: str, __: Mapping[str, Any]) -> str | None:
    return None


def _never(endpoint: str, parameters: Mapping[str, Any]) -> bool:
    del endpoint, parameters
    return False


def _one_choice(_: Mapping[str, Any]) -> int:
    return 1


def _keep_model(
    endpoint: str, parameters: Mapping[str, Any], _: str
) -> tuple[str, Mapping[str, Any]]:
    return endpoint, parameters


def body_model(
    endpoint: str, parameters: Mapping[str, Any], model: str
) -> tuple[str, dict[str, Any]]:
    """``(endpoint, parameters)`` with the body's ``model`` set to ``model`` (a shallow
    copy; the OpenAI and Anthropic dialects name the model in the body)."""
    return endpoint, {**parameters, "model": model}


@dataclass(frozen=True, slots=True)
class Dialect:
    """One provider's knowledge, as the call path uses it (see the module docstring)."""

    name: str
    usage: Callable[[Any], TokenUsage | None] = _no_usage
    stream_usage: Callable[[list[Any]], TokenUsage | None] = _no_stream_usage
    delta_text: Callable[[Any], str | None] = _no_text
    output_cap: Callable[[Mapping[str, Any]], int] = _no_cap
    prompt_keys: tuple[str, ...] = ()
    exhausted_holds: Callable[[Mapping[str, str], float], list[float]] = _no_holds
    error_hint: Callable[[int, Mapping[str, str], Any], ErrorHint | None] = _no_hint
    stream_signal: Callable[[str | None, Any], StreamSignal | None] = _no_signal
    usage_event: Callable[[Any], bool] = _no_usage_event
    error_body: Callable[[int, str, str], dict[str, Any]] = _generic_error_body
    stream_error: Callable[[int, str, str], bytes] = _generic_stream_error
    sdk_headers: tuple[str, ...] = ()
    credential_headers: tuple[str, ...] = ()
    credential_query: tuple[str, ...] = ()
    marker_headers: tuple[str, ...] = ()
    provider_name: str = ""
    operation: Callable[[str], str | None] = _no_operation
    request_model: Callable[[str, Mapping[str, Any]], str | None] = _no_request_model
    #: ``(endpoint, parameters)`` -> the parameters of a stream that asks for its usage
    #: (None: it does, or is no such stream); and what removes, from whole events, what
    #: that asking added (the agent gets the stream it asked for).
    asking_usage: Callable[[str, Mapping[str, Any]], dict[str, Any] | None] = _asks_nothing
    unasked_usage_removed: Callable[[bytes], bytes] = _unchanged
    response_model: Callable[[Any], str | None] = _no_text
    with_model: Callable[[str, Mapping[str, Any], str], tuple[str, Mapping[str, Any]]] = _keep_model
    cached_outside_input: bool = False
    reasoning_outside_output: bool = False
    price_provider: str = ""
    choices: Callable[[Mapping[str, Any]], int] = _one_choice
    hidden_context_keys: tuple[str, ...] = ()
    #: ``(endpoint, parameters)`` -> whether a duplicate of the request costs tokens and
    #: nothing else (an inference call that stores nothing and acts on no other system):
    #: what lets a request lost before its answer be sent again without a key.
    resendable: Callable[[str, Mapping[str, Any]], bool] = _never


def last_reported(
    usage: Callable[[Any], TokenUsage | None], events: list[Any]
) -> TokenUsage | None:
    """The usage of the last stream event that reports one (OpenAI's final usage chunk,
    Gemini's last ``usageMetadata``)."""
    for event in reversed(events):
        if isinstance(event, dict):
            found = usage(event)
            if found is not None:
                return found
    return None


def positive_cap(value: Any) -> int:
    """A ``max_tokens``-like value as a cap: a positive int, else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def model_name(value: Any) -> str | None:
    """``value`` if it can be a model name (a string of 1 to 256 characters), else None."""
    return value if isinstance(value, str) and 0 < len(value) <= 256 else None


def failure(kind: FailureKind, reason: Any, message: Any) -> StreamFailure:
    """A :class:`StreamFailure` from an error event's (untrusted) fields."""
    return StreamFailure(kind, text_of(reason)[:100] or "error", text_of(message)[:500])
