"""The Gemini dialect (generateContent / streamGenerateContent).

Sources (Gemini API reference, ``generateContent``):
* Usage: ``usageMetadata.promptTokenCount`` / ``candidatesTokenCount`` /
  ``totalTokenCount`` / ``cachedContentTokenCount``; a stream repeats ``usageMetadata``
  and the last one counts.
* Token cap: ``generationConfig.maxOutputTokens``.
* Errors (:func:`error_hint`) are ``{"error": {"code", "message", "status", "details"}}``
  with ``google.rpc`` details (https://ai.google.dev/gemini-api/docs/generate-content/
  api-errors). ``RESOURCE_EXHAUSTED`` is used both for spent money and for plain rate
  limits, so only these are quota (QUOTA_EXHAUSTED, not retried): a 402 (prepay credit
  depleted: "Add credits to your billing account"); a 429 whose message says "prepayment
  credits are depleted" (what the API answered before it moved that case to 402); a 429
  with a ``QuotaFailure`` violation whose ``quotaId`` is a daily one (``PerDay`` /
  ``Daily``, e.g. ``GenerateRequestsPerDayPerProjectPerModel-FreeTier``: it resets at
  midnight Pacific time, no retry inside a call's deadline helps); and an ``ErrorInfo``
  reason ``INSUFFICIENT_G1_CREDITS_BALANCE``. The daily-quota and credit rules are
  Google's own client's (google-gemini/gemini-cli ``packages/core/src/utils/
  googleQuotaErrors.ts``, ``classifyGoogleError``: ``TerminalQuotaError``). Every other
  429 (per-minute quotas, no details, Vertex AI's "Resource exhausted. Please try again
  later.") stays a retryable rate limit, as google-genai retries every 429
  (``_api_client.py``, ``_RETRY_HTTP_STATUS_CODES``). A ``RetryInfo.retryDelay``
  (protobuf JSON duration, ``"37s"``) is the wait before the retry.
* Drop-in error bodies are that shape, ``status`` the google.rpc code of the HTTP status
  (https://cloud.google.com/apis/design/errors, "Handling errors") and the egress error
  code as an ``ErrorInfo`` reason; google-genai raises ``ClientError`` for 4xx and
  ``ServerError`` for 5xx (``errors.py``), and inside a stream for a ``data:`` chunk that
  is ``{"error": ...}`` (``_api_client.py``, ``request_streamed``). Its SDK sends the key
  as ``x-goog-api-key`` (REST clients also as ``?key=``) and ``x-goog-api-client``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, Final

from gateway.providers.base import (
    END,
    ERROR_DOMAIN,
    Dialect,
    ErrorHint,
    FailureKind,
    StreamSignal,
    TokenUsage,
    count,
    error_object,
    failure,
    last_reported,
    model_name,
    positive_cap,
    sse_event,
    text_of,
)

_TYPE_PREFIX: Final = "type.googleapis.com/google.rpc."
#: google.rpc.Code names as a mid-stream error's kind (RESOURCE_EXHAUSTED is also how
#: per-minute limits are reported: rate_limited, retryable).
_STATUS_KINDS: Final[dict[str, FailureKind]] = {
    "RESOURCE_EXHAUSTED": "rate_limited",
    "UNAVAILABLE": "overloaded",
    "INTERNAL": "overloaded",
    "DEADLINE_EXCEEDED": "overloaded",
    "INVALID_ARGUMENT": "rejected",
    "FAILED_PRECONDITION": "rejected",
    "PERMISSION_DENIED": "rejected",
    "NOT_FOUND": "rejected",
}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(s|ms)")
_DAILY_MARKS: Final = ("PerDay", "Daily")
_CREDIT_REASONS: Final = frozenset({"INSUFFICIENT_G1_CREDITS_BALANCE"})


def usage(body: Any) -> TokenUsage | None:
    """Usage of a ``generateContent`` answer, one stream chunk, or the JSON array that
    ``streamGenerateContent`` answers without ``alt=sse`` (its last ``usageMetadata``)."""
    if isinstance(body, list):
        return last_reported(usage, body)
    if not isinstance(body, dict):
        return None
    meta = body.get("usageMetadata")
    if not isinstance(meta, dict):
        return None
    inp = count(meta.get("promptTokenCount"))
    out = count(meta.get("candidatesTokenCount"))
    cached = count(meta.get("cachedContentTokenCount"))
    reasoning = count(meta.get("thoughtsTokenCount"))
    total = count(meta.get("totalTokenCount"))
    if total is None:
        if inp is None and out is None:
            return None
        total = (inp or 0) + (out or 0)
    return TokenUsage(inp, out, cached, total, reasoning)


def usage_event(data: Any) -> bool:
    return isinstance(data, dict) and isinstance(data.get("usageMetadata"), dict)


def stream_signal(event: str | None, data: Any) -> StreamSignal | None:
    """Terminal marker: a chunk whose candidate has a ``finishReason`` (any value: STOP,
    MAX_TOKENS, SAFETY... all end the answer). Failure: a chunk ``{"error": {code,
    status, message}}`` (google.rpc.Status, as the API sends mid-stream)."""
    del event
    if not isinstance(data, dict):
        return None
    error = data.get("error")
    if isinstance(error, dict):
        status = error.get("status")
        kind = _STATUS_KINDS.get(status if isinstance(status, str) else "", "failed")
        return failure(kind, status or error.get("code"), error.get("message"))
    candidates = data.get("candidates")
    if isinstance(candidates, list):
        for candidate in candidates:
            if isinstance(candidate, dict) and candidate.get("finishReason"):
                return END
    return None


def stream_usage(events: list[Any]) -> TokenUsage | None:
    return last_reported(usage, events)


def output_cap(parameters: Mapping[str, Any]) -> int:
    config = parameters.get("generationConfig")
    return positive_cap(config.get("maxOutputTokens")) if isinstance(config, Mapping) else 0


def choices(parameters: Mapping[str, Any]) -> int:
    """``generationConfig.candidateCount``: how many candidates a request asks for."""
    config = parameters.get("generationConfig")
    count = positive_cap(config.get("candidateCount")) if isinstance(config, Mapping) else 0
    return max(count, 1)


def error_hint(status: int, headers: Mapping[str, str], body: Any) -> ErrorHint | None:
    """``quota`` for spent credit or a spent daily quota; otherwise the ``RetryInfo``
    wait, if any (module docstring); None when the body says neither."""
    del headers  # x-should-retry is read for every dialect (gateway.providers.error_hint)
    if status == 402:  # whatever the body: 402 is Payment Required (RFC 9110 15.5.3)
        return ErrorHint("quota", "payment_required")
    error = error_object(body)
    if error is None or not 400 <= status < 600:
        return None
    details = _details(error)
    if status == 429:
        if "prepayment credits are depleted" in text_of(error.get("message")).lower():
            return ErrorHint("quota", "prepayment_credits_depleted")
        for violation in _items(details.get("QuotaFailure"), "violations"):
            quota_id = text_of(violation.get("quotaId"))
            if any(mark in quota_id for mark in _DAILY_MARKS):
                return ErrorHint("quota", quota_id)
        reason = text_of(details.get("ErrorInfo", {}).get("reason"))
        if reason in _CREDIT_REASONS:
            return ErrorHint("quota", reason)
    wait = _duration_s(details.get("RetryInfo", {}).get("retryDelay"))
    return ErrorHint(None, "RetryInfo", retry_after_s=wait) if wait is not None else None


def _details(error: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``error.details`` by type name (``QuotaFailure``, ``RetryInfo``...); first wins."""
    found: dict[str, dict[str, Any]] = {}
    raw = error.get("details")
    for detail in raw if isinstance(raw, list) else []:
        if isinstance(detail, dict):
            kind = text_of(detail.get("@type"))
            if kind.startswith(_TYPE_PREFIX):
                found.setdefault(kind.removeprefix(_TYPE_PREFIX), detail)
    return found


def _items(detail: Mapping[str, Any] | None, key: str) -> list[dict[str, Any]]:
    raw = detail.get(key) if detail else None
    return [item for item in raw if isinstance(item, dict)] if isinstance(raw, list) else []


def _duration_s(value: Any) -> float | None:
    """A protobuf JSON duration (``"37s"``, ``"1.5s"``; ``"900ms"`` is accepted too) in
    seconds, or None."""
    match = _DURATION.fullmatch(value.strip()) if isinstance(value, str) else None
    if match is None:
        return None
    seconds = float(match[1]) / (1000.0 if match[2] == "ms" else 1.0)
    return seconds if math.isfinite(seconds) else None


#: google.rpc code names for HTTP statuses (others: INVALID_ARGUMENT below 500,
#: INTERNAL from 500).
_RPC_CODES: Final = {
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ABORTED",
    422: "FAILED_PRECONDITION",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    501: "UNIMPLEMENTED",
    502: "UNAVAILABLE",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


def error_body(status: int, code: str, message: str) -> dict[str, Any]:
    """``{"error": {code, message, status, details: [ErrorInfo]}}`` (google.rpc.Status)."""
    rpc = _RPC_CODES.get(status, "INTERNAL" if status >= 500 else "INVALID_ARGUMENT")
    info = {"@type": _TYPE_PREFIX + "ErrorInfo", "reason": code, "domain": ERROR_DOMAIN}
    return {"error": {"code": status, "message": message, "status": rpc, "details": [info]}}


def stream_error(status: int, code: str, message: str) -> bytes:
    """A ``data:`` chunk that is the error body (CRLF framing, as Gemini's streams)."""
    return sse_event(None, error_body(status, code, message), newline=b"\r\n")


#: ``models/{model}:{method}`` (or ``tunedModels/``) in a Gemini API path.
_MODEL_METHOD = re.compile(r"/(?:tuned)?[mM]odels/([^/:]+):([A-Za-z]+)$")
_OPERATIONS: Final = {
    "generateContent": "generate_content",
    "streamGenerateContent": "generate_content",
    "embedContent": "embeddings",
    "batchEmbedContents": "embeddings",
}


def operation(endpoint: str) -> str | None:
    """``generate_content`` or ``embeddings`` by the path's method, else None."""
    match = _MODEL_METHOD.search(endpoint)
    return _OPERATIONS.get(match[2]) if match else None


def resendable(endpoint: str, parameters: Mapping[str, Any]) -> bool:
    """A ``generateContent``, ``streamGenerateContent``, ``embedContent`` or
    ``batchEmbedContents`` call: its tools run on the caller's side, or read only
    (search grounding, code execution in a sandbox)."""
    del parameters
    return operation(endpoint) is not None


def request_model(endpoint: str, parameters: Mapping[str, Any]) -> str | None:
    """The model named in the path (``/v1beta/models/gemini-2.0-flash:generateContent``)."""
    del parameters
    match = _MODEL_METHOD.search(endpoint)
    return model_name(match[1]) if match else None


def response_model(data: Any) -> str | None:
    """``modelVersion`` of an answer or of one stream chunk."""
    return model_name(data.get("modelVersion")) if isinstance(data, dict) else None


def with_model(
    endpoint: str, parameters: Mapping[str, Any], model: str
) -> tuple[str, Mapping[str, Any]]:
    """``endpoint`` naming ``model`` in its path
    (``/v1beta/models/{model}:generateContent`` or ``:streamGenerateContent``, any
    method); an endpoint that names no model is kept. The body is kept as is."""
    match = _MODEL_METHOD.search(endpoint)
    if match is None:
        return endpoint, parameters
    return endpoint[: match.start(1)] + model + endpoint[match.end(1) :], parameters


DIALECT: Final = Dialect(
    name="gemini",
    usage=usage,
    stream_usage=stream_usage,
    output_cap=output_cap,
    prompt_keys=("contents", "systemInstruction", "tools"),
    # Explicit context caching: the cached contents' tokens are input not in the request.
    hidden_context_keys=("cachedContent",),
    stream_signal=stream_signal,
    usage_event=usage_event,
    error_hint=error_hint,
    error_body=error_body,
    stream_error=stream_error,
    credential_headers=("x-goog-api-key",),
    credential_query=("key",),
    marker_headers=("x-goog-api-key", "x-goog-api-client"),
    provider_name="gcp.gemini",
    price_provider="google",
    reasoning_outside_output=True,  # thoughtsTokenCount is outside candidatesTokenCount
    choices=choices,
    operation=operation,
    request_model=request_model,
    response_model=response_model,
    with_model=with_model,
    resendable=resendable,
)
