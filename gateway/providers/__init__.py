"""Provider dialects: what the sidecar knows of each LLM provider's wire format (pure).

One module per dialect (``openai``, ``anthropic``, ``gemini``), each exposing a
:class:`~gateway.providers.base.Dialect` as ``DIALECT``; adding a provider is adding a
module here and its line in :data:`DIALECTS`. A target picks its dialect with the policy
key ``usage`` (``none`` reads nothing). The call path uses only the functions below:

* :func:`extract_usage`: token usage of an answer, by the target's dialect;
* :func:`delta_text`: the text an SSE event carries, in any known dialect (a stream is
  assembled the same way whatever the target says);
* :func:`exhausted_holds`: rate-limit resets the answer's headers report, in any dialect;
* :func:`error_hint`: what an error answer says about retrying it, by the target's
  dialect (quota and credit errors) and ``x-should-retry`` (any target);
* :func:`estimate_tokens`: the token reservation for a request body;
* :func:`drop_in_dialect`: whose error shape a drop-in answer takes; with
  :data:`SDK_HEADERS`, :data:`CREDENTIAL_HEADERS` and :data:`CREDENTIAL_QUERY`, what the
  providers' SDKs send (the drop-in route's intake, :mod:`gateway.call.proxy`).
* :func:`genai_call` and :func:`response_model`: a call and its answer as the
  OpenTelemetry GenAI semantic conventions describe them (provider, operation, models);
* :func:`request_model` and :func:`with_model`: the model a request asks for, and the
  request rewritten to ask for another (model pins, failover), by the target's dialect;
* :func:`resendable`: whether a request lost before its answer may be sent again
  without an idempotency key (a duplicate costs tokens, nothing else).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Final

from gateway import fastjson
from gateway.providers import anthropic, gemini, openai
from gateway.providers.base import (
    Dialect,
    ErrorHint,
    GenAICall,
    TokenUsage,
    Verdict,
    should_retry_header,
)

__all__ = [
    "CREDENTIAL_HEADERS",
    "CREDENTIAL_QUERY",
    "DIALECTS",
    "PROMPT_BYTES_PER_TOKEN",
    "SDK_HEADERS",
    "Dialect",
    "ErrorHint",
    "GenAICall",
    "TokenUsage",
    "asking_usage",
    "delta_text",
    "drop_in_dialect",
    "error_hint",
    "estimate_tokens",
    "exhausted_holds",
    "extract_usage",
    "genai_call",
    "output_cap",
    "prompt_bytes",
    "request_model",
    "resendable",
    "response_model",
    "with_model",
]

DIALECTS: Final[Mapping[str, Dialect]] = {
    d.name: d for d in (openai.DIALECT, anthropic.DIALECT, gemini.DIALECT)
}
#: Bytes of prompt per token in :func:`estimate_tokens` (OpenAI's rule of thumb for
#: English text: https://help.openai.com/en/articles/4936856).
PROMPT_BYTES_PER_TOKEN: Final = 4
_PROMPT_KEYS: Final = tuple(dict.fromkeys(k for d in DIALECTS.values() for k in d.prompt_keys))
_DELTA_READERS: Final = tuple(d.delta_text for d in DIALECTS.values())
_CAP_READERS: Final = tuple(d.output_cap for d in DIALECTS.values())
_HOLD_READERS: Final = tuple(d.exhausted_holds for d in DIALECTS.values())
#: Request headers (lower case) that the providers' SDKs send and the providers need.
SDK_HEADERS: Final = frozenset(h for d in DIALECTS.values() for h in d.sdk_headers)
#: Where the providers' SDKs put the agent's own key: headers (lower case), query names.
CREDENTIAL_HEADERS: Final = frozenset(h for d in DIALECTS.values() for h in d.credential_headers)
CREDENTIAL_QUERY: Final = frozenset(q for d in DIALECTS.values() for q in d.credential_query)
#: The shape of drop-in errors when neither the target nor the request says: OpenAI's,
#: which most clients of LLM APIs read.
_DEFAULT_DROP_IN: Final = openai.DIALECT


def extract_usage(provider: str, data: Any) -> TokenUsage | None:
    """Usage reported in ``data`` (a parsed body, or the SSE shape of
    :func:`gateway.call.bodies.parse_sse`) in dialect ``provider``; None when the answer
    reports none or ``provider`` is ``none``."""
    dialect = DIALECTS.get(provider)
    if dialect is None or data is None:
        return None
    if isinstance(data, dict) and data.get("content_type") == "text/event-stream":
        return dialect.stream_usage(data.get("events") or [])
    return dialect.usage(data)  # a JSON object, or a JSON array of chunks (Gemini)


def delta_text(event: Any) -> str | None:
    """The generated text one parsed SSE event carries, in whichever dialect it is."""
    for read in _DELTA_READERS:
        piece = read(event)
        if piece is not None:
            return piece
    return None


def exhausted_holds(headers: Mapping[str, str], now: float) -> list[float]:
    """Seconds until each rate limit that ``headers`` (case-insensitive names) report as
    spent resets, in every dialect; ``now`` is wall-clock time (``time.time()``)."""
    holds: list[float] = []
    for read in _HOLD_READERS:
        holds += read(headers, now)
    return holds


def error_hint(
    provider: str, status: int, headers: Mapping[str, str], body: Any
) -> ErrorHint | None:
    """What a non-2xx answer says about retrying it, beyond its status, for a target of
    dialect ``provider`` (its policy key ``usage``; ``none`` reads only the header).

    ``headers`` may have names in any case; ``body`` is the parsed JSON body, or None.
    In order: the dialect's quota and credit errors (``verdict="quota"``: retrying cannot
    help, whatever a header says); then ``x-should-retry``
    (:func:`~gateway.providers.base.should_retry_header`) for every target, because a
    server that sends it means it: ``false`` on a 429 is quota (design, "New codes"),
    ``false`` otherwise is ``no_retry``, ``true`` is ``retry``; then what else the
    dialect reads (a ``RetryInfo`` wait). None when the answer says nothing more.
    """
    dialect = DIALECTS.get(provider)
    hint = dialect.error_hint(status, headers, body) if dialect is not None else None
    if hint is not None and hint.verdict == "quota":
        return hint
    says = should_retry_header({k.lower(): v for k, v in headers.items()})
    if says is None:
        return hint
    wait = hint.retry_after_s if hint is not None else None
    if says:
        return ErrorHint("retry", "x-should-retry: true", retry_after_s=wait)
    verdict: Verdict = "quota" if status == 429 else "no_retry"
    return ErrorHint(verdict, "x-should-retry: false")


def drop_in_dialect(provider: str | None, header_names: frozenset[str]) -> Dialect:
    """The dialect whose error shapes a drop-in answer uses: the target's (its policy key
    ``usage``), else the one whose SDK sent ``header_names`` (lower case; e.g.
    ``anthropic-version``), else OpenAI's."""
    dialect = DIALECTS.get(provider) if provider is not None else None
    if dialect is not None:
        return dialect
    for candidate in DIALECTS.values():
        if any(name in header_names for name in candidate.marker_headers):
            return candidate
    return _DEFAULT_DROP_IN


def prompt_bytes(parameters: Mapping[str, Any]) -> int:
    """UTF-8 bytes of a request body's prompt keys (see :func:`estimate_tokens`)."""
    size = 0
    for key in _PROMPT_KEYS:
        if key not in parameters:
            continue
        value = parameters[key]
        if isinstance(value, str):
            size += len(value.encode("utf-8"))
        else:
            size += len(fastjson.compact(value, default=str))
    return size


def output_cap(parameters: Mapping[str, Any]) -> int:
    """The output-token cap a request body sets, in any dialect (0 when none): the
    largest of every dialect's (a body may carry another dialect's keys, and the
    estimate is defined over all of them)."""
    cap = 0
    for read in _CAP_READERS:
        found = read(parameters)
        if found > cap:
            cap = found
    return cap


def estimate_tokens(parameters: Mapping[str, Any]) -> int:
    """Tokens to reserve for an LLM call whose JSON body is ``parameters``.

    = the output cap (``max_tokens`` / ``max_completion_tokens`` / ``max_output_tokens``,
    or Gemini's ``generationConfig.maxOutputTokens``; 0 when absent) + ceil(prompt bytes /
    4), where prompt bytes are the UTF-8 bytes of ``messages``, ``prompt``, ``input``,
    ``contents``, ``system``, ``systemInstruction``, ``instructions``, ``tools``,
    ``functions`` and ``response_format`` (strings as is, other values as compact JSON).
    0 for a body with none of these.
    """
    return output_cap(parameters) + math.ceil(prompt_bytes(parameters) / PROMPT_BYTES_PER_TOKEN)


#: (dialect, endpoint, request model) -> its GenAICall (or None: not a model call): a call
#: is described by these alone, and agents call a few endpoints with a few models, so
#: each call reuses the frozen description instead of matching its endpoint again.
#: Bounded: cleared when full; a long endpoint (a path with ids) is not kept.
_KNOWN_CALLS: Final[dict[tuple[str, str, str | None], GenAICall | None]] = {}
_MAX_KNOWN_CALLS: Final = 1024
_MAX_KNOWN_ENDPOINT: Final = 256


def genai_call(provider: str, endpoint: str, parameters: Mapping[str, Any]) -> GenAICall | None:
    """The GenAI description of a call to ``endpoint`` on a target of dialect ``provider``
    (its policy key ``usage``); None when the target has no dialect or the endpoint is
    not a model call (``GET /v1/models``, a file upload)."""
    dialect = DIALECTS.get(provider)
    if dialect is None:
        return None
    model = dialect.request_model(endpoint, parameters)
    key = (provider, endpoint, model)
    try:
        return _KNOWN_CALLS[key]
    except KeyError:
        pass
    operation = dialect.operation(endpoint)
    call = (
        None
        if operation is None
        else GenAICall(dialect.provider_name, operation, model, dialect.cached_outside_input)
    )
    if len(endpoint) <= _MAX_KNOWN_ENDPOINT:  # model names are at most 256 characters
        if len(_KNOWN_CALLS) >= _MAX_KNOWN_CALLS:
            _KNOWN_CALLS.clear()
        _KNOWN_CALLS[key] = call
    return call


def asking_usage(
    provider: str, endpoint: str, parameters: Mapping[str, Any]
) -> tuple[dict[str, Any], Callable[[bytes], bytes]] | None:
    """A relayed stream that does not ask for its usage, by ``provider``'s dialect (an
    OpenAI chat stream without ``stream_options.include_usage``): its parameters asking
    for it, and what removes from its whole events what the asking added, so the agent
    gets the stream it asked for and the books get the usage. None: nothing to ask."""
    dialect = DIALECTS.get(provider)
    if dialect is None:
        return None
    asked = dialect.asking_usage(endpoint, parameters)
    return None if asked is None else (asked, dialect.unasked_usage_removed)


def response_model(provider: str, data: Any) -> str | None:
    """The model an answer says it came from: ``data`` is a parsed body, the SSE shape of
    :func:`gateway.call.bodies.parse_sse`, or a list of parsed stream events."""
    dialect = DIALECTS.get(provider)
    if dialect is None or data is None:
        return None
    if isinstance(data, dict) and data.get("content_type") == "text/event-stream":
        data = data.get("events") or []
    if isinstance(data, list):  # stream events, or Gemini's JSON array of chunks
        return next((m for e in data if (m := dialect.response_model(e)) is not None), None)
    return dialect.response_model(data)


def request_model(provider: str, endpoint: str, parameters: Mapping[str, Any]) -> str | None:
    """The model a request to ``endpoint`` with body ``parameters`` asks for, in dialect
    ``provider`` (OpenAI and Anthropic: the body's ``model``; Gemini: the path's
    ``models/{model}:method``); None when it names none or the dialect is unknown."""
    dialect = DIALECTS.get(provider)
    return dialect.request_model(endpoint, parameters) if dialect is not None else None


def with_model(
    provider: str, endpoint: str, parameters: Mapping[str, Any], model: str
) -> tuple[str, Mapping[str, Any]]:
    """``(endpoint, parameters)`` asking for ``model`` instead, in dialect ``provider``
    (OpenAI and Anthropic: the body's ``model``, a shallow copy; Gemini: the path's
    model). Pure: the inputs are not changed. Unchanged for an unknown dialect or a
    request that names no model (a Gemini path without ``models/{model}:``)."""
    dialect = DIALECTS.get(provider)
    if dialect is None:
        return endpoint, parameters
    if dialect.request_model(endpoint, parameters) is None:
        return endpoint, parameters
    return dialect.with_model(endpoint, parameters, model)


def resendable(provider: str, endpoint: str, parameters: Mapping[str, Any]) -> bool:
    """Whether a duplicate of a request to ``endpoint`` with body ``parameters`` costs
    tokens and nothing else, in dialect ``provider`` (its policy key ``usage``): an
    inference call that stores nothing and acts on no other system (OpenAI: Chat
    Completions, Completions, Embeddings without ``store: true``; Anthropic: Messages and
    Complete without ``mcp_servers``; Gemini: ``generateContent``,
    ``streamGenerateContent``, ``embedContent``, ``batchEmbedContents``). False for
    ``none`` and every other endpoint (files, batches, fine-tuning, the Responses API)."""
    dialect = DIALECTS.get(provider)
    return dialect is not None and dialect.resendable(endpoint, parameters)
