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
request to answer) get the HTTP status of the code. A stream that fails mid-way ends
with an error event for each request still unanswered.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from typing import Any, Final

from aiohttp import web

from gateway import fastjson, redaction
from gateway.api.http import Incoming, RelayResponse
from gateway.audit import get_logger
from gateway.call.mcp import McpRequest
from gateway.call.proxy import (
    answer_ids,
    egress_headers,
    id_headers,
    passback_headers,
    passback_reason,
)
from gateway.call.record import CallContext
from gateway.call.relay import AgentGone
from gateway.call.sse import SseDecoder
from gateway.envelope import ExternalCallResponse
from gateway.errors import GatewayError, InternalError
from gateway.providers import mcp as rpc
from gateway.server.runtime import Gateway

MCP_ROUTE: Final = "/mcp/{target}"
_log = get_logger("gateway.server")
#: One event of a relayed chunk (the relay hands in whole events): its text and its end.
_EVENT: Final = re.compile(rb"(.*?)(\r\n\r\n|\n\n|\r\r|\n\r\n|\r\n\n)", re.DOTALL)
_DATA_LINE: Final = re.compile(rb"^data(:.*)?$")


class McpRoute:
    """The handler of :data:`MCP_ROUTE` for one :class:`Gateway`, reading bodies with the
    calls listener's own reader (the same limits as every route)."""

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway

    async def handle(self, request: web.Request) -> web.StreamResponse:
        gateway = self._gateway
        policy = gateway.policy.policy
        ctx = CallContext(started=time.monotonic(), agent_id=policy.agent_id)
        try:
            body, refuse = await Incoming(request).read_or_refusal(policy.server.max_request_bytes)
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

    def _refused(self, exc: GatewayError, ctx: CallContext, request: web.Request) -> web.Response:
        response = self._gateway.refused_early(
            exc,
            started=ctx.started,
            http_method=request.method,
            http_path=request.rel_url.raw_path,
            api="mcp",
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
            headers=[(k, redaction.scrub(v)) for k, v in headers],
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
    whose message was filtered is written anew (its other lines kept), the rest as sent."""
    out = bytearray()
    end = 0
    for match in _EVENT.finditer(chunk):
        end = match.end()
        block = match.group(0)
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
        lines = [ln for ln in match.group(1).splitlines() if not _DATA_LINE.match(ln)]
        lines.append(b"data: " + fastjson.compact(value))
        out += b"\n".join(lines) + b"\n\n"
    out += chunk[end:]
    return bytes(out)
