"""The drop-in provider API: ``ANY /proxy/{target}/{path}`` (design.md, "Drop-in provider
routes"; docs/api/sdks.md).

An SDK pointed at ``http://127.0.0.1:8181/proxy/openai/v1`` (or ``/proxy/anthropic``...)
gets what the provider would have answered, written back unchanged: the upstream's
status, headers (less hop-by-hop ones, :func:`gateway.api.answers.passback_headers`) and
body, binary included; an event stream relayed as it arrives, whole events at a time. The
call itself runs through the same pipeline as an envelope (:meth:`Gateway.proxy`; the
request is built by :func:`gateway.call.proxy.proxy_intake`).

What the sidecar says itself comes in the provider's shape (:func:`gateway.providers.
drop_in_dialect`: the target's ``usage``, else the SDK's own headers, else OpenAI's), so
the SDK raises its usual exception class: a refusal is the provider's error body with
the HTTP status of the error code (docs/api/envelope.md) and the ``x-egress-*``
headers; a stream that fails or is cut mid-way ends with the provider's own error event,
never a clean end. Every answer carries ``x-egress-trace-id`` and
``x-egress-correlation-id``, the ids of its audit record. The answers are written by
:mod:`gateway.api.http`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from functools import partial
from typing import Final, Protocol

from gateway.agents.identity import identify
from gateway.api import http
from gateway.api.answers import (
    SERVED_BY_HEADER,
    answer_ids,
    egress_headers,
    id_headers,
    model_headers,
    passback_headers,
    passback_reason,
    replayed_body,
    served_by_value,
)
from gateway.api.http import Answer, Head, Incoming
from gateway.call.proxy import ProxyRequest, request_ids
from gateway.call.record import CallContext
from gateway.call.relay import AGENT_STALLED, Relay
from gateway.call.sse import EVENT_ENDS, complete_events
from gateway.envelope import ExternalCallResponse
from gateway.errors import GatewayError, IdempotencyConflict, InvalidPayload, error_response
from gateway.policy import PolicySet
from gateway.providers import DIALECTS, Dialect, drop_in_dialect

#: The route, for every method (``{path}`` may hold slashes and is read raw).
PROXY_ROUTE: Final = "/proxy/{target}/{path:.*}"
#: The route family: a path under it that the route does not match is answered here too.
PREFIX: Final = "/proxy"
#: Paths indexed for the router at most (:func:`shortcuts`): a resource each.
_MAX_SHORTCUTS: Final = 64
#: A relayed stream that failed this way needs no error event of ours: the upstream's own
#: error event was relayed (the SDK raises on it), or nobody is reading any more.
_ENDED_BY_ITSELF: Final = frozenset({"stream_error_event", "agent_disconnected"})


class Runtime(http.Sidecar, Protocol):
    """What the drop-in API needs of the running sidecar (:class:`gateway.server.Gateway`)."""

    async def proxy(
        self,
        http: ProxyRequest,
        *,
        ctx: CallContext,
        refuse: GatewayError | None = None,
        relay: Relay | None = None,
    ) -> tuple[int, ExternalCallResponse]: ...


def shortcuts(policy: PolicySet) -> list[str]:
    """The drop-in paths of ``policy``'s endpoints written without a wildcard
    (``/proxy/openai/v1/chat/completions``), for the router to index
    (:class:`gateway.api.http.TargetRoute`): at most :data:`_MAX_SHORTCUTS`, in the
    policy's order. Read once, when the application is built: a reloaded policy's new
    endpoints are matched as any path is, one look-up per segment."""
    paths = [
        f"{PREFIX}/{name}{rule.path.rstrip('/')}"
        for name, target in policy.targets.items()
        for rule in target.spec.endpoints or ()
        if "*" not in rule.path and target.spec.mcp is None and target.spec.database is None
    ]
    return paths[:_MAX_SHORTCUTS]


def handler(runtime: Runtime) -> http.Handler:
    """The handler of :data:`PROXY_ROUTE` for ``runtime``."""
    return http.handler(partial(_Exchange, runtime), "proxy_handler_error")


def unmatched(runtime: Runtime) -> http.Unmatched:
    """The answer to a request under :data:`PREFIX` that :data:`PROXY_ROUTE` does not match
    (no target or no path, ``/proxy//x``, ``CONNECT``): INVALID_PAYLOAD (``details.reason:
    route``) with the status aiohttp chose (404 or 405), audited, in the provider's error
    shape of the target its path names, else of the SDK's headers (OpenAI's by default),
    with the ``x-egress-*`` headers of every answer."""

    def answer(incoming: Incoming, status: int) -> Answer:
        exc = InvalidPayload(
            f"{incoming.method} {incoming.raw_path[:200]}: no drop-in route here; send the "
            "SDK's requests to /proxy/{target}/{path}, {target} a target of the policy",
            details={"reason": "route", "http_status": status},
            http_status=status,
        )
        return _Exchange(runtime, incoming).refused(exc)

    return answer


class _Exchange:
    """One drop-in request (:class:`gateway.api.http.Exchange`). ``ctx`` is handed to the
    pipeline, so that the upstream's own answer (``ctx.attempt_log.answer``) is written
    back; a relayed stream is written whole events at a time (a partial event waits for
    its end), so that a failure can always end it with one parseable error event."""

    __slots__ = ("_held", "_identity", "_incoming", "_runtime", "ctx")

    streams = True

    def __init__(self, runtime: Runtime, incoming: Incoming) -> None:
        self._runtime = runtime
        self._incoming = incoming
        identity = self._identity = identify(incoming.transport, incoming.headers, runtime.agents)
        self.ctx = CallContext(time.monotonic(), identity.agent_id, identity=identity)
        self._held = bytearray()

    @property
    def started(self) -> float:
        return self.ctx.started

    async def call(self, stream: Relay | None) -> tuple[int, ExternalCallResponse]:
        incoming = self._incoming
        limit = self._runtime.policy.policy.server.max_request_bytes
        body, refuse = await incoming.read_or_refusal(limit)
        refuse = self._identity.refusal or refuse  # who calls is settled first
        # The raw path: the endpoint is checked and sent percent-encoded as received.
        raw = incoming.raw_path.split("/", 3)  # "", "proxy", target, rest
        # By position, in the fields' order (method, target, path, query, headers, body):
        # by keyword, the named tuple's generated __new__ costs ~2,300-3,100 instructions more.
        request = ProxyRequest(
            incoming.method,
            incoming.route["target"],
            "/" + (raw[3] if len(raw) > 3 else ""),
            incoming.query,
            tuple(incoming.headers.items()),
            body,
        )
        return await self._runtime.proxy(request, ctx=self.ctx, refuse=refuse, relay=stream)

    def refused(self, exc: GatewayError) -> Answer:
        incoming = self._incoming
        response = self._runtime.refused_early(
            exc,
            started=self.ctx.started,
            http_method=incoming.method,
            http_path=incoming.raw_path,
            api="proxy",
            identity=self.ctx.identity,
            ids=request_ids(incoming.headers),
        )
        return _refusal(exc.http_status, response, self._dialect(), self.ctx)

    def _dialect(self) -> Dialect:
        """The error shape for this answer: the target's, also when the call was refused
        before the policy decision named it (a bad header, a body too large), else the
        SDK's headers' (their names read only then)."""
        incoming = self._incoming
        named = incoming.route.get("target") or incoming.named_target
        target = self.ctx.target or self._runtime.policy.targets.get(named)
        usage = target.spec.usage if target is not None else None
        if usage is not None and usage in DIALECTS:
            return DIALECTS[usage]  # what drop_in_dialect gives, whatever the headers
        return drop_in_dialect(usage, frozenset(k.lower() for k in incoming.headers))

    def answer(self, status: int, response: ExternalCallResponse) -> Answer:
        """The upstream's own answer when there is one to give, else the sidecar's refusal."""
        ctx = self.ctx
        method = self._incoming.method
        if ctx.replayed:
            return _replayed(status, response, ctx, self._dialect(), method)
        answer = ctx.attempt_log.answer
        error = response.error
        # An upstream error answer is passed on as the provider wrote it (its SDK reads its
        # codes), never a redirect: the SDK would follow it past the sidecar.
        if answer is None or (
            error is not None and (answer.status < 400 or response.status_code != answer.status)
        ):
            return _refusal(status, response, self._dialect(), ctx)
        headers = passback_headers(answer.headers)
        if error is None:  # no x-egress-* error headers, whatever the upstream said
            headers += answer_ids(response, ctx)
        else:
            upstream = {k.lower(): v for k, v in headers}
            headers += answer_ids(response, ctx)
            headers += egress_headers(error, upstream=upstream, status=answer.status).items()
        if ctx.model is not None:
            headers += model_headers(ctx)
        return Answer(
            status=answer.status,
            reason=passback_reason(answer.reason),
            body=answer.body,
            headers=headers,
            length=_head_length(answer.headers) if method == "HEAD" else None,
        )

    def head(self) -> Head:
        """The upstream's status and headers (the attempt whose stream this is); a stored
        stream replayed (idempotency) has its events, not its headers."""
        answer = self.ctx.attempt_log.answer
        request = self.ctx.request
        ids = id_headers(request.trace_id, request.correlation_id) if request else []
        if answer is not None:
            headers = [*passback_headers(answer.headers), *ids, *model_headers(self.ctx)]
            served = self.ctx.served_by
            if served is not None:  # the attempt whose stream this is
                headers.append((SERVED_BY_HEADER, served_by_value(served)))
            return Head(answer.status, headers, passback_reason(answer.reason))
        headers = [("Content-Type", "text/event-stream"), *ids]
        headers.append(("x-egress-replayed", "true"))
        return Head(200, headers)

    def frame(self, chunk: bytes) -> bytes:
        held = self._held
        if not held and chunk.endswith(EVENT_ENDS):
            return chunk  # whole events, what the relay hands in: no copy
        held += chunk
        whole = complete_events(held)
        if not whole:
            return b""
        piece = bytes(held[:whole])
        del held[:whole]
        return piece

    def end(self, status: int, response: ExternalCallResponse) -> bytes | None:
        """The rest of the stream when it was complete, else (in place of a partial event)
        the provider's error event saying what went wrong."""
        error = response.error
        if error is None:
            return bytes(self._held)
        reason = error.details.get("reason")
        if reason == AGENT_STALLED:
            return None  # it reads nothing: a last event would hang too
        if reason in _ENDED_BY_ITSELF:
            return b""
        return self._dialect().stream_error(status, error.code.value, error.message)


def _head_length(headers: Mapping[str, str]) -> str | None:
    """The ``Content-Length`` of a HEAD answer: that of the body a GET would get (RFC 9110
    sections 9.3.2 and 8.6), not of the empty one written here. None for a coded body: a
    GET here gets it decoded, of a length no one has said."""
    length = headers.get("Content-Length", "")
    coding = headers.get("Content-Encoding", "identity").strip().lower()
    return length if length.isdigit() and coding in ("", "identity") else None


def _replayed(
    status: int, response: ExternalCallResponse, ctx: CallContext, dialect: Dialect, method: str
) -> Answer:
    """A stored answer (idempotency replay), rebuilt from its envelope; a stored failure
    whose upstream status was not an error (a 101, a redirect not followed) was the
    sidecar's refusal the first time, and is again."""
    if response.error is not None and (response.status_code or 0) < 400:
        return _refusal(status, response, dialect, ctx, replayed=True)
    rebuilt = (None, b"") if method == "HEAD" else replayed_body(response, json=ctx.json_data)
    if rebuilt is None:
        refused = IdempotencyConflict(
            "this idempotency key's answer was a stream, already delivered; a stream is "
            "not replayed: use a new key for a new request",
            details={"reason": "stream_not_replayable"},
        )
        replay = error_response(refused, latency_ms=response.latency_ms)
        return _refusal(refused.http_status, replay, dialect, ctx)
    content_type, body = rebuilt
    headers = dict(answer_ids(response, ctx))
    headers.update(egress_headers(response.error))
    headers["x-egress-replayed"] = "true"
    if content_type is not None:
        headers["Content-Type"] = content_type
    return Answer(status=response.status_code or status, body=body, headers=headers)


def _refusal(
    status: int,
    response: ExternalCallResponse,
    dialect: Dialect,
    ctx: CallContext,
    *,
    replayed: bool = False,
) -> Answer:
    """The sidecar's own answer in the provider's error shape (``replayed``: a stored one)."""
    error = response.error
    assert error is not None
    body = json.dumps(dialect.error_body(status, error.code.value, error.message)).encode()
    headers = dict(answer_ids(response, ctx))
    headers.update(egress_headers(error))
    headers["Content-Type"] = "application/json"
    if replayed:
        headers["x-egress-replayed"] = "true"
    return Answer(status=status, body=body, headers=headers)
