"""The error of an upstream's answer that is not a success, by its status and what it says
beyond it (:func:`status_error`; docs/api/envelope.md): QUOTA_EXHAUSTED, CAPACITY_EXCEEDED,
DEPENDENCY_FAILED, PERMISSION_DENIED or UPSTREAM_REJECTED. Pure: the attempts
(:mod:`gateway.call.attempts`) classify each non-2xx answer with it, then decide whether
to retry.
"""

from __future__ import annotations

from typing import Any

from gateway.call.bodies import media_type, parse_body
from gateway.errors import (
    CapacityExceeded,
    DependencyFailed,
    GatewayError,
    PermissionDenied,
    QuotaExhausted,
    UpstreamRejected,
)
from gateway.providers import ErrorHint
from gateway.upstream import UpstreamResponse


def status_error(
    answer: UpstreamResponse,
    retry_after: float | None,
    target: str,
    hint: ErrorHint | None = None,
    parsed: tuple[Any, bool] | None = None,
) -> GatewayError:
    """The error for a non-2xx upstream answer (docs/api/envelope.md).

    ``hint`` is what the answer says beyond its status (:func:`gateway.providers.
    error_hint`): ``quota`` makes it QUOTA_EXHAUSTED whatever the status;
    ``no_retry`` (``x-should-retry: false``) makes it not retryable. ``parsed`` is
    ``parse_body``'s result when the caller already has it."""
    status = answer.status
    data, is_json = parsed or parse_body(answer.content_type, answer.body, status)
    described = f"{status} {answer.reason}".strip()
    if not is_json and answer.body:
        described += f" with a {media_type(answer.content_type) or 'untyped'} body (not JSON)"
    if not described.isascii():
        # A reason phrase or Content-Type of obs-text (bytes that are not UTF-8, which
        # aiohttp reads as surrogate escapes): escaped, or the message could not be JSON.
        described = described.encode("utf-8", "backslashreplace").decode("utf-8")
    details: dict[str, Any] = {"target": target, "upstream_status": status}
    common: dict[str, Any] = {"status_code": status, "data": data, "details": details}
    if hint is not None and hint.verdict is not None:
        details["upstream_reason"] = hint.reason
    if hint is not None and hint.verdict == "quota":
        details["source"] = "upstream"
        return QuotaExhausted(
            f"the upstream says the account is out of quota or credit ({hint.reason}): it "
            f"answered {described}. Retrying will not help until its quota resets or "
            "credit is added",
            retry_after_s=retry_after,
            **common,
        )
    if hint is not None and hint.verdict == "no_retry":
        common["retryable"] = False  # the upstream's explicit word beats the code's default
    if status == 429:
        details["source"] = "upstream"
        return CapacityExceeded(
            f"the upstream is rate limiting: it answered {described}",
            retry_after_s=retry_after,
            **common,
        )
    if status >= 500:
        return DependencyFailed(
            f"the upstream failed: it answered {described}", retry_after_s=retry_after, **common
        )
    if status in (401, 403):
        details["reason"] = "upstream_denied"
        return PermissionDenied(
            f"the upstream refused the credential or the operation: it answered {described}",
            **common,
        )
    if status < 200:
        return UpstreamRejected(
            f"the upstream answered {described}, a protocol switch the sidecar did not ask "
            "for (RFC 9110 section 15.2.2); the connection was dropped and nothing relayed",
            http_status=502,
            **common,
        )
    if status < 400:
        return UpstreamRejected(
            f"the upstream answered {described} (a redirect that was not followed)",
            http_status=502,
            **common,
        )
    return UpstreamRejected(f"the upstream rejected the request: it answered {described}", **common)
