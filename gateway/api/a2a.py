"""The A2A API: ``/a2a/{target}`` (design.md, "Agents calling agents"; docs/api/a2a.md).

An A2A client pointed at ``http://127.0.0.1:8181/a2a/executor`` (the a2a-sdk's
``create_client`` with that URL, unchanged) talks to the sidecar as if it were the agent:
``GET /a2a/{target}/.well-known/agent-card.json`` (or ``agent.json``) is the agent's
card, fetched through the pipeline, checked (:mod:`gateway.agents.card`) and served with
every interface URL pointing back at ``/a2a/{target}`` on this sidecar, so that the
client's next requests come here; ``POST /a2a/{target}`` is a JSON-RPC request, run
through the pipeline (:meth:`Gateway.a2a`; the request, the method rules and the chain
are :mod:`gateway.call.a2a`'s). The agent's answer goes back as it answered (status,
headers less hop-by-hop ones, body); a task stream is relayed event by event as it
arrives, its events read for the task and context ids and the final event.

What the sidecar says itself is JSON-RPC: an error object for the request's id, code
:data:`gateway.providers.mcp.EGRESS_ERROR` (or -32700 / -32600 for a body that is not
one JSON-RPC request) with ``data.egress_code``, ``data.retryable`` and ``data.reason``;
answered 200 when the request had an id (the error is its answer), else with the HTTP
status of the code. A stream that fails, or ends before its final event, ends with an
error event for the request. The answers are written by :mod:`gateway.api.http`.
"""

from __future__ import annotations

import json
import time
from functools import partial
from typing import Any, Final, Protocol

from gateway import fastjson
from gateway.agents import card as cards
from gateway.agents.identity import identify, policy_identity
from gateway.api import http
from gateway.api.answers import (
    answer_ids,
    egress_headers,
    id_headers,
    passback_headers,
    passback_reason,
)
from gateway.api.http import Answer, Head, Incoming
from gateway.call.a2a import A2aRequest, CardFetch
from gateway.call.proxy import request_ids
from gateway.call.record import CallContext
from gateway.call.relay import Relay
from gateway.call.sse import SseDecoder
from gateway.envelope import ExternalCallResponse
from gateway.errors import GatewayError, InvalidPayload
from gateway.policy.a2a import CARD_PATHS
from gateway.policy.compiled import INBOUND_TARGET
from gateway.providers import a2a as rpc
from gateway.providers.mcp import error_object

A2A_ROUTE: Final = "/a2a/{target}"
#: Calls *to* this sidecar's agent: a reverse route to ``inbound.agent_url``.
INBOUND_ROUTE: Final = "/a2a/in/{path:.*}"
INBOUND_PREFIX: Final = "/a2a/in"
CARD_ROUTE: Final = "/a2a/{target}/.well-known/{card}"
PREFIX: Final = "/a2a"
_CARD_FILES: Final = {p.rsplit("/", 1)[1]: p for p in CARD_PATHS}


class Runtime(http.Sidecar, Protocol):
    """What the A2A API needs of the running sidecar (:class:`gateway.server.Gateway`)."""

    async def a2a(
        self,
        http: A2aRequest,
        *,
        ctx: CallContext,
        refuse: GatewayError | None = None,
        relay: Relay | None = None,
    ) -> tuple[int, ExternalCallResponse]: ...


def handler(runtime: Runtime) -> http.Handler:
    """The handler of :data:`A2A_ROUTE` and :data:`CARD_ROUTE` for ``runtime``."""
    return http.handler(partial(_Exchange, runtime), "a2a_handler_error")


def unmatched(runtime: Runtime) -> http.Unmatched:
    """The answer to a request under :data:`PREFIX` that no A2A route matches (``/a2a/``,
    ``/a2a/{target}/x``): a JSON-RPC error (``id`` null, ``data.egress_code``
    INVALID_PAYLOAD, ``data.reason: route``) with the status aiohttp chose, audited."""

    def answer(incoming: Incoming, status: int) -> Answer:
        exc = InvalidPayload(
            f"{incoming.method} {incoming.raw_path[:200]}: no A2A endpoint here; an A2A "
            "client talks to /a2a/{target}, {target} an A2A target of the policy",
            details={"reason": "route", "http_status": status},
            http_status=status,
        )
        return _Exchange(runtime, incoming).refused(exc)

    return answer


def inbound_handler(runtime: Runtime) -> http.Handler:
    """The handler of :data:`INBOUND_ROUTE`: a call to this sidecar's agent, from another
    agent's sidecar, forwarded to the agent's own A2A server (``inbound.agent_url``) once
    its chain is admitted (:func:`gateway.agents.chain.admit`) and remembered for the
    agent's own calls in that trace, task and context (docs/api/a2a.md)."""
    return http.handler(partial(_Exchange, runtime, inbound=True), "a2a_handler_error")


class _Exchange:
    """One A2A request (:class:`gateway.api.http.Exchange`)."""

    __slots__ = ("_identity", "_inbound", "_incoming", "_runtime", "ctx")

    streams = True

    def __init__(self, runtime: Runtime, incoming: Incoming, *, inbound: bool = False) -> None:
        self._runtime = runtime
        self._incoming = incoming
        self._inbound = inbound
        # An inbound call comes from another agent's sidecar: the agent called is this
        # sidecar's own (the policy's agent_id), whoever the peer is.
        identity = self._identity = (
            policy_identity(runtime.policy.policy.agent_id)
            if inbound
            else identify(incoming.transport, incoming.headers, runtime.agents)
        )
        self.ctx = CallContext(time.monotonic(), identity.agent_id, identity=identity)

    @property
    def started(self) -> float:
        return self.ctx.started

    async def call(self, stream: Relay | None) -> tuple[int, ExternalCallResponse]:
        incoming = self._incoming
        limit = self._runtime.policy.policy.server.max_request_bytes
        body, refuse = await incoming.read_or_refusal(limit)
        refuse = self._identity.refusal or refuse  # who calls is settled first
        card = incoming.route.get("card")
        if self._inbound:
            target, card = INBOUND_TARGET, incoming.raw_path[len(INBOUND_PREFIX) :] or "/"
        else:
            target = incoming.route["target"]
            card = _CARD_FILES.get(card, "/.well-known/" + card) if card is not None else ""
        request = A2aRequest(
            method=incoming.method,
            target=target,
            card=card,
            headers=tuple(incoming.headers.items()),
            body=body,
            inbound=self._inbound,
        )
        return await self._runtime.a2a(request, ctx=self.ctx, refuse=refuse, relay=stream)

    def refused(self, exc: GatewayError) -> Answer:
        incoming = self._incoming
        response = self._runtime.refused_early(
            exc,
            started=self.ctx.started,
            http_method=incoming.method,
            http_path=incoming.raw_path,
            api="a2a",
            identity=self.ctx.identity,
            ids=request_ids(incoming.headers),
        )
        return _rpc_error(exc.http_status, response, self.ctx)

    def answer(self, status: int, response: ExternalCallResponse) -> Answer:
        """The agent's own answer when there is one to give, else the sidecar's error; a
        card as :func:`gateway.agents.card.served` rewrites it."""
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
        body = self._card(answer.body, answer.status)
        if body is not answer.body:
            headers = [(k, v) for k, v in headers if k.lower() not in ("etag", "content-type")]
            headers.append(("Content-Type", "application/json"))
        return Answer(
            status=answer.status, reason=passback_reason(answer.reason), body=body, headers=headers
        )

    def _card(self, body: bytes, status: int) -> bytes:
        """``body`` as given to the client: a card pointing at this sidecar's route (the
        A2A route's, checked; the inbound route's, under its agent's own URL), else as
        the agent sent it."""
        fetched = self.ctx.a2a
        host = f"http://{self._incoming.headers.get('Host', '127.0.0.1')}"
        if isinstance(fetched, CardFetch) and fetched.card is not None:
            return fastjson.compact(cards.served(fetched.card, f"{host}/a2a/{fetched.target}"))
        inbound = self._runtime.policy.policy.inbound
        path = self._incoming.raw_path[len(INBOUND_PREFIX) :]
        if not self._inbound or fetched is not None or inbound is None or status != 200:
            return body
        if path not in CARD_PATHS:
            return body
        try:
            card = json.loads(body)
        except (ValueError, RecursionError):
            return body
        if not isinstance(card, dict):
            return body
        return fastjson.compact(cards.rebased(card, inbound.agent_url, host + INBOUND_PREFIX))

    def head(self) -> Head:
        answer = self.ctx.attempt_log.answer
        request = self.ctx.request
        ids = id_headers(request.trace_id, request.correlation_id) if request else []
        if answer is None:
            return Head(200, [])
        return Head(answer.status, [*passback_headers(answer.headers), *ids])

    def frame(self, chunk: bytes) -> bytes:
        """The chunk as it came; each event's JSON-RPC answer read (ids, final event)."""
        exchange = self.ctx.a2a
        if isinstance(exchange, rpc.A2aExchange):
            decoder = SseDecoder(len(chunk) + 1)
            for event in decoder.feed(chunk) + decoder.close():
                try:
                    exchange.read(json.loads(event.data))
                except (ValueError, RecursionError):
                    continue
        return chunk

    def end(self, status: int, response: ExternalCallResponse) -> bytes:
        """After a failure (cut, deadline, no final event), an error event for the
        request, so that the client raises instead of waiting."""
        error = response.error
        if error is None or error.details.get("reason") == "agent_disconnected":
            return b""
        exchange = self.ctx.a2a
        ident = exchange.id if isinstance(exchange, rpc.A2aExchange) else None
        code, message, data = _error_data(response)
        return b"data: " + fastjson.compact(error_object(ident, code, message, data)) + b"\n\n"


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
    return error.details.get("jsonrpc_code", rpc.EGRESS_ERROR), error.message, data


def _rpc_error(status: int, response: ExternalCallResponse, ctx: CallContext) -> Answer:
    """The sidecar's own answer, as JSON-RPC (module docstring)."""
    code, message, data = _error_data(response)
    exchange = ctx.a2a
    ident = exchange.id if isinstance(exchange, rpc.A2aExchange) else None
    http_status = 200 if ident is not None else status
    assert response.error is not None
    headers = {**dict(answer_ids(response, ctx)), **egress_headers(response.error)}
    headers["Content-Type"] = "application/json"
    body = json.dumps(error_object(ident, code, message, data)).encode()
    return Answer(status=http_status, body=body, headers=headers)
