"""aiohttp's client exceptions translated where they enter (the client's part).

:func:`translate` turns what a failed attempt raised into :class:`TransportError`
(``connect``, ``timeout`` or ``reset``, with ``sent`` and ``answered`` from the attempt),
the :class:`~gateway.errors.EgressDenied` the resolver raised for a denied address, or
:class:`~gateway.errors.DependencyFailed` (not retryable) for an answer aiohttp's parser
refuses. No message holds a URL query or a credential: only ``scheme://host:port``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import aiohttp

from gateway.errors import DependencyFailed
from gateway.policy.egress import origin_label
from gateway.upstream.resolver import _AddressDenied
from gateway.upstream.types import TransportError
from gateway.urls import URL

if TYPE_CHECKING:
    from gateway.upstream.client import _Attempt


def translate(exc: aiohttp.ClientError, url: URL, state: _Attempt, target: str) -> Exception:
    origin, sent, answered = origin_label(url), state.sent, state.answered
    if isinstance(exc, aiohttp.ClientConnectorError):
        cause = exc.os_error
        denied = cause if isinstance(cause, _AddressDenied) else cause.__cause__
        if isinstance(denied, _AddressDenied):
            return denied.denied
        if isinstance(exc, aiohttp.ClientConnectorDNSError):
            return TransportError("connect", sent=False, message=f"cannot resolve {url.host}")
        reason = cause.strerror or type(cause).__name__
        return TransportError(
            "connect", sent=False, message=f"cannot connect to {origin}: {reason}"
        )
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return TransportError("connect", sent=False, message=f"connecting to {origin} timed out")
    if isinstance(exc, aiohttp.ServerTimeoutError):
        return TransportError(
            "timeout",
            sent=sent,
            message=f"{origin} stopped answering (read timeout)",
            answered=answered,
        )
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return TransportError(
            "reset",
            sent=sent,
            message=f"{origin} closed the connection mid-call",
            answered=answered,
        )
    if isinstance(exc, aiohttp.ClientResponseError):
        # With raise_for_status off, only aiohttp's response parser raises this: a bad
        # status line, a NUL or bare CR in a header, a header line past 8190 bytes. The
        # same bytes would come back, so it is not retried; its text (the raw header,
        # perhaps an echoed key) is never shown.
        return DependencyFailed(
            f"{origin} answered with a response the HTTP client cannot parse (a malformed "
            "status line or header, or a header line longer than 8190 bytes); the request "
            "reached the upstream and was not resent",
            details={"reason": "malformed_response", "target": target},
            retryable=False,
        )
    if isinstance(exc, aiohttp.ClientOSError):
        return TransportError(
            "reset",
            sent=sent,
            message=f"connection to {origin} failed: {exc.strerror}",
            answered=answered,
        )
    return TransportError(
        "reset", sent=sent, message=f"{origin}: {type(exc).__name__}", answered=answered
    )
