"""The one answer writer: what every API's answer becomes on the agent's connection
(design.md, "Package layout, round two"), written here and nowhere else.

:func:`gateway.api.http.handler` drives an API's :class:`~gateway.api.http.Exchange` and
hands what it describes, as data, to this module:

* a whole answer (:class:`~gateway.api.http.Answer`) becomes aiohttp's response
  (:func:`respond`), its headers (:func:`scrubbed`) and body scrubbed of the secrets the
  sidecar holds (:func:`gateway.redaction.scrub_bytes`); one larger than the transport
  takes at once, or behind an answer the agent has not taken yet, is written within the
  listener's body timeout (:func:`needs_bounded_write`, :func:`deliver`), else the
  connection is dropped (:func:`drop_connection`); one that does not reach the agent
  is said so to its call's audit records, held until then (:mod:`gateway.audit.held`);
* a relayed stream (:class:`Stream`, :class:`gateway.call.relay.Relay`) is opened at its
  first whole event, its head and first bytes in one write (:class:`RelayResponse`),
  each chunk framed by its exchange and scrubbed, and ended with its API's last bytes,
  or its connection dropped when the agent stopped reading.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from itertools import chain
from typing import TYPE_CHECKING, Final

from aiohttp import web

from gateway import redaction
from gateway.audit import get_logger, held
from gateway.call.intake import printable
from gateway.call.proxy import CORRELATION_ID_HEADER, TRACE_ID_HEADER
from gateway.call.relay import AgentGone

if TYPE_CHECKING:
    from gateway.api.http import Answer, Exchange, Headers
    from gateway.envelope import ExternalCallResponse

#: An answer up to this size is handed to the transport whole without waiting (asyncio's
#: and uvloop's default write high-water mark is 64 KiB); a larger one is written within
#: a bound (:func:`deliver`).
WRITE_BUFFERED_BYTES: Final = 64 * 1024
_log = get_logger("gateway.server")


def respond(answer: Answer) -> web.Response:
    """``answer`` as aiohttp's response, its headers and body scrubbed."""
    response = web.Response(
        status=answer.status,
        reason=answer.reason,
        body=redaction.scrub_bytes(answer.body),
        headers=scrubbed(answer.headers) if answer.headers else None,
        content_type=answer.content_type,
    )
    if answer.length is not None:  # set after the body, which resets it
        response.headers["Content-Length"] = answer.length
    return response


def scrubbed(headers: Headers) -> list[tuple[str, str]]:
    """``headers`` as pairs, each value scrubbed (:func:`gateway.redaction.scrub`) and any
    header whose name holds a secret's form left out (a name cannot be rewritten into a
    valid one): the one scrub of every answer head, streamed or not. The headers are
    scrubbed one by one only when their text, joined, holds a secret's form: a form inside
    one name or value is inside the whole, so a whole that scrubs to itself means that
    every one would (one scrub per answer instead of one per header)."""
    if isinstance(headers, list):  # the answer's own list (not kept by it): no copy
        pairs = headers
    else:
        pairs = list(headers.items()) if isinstance(headers, dict) else list(headers)
    joined = "\n".join(chain.from_iterable(pairs))  # name, value, name...: one join in C
    if redaction.scrub(joined) == joined:
        return pairs
    return [
        (name, redaction.scrub(value)) for name, value in pairs if redaction.scrub(name) == name
    ]


class RelayResponse(web.StreamResponse):
    """A relayed stream's answer whose head goes out with its first bytes, in one write:
    aiohttp's StreamResponse sends the head alone at ``prepare`` (one more write and one
    more wake-up of the agent before its first event). ``_send_headers_immediately`` is
    the switch aiohttp's own ``web.Response`` uses; were it gone, the head would again go
    out alone at ``prepare``, which is only slower."""

    _send_headers_immediately = False


class Stream:
    """A relayed stream (:class:`gateway.call.relay.Relay`) onto the agent's connection,
    framed by its exchange: opened at the first whole events with :meth:`Exchange.head`,
    each chunk written as :meth:`Exchange.frame` gives it, ended by :meth:`finish`. Every
    header and byte is scrubbed; a write to an agent that hung up raises AgentGone."""

    __slots__ = ("_exchange", "_request", "_response", "started")

    def __init__(self, request: web.Request, exchange: Exchange) -> None:
        self._request = request
        self._exchange = exchange
        self._response: RelayResponse | None = None
        self.started = False

    async def start(self) -> None:
        """Send the stream's head (its exchange's, scrubbed); a head line aiohttp's
        writer refuses is left out (:func:`_writable`). Raises AgentGone when the agent
        has hung up."""
        head = self._exchange.head()
        request = self._request
        headers = scrubbed(head.headers)
        self._response = RelayResponse(status=head.status, reason=head.reason, headers=headers)
        try:
            try:
                await self._response.prepare(request)
            except ValueError:  # refused before anything was sent: again without it
                reason, headers = _writable(request, head.reason, headers)
                self._response = RelayResponse(status=head.status, reason=reason, headers=headers)
                await self._response.prepare(request)
        except (ConnectionError, RuntimeError) as exc:
            raise AgentGone from exc
        self.started = True

    async def send(self, chunk: bytes) -> None:
        piece = self._exchange.frame(chunk)
        if piece:  # _write's body, inline: one coroutine less per relayed chunk
            response = self._response
            assert response is not None
            try:
                await response.write(redaction.scrub_bytes(piece))
            except (ConnectionError, RuntimeError) as exc:
                raise AgentGone from exc

    async def _write(self, piece: bytes) -> None:
        assert self._response is not None
        try:
            await self._response.write(redaction.scrub_bytes(piece))
        except (ConnectionError, RuntimeError) as exc:
            raise AgentGone from exc

    async def finish(self, status: int, response: ExternalCallResponse) -> web.StreamResponse:
        """End the stream with its exchange's last bytes, or drop the connection when the
        exchange says so. The agent may be gone by now: when last bytes (the envelope's
        final event, an error event) could not be written, the call's audit record says
        so (:func:`_undelivered`), unless the call itself ended on the agent going. An
        agent that had every event and left before the stream's close (an SDK that read
        ``[DONE]``, an MCP client its response) missed nothing."""
        assert self._response is not None
        last = self._exchange.end(status, response)
        if last is None:
            drop_connection(self._request)
            return self._response
        try:
            if last:
                await self._write(last)
        except AgentGone:
            error = response.error
            if error is None or error.details.get("reason") != held.AGENT_DISCONNECTED:
                _undelivered(self._request, self._response, held.AGENT_DISCONNECTED)
            return self._response
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self._response.write_eof()
        return self._response


def needs_bounded_write(request: web.Request, response: web.StreamResponse) -> bool:
    """Whether a whole answer not yet sent is to be written within the listener's body
    timeout (:func:`deliver`): when it is large, or when the agent has not taken an
    earlier answer yet; a small one is handed to the transport at once."""
    return (
        isinstance(response, web.Response)
        and not response.prepared
        and ((response.content_length or 0) > WRITE_BUFFERED_BYTES or _unsent(request))
    )


def _unsent(request: web.Request) -> bool:
    """Whether the agent has not yet taken an earlier answer on this connection (bytes
    still in the transport's buffer): even a small answer may then wait for the socket to
    drain (aiohttp's ``write_eof``), so it is written within the bound too."""
    transport = request.transport
    return transport is not None and transport.get_write_buffer_size() > 0


async def deliver(
    request: web.Request, response: web.StreamResponse, timeout_s: float
) -> web.StreamResponse:
    """Write ``response``, a whole answer not yet sent, now; when it does not reach the
    agent, say so to the request's held audit records (:mod:`gateway.audit.held`), so
    that its call's record says what the agent got.

    A large answer, or one behind an earlier answer the agent has not taken
    (:func:`needs_bounded_write`), is written within ``timeout_s`` (the calls app's
    ``body_timeout_s``: the time an agent has to send its body is the time it has to
    take its answer): an agent that stops reading would otherwise hold the handler, the
    answer's bytes and the connection for as long as it likes (aiohttp waits for the
    socket to drain without a bound). Past the bound the connection is dropped
    (``agent_stalled``). An agent that hung up before its answer was written is
    ``agent_disconnected``. Either is logged as ``answer_undelivered`` with the answer's
    ids. A head line aiohttp's writer refuses is left out (:func:`_writable`): returns
    the response written (another one, then)."""
    try:
        try:
            if needs_bounded_write(request, response):
                async with asyncio.timeout(timeout_s):
                    await response.prepare(request)
                    await response.write_eof()
            else:  # _write_whole's, inline: one coroutine less per answer
                await response.prepare(request)
                await response.write_eof()
        except ValueError:  # a head line aiohttp refuses, nothing sent: again without it
            response = _rewritten(request, response)
            await _write_whole(request, response, timeout_s)
    except TimeoutError:
        drop_connection(request)
        _undelivered(request, response, held.AGENT_STALLED, timeout_s=timeout_s)
    except ConnectionError:  # the agent hung up: aiohttp's own finish sees the closed transport
        _undelivered(request, response, held.AGENT_DISCONNECTED)
    return response


async def _write_whole(
    request: web.Request, response: web.StreamResponse, timeout_s: float
) -> None:
    if needs_bounded_write(request, response):
        async with asyncio.timeout(timeout_s):
            await response.prepare(request)
            await response.write_eof()
    else:
        await response.prepare(request)
        await response.write_eof()


def _rewritten(request: web.Request, response: web.StreamResponse) -> web.Response:
    """``response`` (a whole answer whose head aiohttp refused) without the lines it
    refuses (:func:`_writable`)."""
    reason, headers = _writable(request, response.reason, list(response.headers.items()))
    body = response.body if isinstance(response, web.Response) else None
    return web.Response(status=response.status, reason=reason, body=body, headers=headers)


#: What aiohttp's writer refuses in a head (its ``_serialize_headers``): a control
#: character other than HTAB (never valid in a field value or reason phrase, RFC 9110
#: section 5.5, RFC 9112 section 4).
_UNWRITABLE: Final = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def _writable(
    request: web.Request, reason: str | None, headers: list[tuple[str, str]]
) -> tuple[str | None, list[tuple[str, str]]]:
    """``(reason, headers)`` of a head aiohttp's writer refused, without what it refuses
    (a reason phrase so written: the status's own), each header left out named in the
    log (``answer_header_left_out``) and in the call's audit record (its warnings). The
    APIs pass back no such line (:func:`gateway.api.answers.passback_headers`): this is
    the writer's own guard, so that an answer is never lost to one."""
    kept: list[tuple[str, str]] = []
    names: list[str] = []
    for name, value in headers:
        if _UNWRITABLE.search(name) or _UNWRITABLE.search(value):
            names.append(printable(name)[:64])
        else:
            kept.append((name, value))
    if reason is not None and _UNWRITABLE.search(reason):
        reason = None
    _log.warning("answer_header_left_out", headers=names, path=request.rel_url.raw_path[:200])
    waiting = held.held()
    if waiting is not None:
        waiting.note(f"answer header lines left out, not writable: {', '.join(names)}")
    return reason, kept


def _undelivered(
    request: web.Request, response: web.StreamResponse, reason: str, **extra: float
) -> None:
    """Log that ``response`` did not reach the agent, for ``reason``, and mark the
    request's held audit records so."""
    waiting = held.held()
    trace_id = response.headers.get(TRACE_ID_HEADER)
    correlation_id = response.headers.get(CORRELATION_ID_HEADER)
    if waiting is not None:
        waiting.undelivered(reason)
        if trace_id is None:  # an envelope answer's ids are in its body: the record's
            trace_id, correlation_id = waiting.ids()
    _log.warning(
        "answer_undelivered",
        reason=reason,
        **extra,
        bytes=response.content_length,
        path=request.rel_url.raw_path[:200],
        trace_id=trace_id,
        correlation_id=correlation_id,
    )


def drop_connection(request: web.Request) -> None:
    """Drop the agent's connection now, unsent bytes and all: an agent that stopped
    reading would keep a closing connection (and its buffers) open as long as it likes."""
    if request.transport is not None:
        request.transport.abort()
