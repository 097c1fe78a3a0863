"""The Anthropic dialect (Messages API).

Sources:
* Usage: ``usage.input_tokens`` + ``output_tokens``, plus ``cache_creation_input_tokens``
  and ``cache_read_input_tokens`` (Messages API reference). Streams carry input usage in
  ``message_start.message.usage`` and the cumulative output count in ``message_delta``,
  which may repeat the cache counts of ``message_start``: each is counted once.
* Stream text: ``content_block_delta`` events' ``delta.text``.
* Token cap: ``max_tokens``.
* Rate-limit headers, https://docs.anthropic.com/en/api/rate-limits ("Response headers"):
  ``anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-remaining`` and
  ``...-reset`` as an RFC 3339 time.
* Quota and billing errors (:func:`error_hint`), https://platform.claude.com/docs/en/api/errors
  and https://platform.claude.com/docs/en/api/rate-limits: ``402 billing_error`` ("an
  issue with your billing or payment information"; ``BillingError`` in
  anthropic-sdk-python ``types``); a 429 ``rate_limit_error`` whose
  ``error.details.error_code`` is ``enforced_spend_limit_reached`` (the usage tier's
  monthly spend cap: no ``retry-after``, "Retrying, including the SDKs' automatic
  retries, fails until access resumes"); and a 400 ``invalid_request_error`` when a spend
  limit you set is reached ("You have reached your specified [workspace] API usage
  limits") or the prepaid credit is spent ("Your credit balance is too low to access the
  Anthropic API", as the API answers it, e.g. anthropics/anthropic-sdk-python#818).
  Messages are matched by their documented beginnings, case-insensitively; any other 400
  stays a plain rejection, and a 429 without the code (a rate limit) is retried.
  ``overloaded_error`` (529) is not quota: it is the API's own load.
* Error bodies (https://platform.claude.com/docs/en/api/errors): ``{"type": "error",
  "error": {"type", "message"}}``, the SDK's exception class chosen by HTTP status and
  ``error.details.error_code`` (anthropic-sdk-python ``_error_classes.py``,
  ``make_status_error``; an unknown code falls back to the status: 400
  ``BadRequestError``, 403 ``PermissionDeniedError``, 429 ``RateLimitError``, 503
  ``ServiceUnavailableError``, 504, 529 ``OverloadedError``, other >= 500
  ``InternalServerError``, else ``APIStatusError``). Inside a stream, ``event: error``
  with that body makes it raise (``_streaming.py``). Its SDK sends the key as
  ``x-api-key`` (or ``Authorization: Bearer`` with an auth token) and needs
  ``anthropic-version`` (and ``anthropic-beta`` for beta features) to reach the API.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any, Final

from gateway.providers.base import (
    END,
    Dialect,
    ErrorHint,
    FailureKind,
    StreamSignal,
    TokenUsage,
    body_model,
    count,
    error_object,
    failure,
    model_name,
    number,
    positive_cap,
    sse_event,
    text_of,
)

_KINDS: Final = ("requests", "tokens", "input-tokens", "output-tokens")
#: ``(remaining, reset)`` header names of each limit (read on every answer: built once).
_LIMIT_HEADERS: Final = tuple(
    (f"anthropic-ratelimit-{kind}-remaining", f"anthropic-ratelimit-{kind}-reset")
    for kind in _KINDS
)
#: Anthropic's error types (API reference, "Errors") as a mid-stream error's kind.
_ERROR_KINDS: Final[dict[str, FailureKind]] = {
    "overloaded_error": "overloaded",
    "api_error": "overloaded",
    "timeout_error": "overloaded",
    "rate_limit_error": "rate_limited",
    "billing_error": "quota",
    "invalid_request_error": "rejected",
    "request_too_large": "rejected",
    "permission_error": "rejected",
    "authentication_error": "rejected",
    "not_found_error": "rejected",
}
_CACHE_KEYS: Final = ("cache_creation_input_tokens", "cache_read_input_tokens")
#: Beginnings of the messages (lower-cased) that mean spent credit or a spend limit,
#: with the reason reported for each.
_QUOTA_MESSAGES: Final = (
    ("your credit balance is too low", "credit_balance_too_low"),
    ("you have reached your specified", "spend_limit_reached"),
    ("you have reached your api usage limits", "enforced_spend_limit_reached"),
)


def combined_usage(usages: list[Any]) -> TokenUsage | None:
    """One usage from several ``usage`` objects of one answer (a stream's events)."""
    inp = out = cached = written = None
    seen = False
    for found in usages:
        if not isinstance(found, dict):
            continue
        seen = True
        if (v := count(found.get("input_tokens"))) is not None:
            inp = max(inp or 0, v)
        if (v := count(found.get("output_tokens"))) is not None:
            out = max(out or 0, v)  # message_delta reports the cumulative output count
        cache = sum(v for k in _CACHE_KEYS if (v := count(found.get(k))) is not None)
        if cache:
            cached = max(cached or 0, cache)
        if (v := count(found.get(_CACHE_KEYS[0]))) is not None:
            written = max(written or 0, v)  # the writes among them (priced apart)
    if not seen or (inp is None and out is None and cached is None):
        return None
    total = (inp or 0) + (out or 0) + (cached or 0)
    return TokenUsage(inp, out, cached, total, cache_write=written)


def usage(body: Any) -> TokenUsage | None:
    if not isinstance(body, dict):
        return None
    return combined_usage([body.get("usage")])


def stream_usage(events: list[Any]) -> TokenUsage | None:
    dicts = [e for e in events if isinstance(e, dict)]
    usages = [e.get("usage") for e in dicts]
    usages += [e["message"].get("usage") for e in dicts if isinstance(e.get("message"), dict)]
    return combined_usage(usages)


def usage_event(data: Any) -> bool:
    return isinstance(data, dict) and data.get("type") in ("message_start", "message_delta")


def stream_signal(event: str | None, data: Any) -> StreamSignal | None:
    """Terminal marker: ``message_stop``. Failure: the ``error`` event (``{"type":
    "error", "error": {"type": "overloaded_error", ...}}``), which Anthropic sends inside
    a 200 stream (Messages streaming reference, "Error events")."""
    kind = data.get("type") if isinstance(data, dict) else None
    if event == "message_stop" or kind == "message_stop":
        return END
    if event == "error" or kind == "error":
        error = data.get("error") if isinstance(data, dict) else None
        error = error if isinstance(error, dict) else {}
        name = text_of(error.get("type"))
        return failure(_ERROR_KINDS.get(name, "failed"), name, error.get("message"))
    return None


def delta_text(event: Any) -> str | None:
    if not isinstance(event, dict):
        return None
    delta = event.get("delta")
    if event.get("type") == "content_block_delta" and isinstance(delta, dict):
        text = delta.get("text")
        return text if isinstance(text, str) else None
    return None


def output_cap(parameters: Mapping[str, Any]) -> int:
    return positive_cap(parameters.get("max_tokens"))


def exhausted_holds(headers: Mapping[str, str], now: float) -> list[float]:
    """Seconds until each Anthropic limit whose ``remaining`` is 0 resets."""
    holds = []
    for remaining, reset in _LIMIT_HEADERS:
        value = headers.get(remaining)
        if value is not None and number(value) == 0:
            wait = _rfc3339_until(headers.get(reset), now)
            if wait is not None:
                holds.append(wait)
    return holds


def _rfc3339_until(value: str | None, now: float) -> float | None:
    if value is None:
        return None
    try:
        when = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.tzinfo is None:
        return None
    return when.timestamp() - now


def error_hint(status: int, headers: Mapping[str, str], body: Any) -> ErrorHint | None:
    """``quota`` for an Anthropic billing, credit or spend-limit error (module
    docstring), else None."""
    del headers  # x-should-retry is read for every dialect (gateway.providers.error_hint)
    if not 400 <= status < 500:
        return None
    error = error_object(body)
    kind = text_of(error.get("type")) if error else ""
    if status == 402 or kind == "billing_error":
        return ErrorHint("quota", kind or "billing_error")
    if error is None:
        return None
    details = error.get("details")
    code = text_of(details.get("error_code")) if isinstance(details, dict) else ""
    if code == "enforced_spend_limit_reached":
        return ErrorHint("quota", code)
    if (status, kind) in ((400, "invalid_request_error"), (429, "rate_limit_error")):
        message = text_of(error.get("message")).lstrip().lower()
        for start, reason in _QUOTA_MESSAGES:
            if message.startswith(start):
                return ErrorHint("quota", reason)
    return None


#: Anthropic's ``error.type`` for an HTTP status (others: ``invalid_request_error``
#: below 500, ``api_error`` from 500).
_ERROR_TYPES: Final = {
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_body(status: int, code: str, message: str) -> dict[str, Any]:
    """``{"type": "error", "error": {type, message, details: {error_code}}}``; the egress
    error code goes where Anthropic puts its own finer codes."""
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    error = {"type": kind, "message": message, "details": {"error_code": code}}
    return {"type": "error", "error": error}


def stream_error(status: int, code: str, message: str) -> bytes:
    """``event: error`` with the error body, as Anthropic fails a stream."""
    return sse_event("error", error_body(status, code, message))


def operation(endpoint: str) -> str | None:
    """``chat`` for the Messages API, ``text_completion`` for the legacy completions."""
    path = endpoint.rstrip("/")
    if path.endswith("/messages"):
        return "chat"
    return "text_completion" if path.endswith("/complete") else None


def resendable(endpoint: str, parameters: Mapping[str, Any]) -> bool:
    """A Messages or legacy Complete call that connects to no MCP server
    (``mcp_servers``: the provider then calls those servers, which may act)."""
    return operation(endpoint) is not None and not parameters.get("mcp_servers")


def request_model(endpoint: str, parameters: Mapping[str, Any]) -> str | None:
    """The body's ``model``."""
    del endpoint
    return model_name(parameters.get("model"))


def response_model(data: Any) -> str | None:
    """``model`` of a Messages answer, or ``message.model`` of a stream's
    ``message_start`` event."""
    if not isinstance(data, dict):
        return None
    message = data.get("message")
    if isinstance(message, dict):
        return model_name(message.get("model"))
    return model_name(data.get("model"))


DIALECT: Final = Dialect(
    name="anthropic",
    usage=usage,
    stream_usage=stream_usage,
    delta_text=delta_text,
    output_cap=output_cap,
    prompt_keys=("messages", "system", "tools"),
    exhausted_holds=exhausted_holds,
    error_hint=error_hint,
    stream_signal=stream_signal,
    usage_event=usage_event,
    error_body=error_body,
    stream_error=stream_error,
    sdk_headers=("anthropic-version", "anthropic-beta"),
    credential_headers=("x-api-key", "authorization"),
    marker_headers=("anthropic-version",),
    provider_name="anthropic",
    price_provider="anthropic",
    operation=operation,
    request_model=request_model,
    response_model=response_model,
    with_model=body_model,
    resendable=resendable,
    cached_outside_input=True,  # input_tokens excludes cache reads and writes
)
