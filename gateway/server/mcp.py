"""MCP targets, HTTP side: ``ANY /mcp/{target}`` (design.md and README, "MCP targets").

An MCP client pointed at ``http://127.0.0.1:8181/mcp/github`` talks to the sidecar as if
it were the server (MCP streamable HTTP, 2025-11-25 and 2026-07-28). The call runs
through the same pipeline as an envelope (:meth:`Gateway.mcp`; the request and the tool
rules are :mod:`gateway.call.mcp`'s), and what the server answers goes back as it
answered: its status (a session's 404, a 401, a GET's 405 included, so that the client
reacts as it does against the server), headers (``Mcp-Session-Id`` among them; less
hop-by-hop ones) and body, except that a ``tools/list`` result lists only the tools the
policy allows. An ``text/event-stream`` answer is relayed event by event as it arrives
(server requests and progress notifications before the result, in order; the server's
event ids kept, so a client can resume with ``Last-Event-ID``).

What the sidecar says itself is JSON-RPC: an error object per request of the body
(:func:`gateway.providers.mcp.refusal_answer`), code :data:`gateway.providers.mcp.
EGRESS_ERROR` (or the JSON-RPC / MCP code of a body that is not JSON-RPC, -32700,
-32600, and of headers that do not match it, -32020) with ``data.egress_code``,
``data.retryable``, ``data.reason`` and, for a rule, ``data.rule``. A refused or failed
request is answered 200 (the error is the JSON-RPC answer, which every client version
reads); a body that is not JSON-RPC, mismatched headers, and a failed GET or DELETE (no
request to answer) get the HTTP status of the code, and so does a refused body of
notifications only (the MCP transport: input a server does not accept gets an HTTP
error status, with a JSON-RPC error of no id). A stream that fails mid-way, or ends
without the answer to a request (:func:`gateway.call.mcp.read_answer`), ends with an
error event for each request still unanswered; lines that are not SSE are not relayed.
A path under ``/mcp`` that is not this route (:meth:`McpRoute.unmatched`) is answered
as JSON-RPC too.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from typing import Any, Final

from aiohttp import web

from gateway import fastjson, redaction
from gateway.agents.identity import identify
from gateway.audit import get_logger
from gateway.call.mcp import McpRequest
from gateway.call.proxy import (
    egress_headers,
    id_headers,
    passback_headers,
    passback_reason,
    request_ids,
)
from gateway.call.record import CallContext
from gateway.call.relay import AgentGone
from gateway.call.sse import SseDecoder
from gateway.envelope import ExternalCallResponse
from gateway.errors import GatewayError, InternalError, InvalidPayload
from gateway.providers import mcp as rpc
from gateway.server.proxy import (
    EDGES_KEY,
    BodyReader,
    RelayResponse,
    answer_ids,
    edge_path,
    read_limited,
    scrubbed,
)
from gateway.server.runtime import Gateway

MCP_ROUTE: Final = "/mcp/{target}"
_log = get_logger("gateway.server")
#: One event of a relayed chunk (the relay hands in whole events): its text and its end.
_EVENT: Final = re.compile(rb"(.*?)(\r\n\r\n|\n\n|\r\r|\n\r\n|\r\n\n)", re.DOTALL)
_DATA_LINE: Final = re.compile(rb"^data(:.*)?$")
#: A line of SSE (WHATWG HTML, "Server-sent events"): a comment or a field the client
#: reads, after the byte order mark a stream may start with.
_SSE_LINE: Final = re.compile(rb"^(?:\xef\xbb\xbf)?(?::|(?:data|event|id|retry)(?::|$))")


class McpRoute:
    """The handler of :data:`MCP_ROUTE` for one :class:`Gateway`, reading bodies with the
    calls listener's own reader (the same limits as every route)."""

    def __init__(self, gateway: Gateway, read_body: BodyReader) -> None:
        self._gateway = gateway
        self._read_body = read_body

    async def handle(self, request: web.Request) -> web.StreamResponse:
        gateway = self._gateway
        policy = gateway.policy.policy
        identity = identify(request.transport, request.headers, gateway.agents)
        ctx = CallContext(time.monotonic(), identity.agent_id, identity=identity)
        try:
            body, refuse = await read_limited(
                self._read_body, request, policy.server.max_request_bytes
            )
            refuse = identity.refusal or refuse  # who calls is settled first
            http = McpRequest(
                method=request.method,
                target=request.match_info["target"],
                headers=tuple(request.headers.items()),
                body=body,
            )
            relay = _McpRelay(request, ctx)
            status, response = await gateway.mcp(http, ctx=ctx, refuse=refuse, relay=relay)
            if relay.started:
                return await relay.finish(response)
            return _answer(status, response, ctx)
        except GatewayError as exc:  # refused before the pipeline (not started, shut down)
            return self._refused(exc, ctx, request)
        except Exception:  # noqa: BLE001 - the answer must be JSON-RPC anyway
            _log.exception("mcp_handler_error")
            return self._refused(InternalError("the sidecar failed unexpectedly"), ctx, request)

    def install(self, app: web.Application) -> None:
        """Add :data:`MCP_ROUTE` to ``app``, and :meth:`unmatched` for the paths under
        ``/mcp`` it does not match (:func:`gateway.server.proxy.edge_errors`)."""
        app.router.add_route("*", MCP_ROUTE, self.handle)
        app.setdefault(EDGES_KEY, {})["/mcp"] = self.unmatched

    def unmatched(self, request: web.Request, status: int) -> web.Response:
        """The answer to a request under ``/mcp`` that :data:`MCP_ROUTE` does not match
        (``/mcp/{target}/x``, ``/mcp/``, ``CONNECT``): a JSON-RPC error (``id`` null,
        :data:`gateway.providers.mcp.EGRESS_ERROR`, ``data.egress_code``
        INVALID_PAYLOAD, ``data.reason: route``) with ``status`` (aiohttp's 404 or 405),
        audited, with the ``x-egress-*`` headers of every answer."""
        ctx = CallContext(started=time.monotonic(), agent_id=self._gateway.policy.policy.agent_id)
        exc = InvalidPayload(
            f"{request.method} {edge_path(request)[:200]}: no MCP endpoint here; an MCP "
            "client talks to /mcp/{target}, {target} an MCP target of the policy",
            details={"reason": "route", "http_status": status},
            http_status=status,
        )
        return self._refused(exc, ctx, request)

    def _refused(self, exc: GatewayError, ctx: CallContext, request: web.Request) -> web.Response:
        response = self._gateway.refused_early(
            exc,
            started=ctx.started,
            http_method=request.method,
            http_path=edge_path(request),
            api="mcp",
            identity=ctx.identity,
            ids=request_ids(request.headers),
        )
        return _rpc_error(exc.http_status, response, ctx)


def _answer(status: int, response: ExternalCallResponse, ctx: CallContext) -> web.Response:
    """The MCP server's own answer when there is one to give, else the sidecar's error."""
    answer = ctx.attempt_log.answer
    error = response.error
    if answer is not None and (
        error is None or (answer.status >= 400 and response.status_code == answer.status)
    ):
        headers = passback_headers(answer.headers)
        upstream = {k.lower(): v for k, v in headers}
        headers += [*answer_ids(response, ctx).items()]
        headers += egress_headers(error, upstream=upstream, status=answer.status).items()
        rewritten = ctx.mcp.body if ctx.mcp is not None else None
        return web.Response(
            status=answer.status,
            reason=passback_reason(answer.reason),
            body=redaction.scrub_bytes(rewritten if rewritten is not None else answer.body),
            headers=scrubbed(headers),
        )
    return _rpc_error(status, response, ctx)


def _error_data(response: ExternalCallResponse) -> tuple[int, str, dict[str, Any]]:
    """``(JSON-RPC code, message, data)`` of the sidecar's error answer."""
    error = response.error
    assert error is not None
    details = {k: v for k, v in error.details.items() if k not in ("jsonrpc_code", "http_status")}
    data: dict[str, Any] = {
        "egress_code": error.code.value,
        "retryable": error.retryable,
        **details,
    }
    if error.suggested_retry_after is not None:
        data["suggested_retry_after"] = error.suggested_retry_after
    code = error.details.get("jsonrpc_code", rpc.EGRESS_ERROR)
    return code, error.message, data


def _rpc_error(status: int, response: ExternalCallResponse, ctx: CallContext) -> web.Response:
    """The sidecar's own answer, as JSON-RPC (module docstring)."""
    code, message, data = _error_data(response)
    exchange = ctx.mcp
    body = None
    if exchange is not None:
        body = rpc.refusal_answer(
            exchange.messages, exchange.batch, code, message, data, exchange.refused
        )
    http_status = status
    if body is not None and code == rpc.EGRESS_ERROR:
        http_status = 200  # the JSON-RPC error is the answer to the request
    if body is None:
        body = rpc.error_object(None, code, message, data)
    assert response.error is not None
    headers = {**answer_ids(response, ctx), **egress_headers(response.error)}
    return web.Response(
        status=http_status,
        body=redaction.scrub_bytes(json.dumps(body).encode()),
        headers=headers,
        content_type="application/json",
    )


class _McpRelay:
    """The MCP server's event stream, relayed to the client (:class:`gateway.call.relay.
    Relay`) with the upstream's status and headers, whole events at a time: each event's
    JSON-RPC message is read (the outcome of a request, a ``tools/list`` filtered) and
    written back unchanged unless it was filtered."""

    def __init__(self, request: web.Request, ctx: CallContext) -> None:
        self._request = request
        self._ctx = ctx
        self._response: web.StreamResponse | None = None
        self.started = False

    async def start(self) -> None:
        answer = self._ctx.attempt_log.answer
        request = self._ctx.request
        ids = id_headers(request.trace_id, request.correlation_id) if request else {}
        headers = [*passback_headers(answer.headers), *ids.items()] if answer is not None else []
        status = answer.status if answer is not None else 200
        self._response = RelayResponse(status=status, headers=headers)
        try:
            await self._response.prepare(self._request)
        except (ConnectionError, RuntimeError) as exc:
            raise AgentGone from exc
        self.started = True

    async def send(self, chunk: bytes) -> None:
        exchange = self._ctx.mcp
        if exchange is not None:
            chunk = _read_events(exchange, chunk)
        await self._write(chunk)

    async def _write(self, piece: bytes) -> None:
        assert self._response is not None
        try:
            await self._response.write(redaction.scrub_bytes(piece))
        except (ConnectionError, RuntimeError) as exc:
            raise AgentGone from exc

    async def finish(self, response: ExternalCallResponse) -> web.StreamResponse:
        """End the stream; after a failure (cut, deadline, too large), an error event for
        each request of the body that got no response, so the client is not left waiting."""
        assert self._response is not None
        exchange = self._ctx.mcp
        with contextlib.suppress(AgentGone, ConnectionError, RuntimeError):
            error = response.error
            if error is not None and error.details.get("reason") != "agent_disconnected":
                code, message, data = _error_data(response)
                for m in exchange.requests if exchange is not None else ():
                    if m.id not in exchange.outcomes:  # type: ignore[union-attr]
                        event = rpc.error_object(m.id, code, message, data)
                        await self._write(
                            b"event: message\ndata: " + fastjson.compact(event) + b"\n\n"
                        )
            await self._response.write_eof()
        return self._response


def _read_events(exchange: rpc.McpExchange, chunk: bytes) -> bytes:
    """``chunk`` (whole events) with each event's message read by ``exchange``; an event
    whose message was filtered is written anew (its other lines kept), the rest as sent.
    Lines that are not SSE (neither a comment nor a ``data``, ``event``, ``id`` or
    ``retry`` field: an HTML error page, a proxy's text) are not relayed, and a block
    with none left is dropped: they are not events, and the client would read them as
    fields of the next one."""
    out = bytearray()
    end = 0
    for match in _EVENT.finditer(chunk):
        end = match.end()
        block = match.group(0)
        lines = match.group(1).splitlines()
        kept = [ln for ln in lines if _SSE_LINE.match(ln)]
        if not kept:
            continue
        if len(kept) != len(lines):
            block = b"\n".join(kept) + b"\n\n"
        decoder = SseDecoder(len(block) + 1)
        events = decoder.feed(block) + decoder.close()
        # JSON may start after spaces (SSE strips only one): the client reads it as JSON.
        if not events or events[-1].data.lstrip(" \t\r\n")[:1] not in ("{", "["):
            out += block
            continue
        try:
            value = json.loads(events[-1].data)
        except (ValueError, RecursionError):
            out += block
            continue
        value, changed = exchange.read(value)
        if not changed:
            out += block
            continue
        lines = [ln for ln in kept if not _DATA_LINE.match(ln)]
        lines.append(b"data: " + fastjson.compact(value))
        out += b"\n".join(lines) + b"\n\n"
    out += chunk[end:]
    return bytes(out)
