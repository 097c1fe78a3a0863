"""The upstream's answer as the client reads it (aiohttp's response, the client's part).

:class:`UpstreamStream`: a 2xx event stream relayed as it arrives (read chunk by chunk,
closed at once when the agent hangs up). Beside it the helpers :class:`Upstream
<gateway.upstream.client.Upstream>` reads every answer with: :class:`CutStream` (a 2xx
stream whose connection broke mid-way, with what arrived), :func:`protocol_switch` (a
101, dropped unread), :func:`escaped` (a header value as writable text),
:func:`is_event_stream`, :func:`too_large` (the RESPONSE_TOO_LARGE of a body past
``server.max_response_bytes``), :func:`unreadable` (the DEPENDENCY_FAILED of a body whose
coding cannot be undone) and :func:`not_what_its_coding_says` (aiohttp failed to undo it).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import aiohttp
from aiohttp.http_exceptions import ContentEncodingError

from gateway.errors import DependencyFailed, ResponseTooLarge
from gateway.policy.egress import origin_label
from gateway.upstream.types import TransportError, UpstreamResponse
from gateway.urls import URL


class CutStream(Exception):
    """A 2xx event stream whose connection broke while it was read, or that fell silent
    for the idle bound (``idle``); ``body`` arrived."""

    def __init__(self, body: bytes, *, idle: bool = False) -> None:
        super().__init__("stream cut")
        self.body = body
        self.idle = idle


def protocol_switch(resp: aiohttp.ClientResponse, started: float) -> UpstreamResponse:
    """The answer to a 1xx that reached the caller, its body unread."""
    # Only a 101 gets here (aiohttp's parser skips the other 1xx, RFC 9110 15.2): a
    # protocol switch the sidecar never asks for. The connection no longer speaks HTTP,
    # so it is dropped unread (a body read would wait for the peer to close it); the
    # attempt judges the status.
    resp.close()
    return UpstreamResponse(
        status=resp.status,
        reason=resp.reason or "",
        headers=resp.headers,
        content_type=None,
        body=b"",
        elapsed_s=time.monotonic() - started,
    )


def escaped(value: str | None) -> str | None:
    """A header value as text that can be written as UTF-8: bytes that are not UTF-8
    (obs-text, read by aiohttp as surrogate escapes) as ``\\udcXX`` escapes."""
    if value is None or value.isascii():
        return value
    return value.encode("utf-8", "backslashreplace").decode("utf-8")


def is_event_stream(resp: aiohttp.ClientResponse) -> bool:
    """Whether ``resp``'s media type is ``text/event-stream`` (parameters, case and
    surrounding whitespace aside), read from the header as :mod:`email` reads it: not
    through ``resp.content_type``, whose parse (an email header parser) stays on the
    response, ~1.6 KiB for every stream while it is relayed."""
    raw = resp.headers.get("Content-Type")
    return raw is not None and raw.partition(";")[0].strip().lower() == "text/event-stream"


class UpstreamStream:
    """A 2xx event stream being read as it arrives (see :meth:`Upstream.send`).

    :meth:`read` returns the next chunk (as the network delivered it, decoded from gzip
    or deflate), ``b""`` at the end. It raises :class:`TransportError` (kind ``reset``)
    when the connection is lost mid-stream. :meth:`aclose` closes the connection at once
    (the agent hung up, or the stream failed) and is idempotent; a stream read to its
    end is released to the pool.
    """

    __slots__ = ("_done", "_eof", "_origin", "_resp")

    def __init__(self, resp: aiohttp.ClientResponse, origin: str, done: Callable[[], None]):
        self._resp: aiohttp.ClientResponse | None = resp
        self._origin = origin
        self._done = done
        self._eof = False

    async def read(self) -> bytes:
        resp = self._resp
        if resp is None:
            return b""
        try:
            chunk = await resp.content.readany()
        except aiohttp.ClientError as exc:
            if not_what_its_coding_says(exc):
                raise unreadable_answer(resp, self._origin) from None
            raise TransportError(
                "reset", sent=True, message=f"{self._origin} closed the stream mid-way"
            ) from exc
        if not chunk:
            self._eof = True
        return chunk

    async def aclose(self) -> None:
        resp, self._resp = self._resp, None
        if resp is None:
            return
        if self._eof:
            resp.release()
        else:
            resp.close()  # not read to its end: the connection cannot be reused
        self._done()


def not_what_its_coding_says(exc: aiohttp.ClientError) -> bool:
    """Whether ``exc`` (raised reading a body) is aiohttp failing to undo the body's
    ``Content-Encoding`` (labelled gzip and sent plain, a gzip stream that turns to
    garbage): the upstream's fault, the same on every resend, not a broken connection."""
    return isinstance(exc.__cause__, ContentEncodingError)


def unreadable_answer(resp: aiohttp.ClientResponse, url: URL | str) -> DependencyFailed:
    """:func:`unreadable` for ``resp``, by its ``Content-Encoding`` header(s)."""
    coding = ", ".join(resp.headers.getall("Content-Encoding", ()))
    return unreadable(url, coding, resp.status)


def unreadable(url: URL | str, coding: str, status: int) -> DependencyFailed:
    """The refusal of an answer whose ``Content-Encoding`` the sidecar cannot undo (or
    whose body is not what it says): it could not be scrubbed, so it is not passed on.
    Not retried: the upstream would send it coded the same way. ``url`` is the
    upstream's URL or its origin label."""
    origin = url if isinstance(url, str) else origin_label(url)
    return DependencyFailed(
        f"{origin} answered in a Content-Encoding the sidecar cannot decode "
        f"({coding[:64]!r}): its body cannot be scrubbed, so it is not passed on",
        details={"reason": "content_encoding", "content_encoding": coding[:64]},
        status_code=status,
        retryable=False,
    )


def too_large(url: URL, limit: int, status: int) -> ResponseTooLarge:
    return ResponseTooLarge(
        f"{origin_label(url)} answered with a body larger than the limit of {limit} bytes "
        "(server.max_response_bytes)",
        details={"limit_bytes": limit},
        status_code=status,
    )
