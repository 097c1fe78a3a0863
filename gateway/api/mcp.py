"""The MCP API: ``ANY /mcp/{target}`` (design.md, "MCP targets"; docs/api/mcp.md).

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
without the answer to a request (:func:`gateway.call.mcp.read_route_answer`), ends with
an error event for each request still unanswered; lines that are not SSE are not
relayed. A path under ``/mcp`` that is not this route (:func:`unmatched`) is answered as
JSON-RPC too. The answers are written by :mod:`gateway.api.http`.
"""

from __future__ import annotations

import json
import re
import time
from functools import partial
from typing import Any, Final, Protocol

from gateway import fastjson
from gateway.agents.identity import identify
from gateway.api import http
from gateway.api.answers import (
    answer_ids,
    egress_headers,
    id_headers,
    passback_headers,
    passback_reason,
)
from gateway.api.http import Answer, Head, Incoming
from gateway.call.mcp import McpRequest
from gateway.call.proxy import request_ids
from gateway.call.record import CallContext
from gateway.call.relay import Relay
from gateway.call.sse import SseDecoder
from gateway.envelope import ExternalCallResponse
from gateway.errors import GatewayError, InvalidPayload
from gateway.providers import mcp as rpc

MCP_ROUTE: Final = "/mcp/{target}"
#: The route family: a path under it that the route does not match is answered here too.
PREFIX: Final = "/mcp"
#: One event of a relayed chunk (the relay hands in whole events): its text and its end.
_EVENT: Final = re.compile(rb"(.*?)(\r\n\r\n|\n\n|\r\r|\n\r\n|\r\n\n)", re.DOTALL)
_DATA_LINE: Final = re.compile(rb"^data(:.*)?$")
#: A line of SSE (WHATWG HTML, "Server-sent events"): a comment or a field the client
#: reads, after the byte order mark a stream may start with.
_SSE_LINE: Final = re.compile(rb"^(?:\xef\xbb\xbf)?(?::|(?:data|event|id|retry)(?::|$))")


class Runtime(http.Sidecar, Protocol):
    """What the MCP API needs of the running sidecar (:class:`gateway.server.Gateway`)."""

    async def mcp(
        self,
        http: McpRequest,
        *,
        ctx: CallContext,
        refuse: GatewayError | None = None,
        relay: Relay | None = None,
    ) -> tuple[int, ExternalCallResponse]: ...


def handler(runtime: Runtime) -> http.Handler:
    """The handler of :data:`MCP_ROUTE` for ``runtime``."""
    return http.handler(partial(_Exchange, runtime), "mcp_handler_error")


def unmatched(runtime: Runtime) -> http.Unmatched:
    """The answer to a request under :data:`PREFIX` that :data:`MCP_ROUTE` does not match
    (``/mcp/{target}/x``, ``/mcp/``, ``CONNECT``): a JSON-RPC error (``id`` null,
    :data:`gateway.providers.mcp.EGRESS_ERROR`, ``data.egress_code`` INVALID_PAYLOAD,
    ``data.reason: route``) with the status aiohttp chose (404 or 405), audited, with the
    ``x-egress-*`` headers of every answer."""

    def answer(incoming: Incoming, status: int) -> Answer:
        exc = InvalidPayload(
            f"{incoming.method} {incoming.raw_path[:200]}: no MCP endpoint here; an MCP "
            "client talks to /mcp/{target}, {target} an MCP target of the policy",
            details={"reason": "route", "http_status": status},
            http_status=status,
        )
        return _Exchange(runtime, incoming).refused(exc)

    return answer


class _Exchange:
    """One MCP request (:class:`gateway.api.http.Exchange`). ``ctx`` is handed to the
    pipeline (the upstream's answer, ``ctx.mcp``); a relayed stream keeps the upstream's
    status and headers and is written whole events at a time, each event's JSON-RPC
    message read (the outcome of a request, a ``tools/list`` filtered) and written back
    unchanged unless it was filtered."""

    __slots__ = ("_identity", "_incoming", "_runtime", "ctx")

    streams = True

    def __init__(self, runtime: Runtime, incoming: Incoming) -> None:
        self._runtime = runtime
        self._incoming = incoming
        identity = self._identity = identify(incoming.transport, incoming.headers, runtime.agents)
        self.ctx = CallContext(time.monotonic(), identity.agent_id, identity=identity)

    @property
    def started(self) -> float:
        return self.ctx.started

    async def call(self, stream: Relay | None) -> tuple[int, ExternalCallResponse]:
        incoming = self._incoming
        limit = self._runtime.policy.policy.server.max_request_bytes
        body, refuse = await incoming.read_or_refusal(limit)
        refuse = self._identity.refusal or refuse  # who calls is settled first
        request = McpRequest(
            method=incoming.method,
            target=incoming.route["target"],
            headers=tuple(incoming.headers.items()),
            body=body,
        )
        return await self._runtime.mcp(request, ctx=self.ctx, refuse=refuse, relay=stream)

    def refused(self, exc: GatewayError) -> Answer:
        incoming = self._incoming
        response = self._runtime.refused_early(
            exc,
            started=self.ctx.started,
            http_method=incoming.method,
            http_path=incoming.raw_path,
            api="mcp",
            identity=self.ctx.identity,
            ids=request_ids(incoming.headers),
        )
        return _rpc_error(exc.http_status, response, self.ctx)

    def answer(self, status: int, response: ExternalCallResponse) -> Answer:
        """The MCP server's own answer when there is one to give, else the sidecar's error."""
        ctx = self.ctx
        answer = ctx.attempt_log.answer
        error = response.error
        if answer is None or (
            error is not None and (answer.status < 400 or response.status_code != answer.status)
        ):
            return _rpc_error(status, response, ctx)
        headers = passback_headers(answer.headers)
        upstream = {k.lower(): v for k, v in headers}
        headers += answer_ids(response, ctx)
        headers += egress_headers(error, upstream=upstream, status=answer.status).items()
        rewritten = ctx.mcp.body if ctx.mcp is not None else None
        return Answer(
            status=answer.status,
            reason=passback_reason(answer.reason),
            body=rewritten if rewritten is not None else answer.body,
            headers=headers,
        )

    def head(self) -> Head:
        answer = self.ctx.attempt_log.answer
        request = self.ctx.request
        ids = id_headers(request.trace_id, request.correlation_id) if request else []
        if answer is None:
            return Head(200, [])
        return Head(answer.status, [*passback_headers(answer.headers), *ids])

    def frame(self, chunk: bytes) -> bytes:
        exchange = self.ctx.mcp
        return _read_events(exchange, chunk) if exchange is not None else chunk

    def end(self, status: int, response: ExternalCallResponse) -> bytes:
        """After a failure (cut, deadline, too large), an error event for each request of
        the body that got no response, so the client is not left waiting."""
        error = response.error
        exchange = self.ctx.mcp
        if error is None or error.details.get("reason") == "agent_disconnected":
            return b""
        if exchange is None:
            return b""
        code, message, data = _error_data(response)
        return b"".join(
            b"event: message\ndata: "
            + fastjson.compact(rpc.error_object(m.id, code, message, data))
            + b"\n\n"
            for m in exchange.requests
            if m.id not in exchange.outcomes
        )


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


def _rpc_error(status: int, response: ExternalCallResponse, ctx: CallContext) -> Answer:
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
    headers = {**dict(answer_ids(response, ctx)), **egress_headers(response.error)}
    headers["Content-Type"] = "application/json"
    return Answer(status=http_status, body=json.dumps(body).encode(), headers=headers)


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
