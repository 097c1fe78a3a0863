"""The drop-in provider routes' HTTP side: ``ANY /proxy/{target}/{path}`` (design.md,
"Drop-in provider routes"; README, "Use it from your SDK").

An SDK pointed at ``http://127.0.0.1:8181/proxy/openai/v1`` (or ``/proxy/anthropic``...)
gets what the provider would have answered, written back unchanged: the upstream's
status, headers (less hop-by-hop ones, :func:`gateway.call.proxy.passback_headers`) and
body, binary included; an event stream relayed as it arrives, whole events at a time. The
call itself runs through the same pipeline as an envelope (:meth:`Gateway.proxy`).

What the sidecar says itself comes in the provider's shape (:func:`gateway.providers.
drop_in_dialect`: the target's ``usage``, else the SDK's own headers, else OpenAI's), so
the SDK raises its usual exception class: a refusal is the provider's error body with
the HTTP status of the error code (README, "Error codes") and the ``x-egress-*``
headers; a stream that fails or is cut mid-way ends with the provider's own error event,
never a clean end. Every answer carries ``x-egress-trace-id`` and
``x-egress-correlation-id``, the ids of its audit record.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from typing import Final
from urllib.parse import unquote

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter

from gateway import redaction
from gateway.agents.identity import identify
from gateway.audit import get_logger
from gateway.call.proxy import (
    CORRELATION_ID_HEADER,
    TRACE_ID_HEADER,
    ProxyRequest,
    egress_headers,
    id_headers,
    passback_headers,
    passback_reason,
    replayed_body,
    request_ids,
)
from gateway.call.record import CallContext
from gateway.call.relay import AGENT_STALLED, AgentGone
from gateway.call.sse import complete_events
from gateway.envelope import ExternalCallResponse
from gateway.errors import (
    GatewayError,
    IdempotencyConflict,
    InternalError,
    InvalidPayload,
    error_response,
)
from gateway.providers import DIALECTS, Dialect, drop_in_dialect
from gateway.server.runtime import Gateway

#: The route, for every method (``{path}`` may hold slashes and is read raw).
PROXY_ROUTE: Final = "/proxy/{target}/{path:.*}"
_log = get_logger("gateway.server")
#: A relayed stream that failed this way needs no error event of ours: the upstream's own
#: error event was relayed (the SDK raises on it), or nobody is reading any more.
_ENDED_BY_ITSELF: Final = frozenset({"stream_error_event", "agent_disconnected"})


#: Reads a request's body within the listener's limits (the app's: decoded from its
#: Content-Encoding, within the body timeout); raises the GatewayError that refuses it.
BodyReader = Callable[[web.Request, int], Awaitable[bytes]]


class ProxyRoute:
    """The handler of :data:`PROXY_ROUTE` for one :class:`Gateway`; ``read_body`` is the
    calls listener's own body reader, so both routes read bodies by the same rules."""

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
            http = _proxy_request(request, body)
            relay = _ProxyRelay(request, ctx)
            status, response = await gateway.proxy(http, ctx=ctx, refuse=refuse, relay=relay)
            dialect = self._dialect(ctx, request)
            if relay.started:
                return await relay.finish(status, response, dialect)
            return _answer(status, response, ctx, dialect, request.method)
        except GatewayError as exc:  # refused before the pipeline (not started, shut down)
            return self._refused(exc, ctx, request)
        except Exception:  # noqa: BLE001 - the answer must be the provider's shape anyway
            _log.exception("proxy_handler_error")
            error = InternalError("the sidecar failed unexpectedly")
            return self._refused(error, ctx, request)

    def install(self, app: web.Application) -> None:
        """Add :data:`PROXY_ROUTE` to ``app``, and :meth:`unmatched` for the paths under
        ``/proxy`` it does not match (:func:`edge_errors`)."""
        app.router.add_route("*", PROXY_ROUTE, self.handle)
        app.setdefault(EDGES_KEY, {})["/proxy"] = self.unmatched

    def unmatched(self, request: web.Request, status: int) -> web.Response:
        """The answer to a request under ``/proxy`` that :data:`PROXY_ROUTE` does not
        match (no target or no path, ``/proxy//x``, ``CONNECT``): INVALID_PAYLOAD
        (``details.reason: route``) with ``status`` (aiohttp's 404 or 405), audited, in
        the provider's error shape of the target its path names, else of the SDK's
        headers (OpenAI's by default), with the ``x-egress-*`` headers of every answer."""
        ctx = CallContext(started=time.monotonic(), agent_id=self._gateway.policy.policy.agent_id)
        exc = InvalidPayload(
            f"{request.method} {edge_path(request)[:200]}: no drop-in route here; send the "
            "SDK's requests to /proxy/{target}/{path}, {target} a target of the policy",
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
            api="proxy",
            identity=ctx.identity,
            ids=request_ids(request.headers),
        )
        return _refusal(exc.http_status, response, self._dialect(ctx, request), ctx)

    def _dialect(self, ctx: CallContext, request: web.Request) -> Dialect:
        """The error shape for this answer: the target's, also when the call was refused
        before the policy decision named it (a bad header, a body too large), else the
        SDK's headers' (their names read only then)."""
        named = request.match_info.get("target") or edge_target(request)
        target = ctx.target or self._gateway.policy.targets.get(named)
        usage = target.spec.usage if target is not None else None
        if usage is not None and usage in DIALECTS:
            return DIALECTS[usage]  # what drop_in_dialect gives, whatever the headers
        return drop_in_dialect(usage, frozenset(k.lower() for k in request.headers))


class RelayResponse(web.StreamResponse):
    """A relayed stream's answer whose head goes out with its first bytes, in one write:
    aiohttp's StreamResponse sends the head alone at ``prepare`` (one more write and one
    more wake-up of the agent before its first event). ``_send_headers_immediately`` is
    the switch aiohttp's own ``web.Response`` uses; were it gone, the head would again go
    out alone at ``prepare``, which is only slower.

    Every streamed answer of every route is one of these, and its head is scrubbed at
    ``prepare`` (:func:`scrubbed`), whatever was put in it and when: an upstream that
    echoes the credential in a header must not get it to the agent on a stream either."""

    _send_headers_immediately = False

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        head = list(self.headers.items())
        clean = scrubbed(head)
        if clean is not head:
            self.headers.clear()
            self.headers.extend(clean)
        return await super().prepare(request)


#: An answer up to this size is handed to the transport whole without waiting (asyncio's
#: and uvloop's default write high-water mark is 64 KiB); a larger one is written within
#: a bound (:func:`send_bounded`).
WRITE_BUFFERED_BYTES: Final = 64 * 1024


async def send_bounded(request: web.Request, response: web.Response, timeout_s: float) -> None:
    """Write ``response`` now, within ``timeout_s`` (the calls app's ``body_timeout_s``:
    the time an agent has to send its body is the time it has to take its answer). An agent that
    stops reading would otherwise hold the handler, the answer's bytes and the
    connection for as long as it likes: aiohttp waits for the socket to drain without a
    bound. Past the bound the connection is dropped and ``answer_undelivered`` logged
    with the answer's ids; the call's audit record was written before the answer, as
    always. A reset by the agent is left to aiohttp, which expects it."""
    try:
        async with asyncio.timeout(timeout_s):
            await response.prepare(request)
            await response.write_eof()
    except TimeoutError:
        _log.warning(
            "answer_undelivered",
            reason="agent_stalled",
            timeout_s=timeout_s,
            bytes=response.content_length,
            path=request.rel_url.raw_path[:200],
            trace_id=response.headers.get(TRACE_ID_HEADER),
            correlation_id=response.headers.get(CORRELATION_ID_HEADER),
        )
        drop_connection(request)
    except ConnectionError:
        pass  # the agent hung up: aiohttp's own finish sees the closed transport


def drop_connection(request: web.Request) -> None:
    """Drop the agent's connection now, unsent bytes and all: an agent that stopped
    reading would keep a closing connection (and its buffers) open as long as it likes."""
    if request.transport is not None:
        request.transport.abort()


def too_large(limit: int) -> InvalidPayload:
    return InvalidPayload(
        f"the request body is larger than this sidecar accepts ({limit} bytes, "
        "server.max_request_bytes in the policy)",
        details={"reason": "too_large", "limit_bytes": limit},
        http_status=413,
    )


def _proxy_request(request: web.Request, body: bytes) -> ProxyRequest:
    # The raw path: the endpoint is checked and sent percent-encoded as received.
    raw = request.rel_url.raw_path.split("/", 3)  # "", "proxy", target, rest
    return ProxyRequest(
        method=request.method,
        target=request.match_info["target"],
        path="/" + (raw[3] if len(raw) > 3 else ""),
        query=tuple(request.query.items()),
        headers=tuple(request.headers.items()),
        body=body,
    )


async def read_limited(
    read_body: BodyReader, request: web.Request, limit: int
) -> tuple[bytes, GatewayError | None]:
    """The request body (at most ``limit`` bytes), or ``b""`` and the refusal of it, which
    the route passes to the pipeline so that it is audited as the call."""
    if request.content_length is not None and request.content_length > limit:
        return b"", too_large(limit)
    try:
        return await read_body(request, limit), None
    except GatewayError as exc:
        return b"", exc


#: The answer to a request under a route family that none of its routes matched, given
#: the HTTP status aiohttp chose (404, 405).
Unmatched = Callable[[web.Request, int], web.Response]
#: Route family prefix -> its :data:`Unmatched` writer (the calls application only).
EDGES_KEY: Final = web.AppKey[dict[str, Unmatched]]("edges")


@web.middleware
async def edge_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Answer a request under a route family (``/proxy``, ``/mcp``) that none of its
    routes matched (aiohttp's 404 or 405) with that family's own writer (the calls
    application's :data:`EDGES_KEY`), in its shape; the path of a ``CONNECT`` (an
    authority to aiohttp) is its raw request target. Any other error goes on to the
    application's JSON errors."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        path = request.path or request.raw_path.partition("?")[0]
        for prefix, unmatched in request.app.get(EDGES_KEY, {}).items():
            if exc.status >= 400 and (path == prefix or path.startswith(prefix + "/")):
                answer = unmatched(request, exc.status)
                if "Allow" in exc.headers:  # a 405 must say what is allowed (RFC 9110)
                    answer.headers["Allow"] = exc.headers["Allow"]
                return answer
        raise


def edge_path(request: web.Request) -> str:
    """The request's path as sent (percent-encoding kept); for ``CONNECT``, whose target
    aiohttp reads as an authority (an empty path), the raw request target."""
    return request.rel_url.raw_path if request.path else request.raw_path


def edge_target(request: web.Request) -> str:
    """The target a path under ``/proxy/`` or ``/mcp/`` names (its second segment,
    percent-decoded), also when the route did not match it; "" for none."""
    path = request.path or request.raw_path.partition("?")[0]
    parts = path.split("/", 3)
    return unquote(parts[2]) if len(parts) > 2 else ""


def answer_ids(response: ExternalCallResponse, ctx: CallContext) -> dict[str, str]:
    """The id headers of an answer: the call's ids, else those the request claimed."""
    return id_headers(
        response.trace_id or ctx.claimed.get("trace_id"),
        response.correlation_id or ctx.claimed.get("correlation_id"),
    )


def _answer(
    status: int,
    response: ExternalCallResponse,
    ctx: CallContext,
    dialect: Dialect,
    method: str,
) -> web.Response:
    """The upstream's own answer when there is one to give, else the sidecar's refusal."""
    if ctx.replayed:
        return _replayed(status, response, ctx, dialect, method)
    answer = ctx.attempt_log.answer
    error = response.error
    # An upstream error answer is passed on as the provider wrote it (its SDK reads its
    # codes), never a redirect: the SDK would follow it past the sidecar.
    if answer is not None and (
        error is None or (answer.status >= 400 and response.status_code == answer.status)
    ):
        headers = passback_headers(answer.headers)
        egress = (  # none without an error, whatever the upstream said
            egress_headers(error, upstream={k.lower(): v for k, v in headers}, status=answer.status)
            if error is not None
            else {}
        )
        headers += [*answer_ids(response, ctx).items(), *egress.items()]
        passed = web.Response(
            status=answer.status,
            reason=passback_reason(answer.reason),
            body=redaction.scrub_bytes(answer.body),
            headers=scrubbed(headers),
        )
        length = answer.headers.get("Content-Length", "")
        coding = answer.headers.get("Content-Encoding", "identity").strip().lower()
        if method == "HEAD" and length.isdigit() and coding in ("", "identity"):
            # The length of the body a GET would get (RFC 9110 sections 9.3.2 and 8.6),
            # not of the empty one written here; set after the body, which resets it. Not
            # for a coded body: a GET here gets it decoded, of a length no one has said.
            passed.headers["Content-Length"] = length
        return passed
    return _refusal(status, response, dialect, ctx)


def scrubbed(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``headers`` with each value scrubbed (:func:`gateway.redaction.scrub`) and any
    header whose name holds a secret's form left out (a name cannot be rewritten into a
    valid one): the one scrub of every answer head the routes write, streamed or not.
    The headers are scrubbed one by one only when their text, joined, holds a secret's
    form: a form inside one name or value is inside the whole, so a whole that scrubs to
    itself means that every one would (one scrub per answer instead of one per header);
    then ``headers`` itself is returned."""
    joined = "\n".join(f"{name}\n{value}" for name, value in headers)
    if redaction.scrub(joined) == joined:
        return headers
    return [
        (name, redaction.scrub(value)) for name, value in headers if redaction.scrub(name) == name
    ]


def _replayed(
    status: int, response: ExternalCallResponse, ctx: CallContext, dialect: Dialect, method: str
) -> web.Response:
    """A stored answer (idempotency replay), rebuilt from its envelope; a stored failure
    whose upstream status was not an error (a 101, a redirect not followed) was the
    sidecar's refusal the first time (:func:`_answer`), and is again."""
    if response.error is not None and (response.status_code or 0) < 400:
        refusal = _refusal(status, response, dialect, ctx)
        refusal.headers["x-egress-replayed"] = "true"
        return refusal
    rebuilt = (None, b"") if method == "HEAD" else replayed_body(response)
    if rebuilt is None:
        refused = IdempotencyConflict(
            "this idempotency key's answer was a stream, already delivered; a stream is "
            "not replayed: use a new key for a new request",
            details={"reason": "stream_not_replayable"},
        )
        replay = error_response(refused, latency_ms=response.latency_ms)
        return _refusal(refused.http_status, replay, dialect, ctx)
    content_type, body = rebuilt
    headers = {
        **answer_ids(response, ctx),
        **egress_headers(response.error),
        "x-egress-replayed": "true",
    }
    if content_type is not None:
        headers["Content-Type"] = content_type
    return web.Response(
        status=response.status_code or status, body=redaction.scrub_bytes(body), headers=headers
    )


def _refusal(
    status: int, response: ExternalCallResponse, dialect: Dialect, ctx: CallContext
) -> web.Response:
    """The sidecar's own answer in the provider's error shape."""
    error = response.error
    assert error is not None
    body = json.dumps(dialect.error_body(status, error.code.value, error.message)).encode()
    headers = {**answer_ids(response, ctx), **egress_headers(error)}
    return web.Response(
        status=status,
        body=redaction.scrub_bytes(body),
        headers=headers,
        content_type="application/json",
    )


class _ProxyRelay:
    """The upstream's event stream, relayed to the SDK (:class:`gateway.call.relay.
    Relay`): opened at the first chunk with the upstream's status and headers, written
    whole events at a time (a partial event waits for its end), so that a failure can
    always end the stream with one parseable error event of the provider's."""

    def __init__(self, request: web.Request, ctx: CallContext) -> None:
        self._request = request
        self._ctx = ctx
        self._response: web.StreamResponse | None = None
        self._held = bytearray()
        self.started = False

    async def start(self) -> None:
        answer = self._ctx.attempt_log.answer  # the attempt whose stream this is
        request = self._ctx.request
        ids = id_headers(request.trace_id, request.correlation_id) if request else {}
        if answer is not None:
            headers = [*passback_headers(answer.headers), *ids.items()]
            status, reason = answer.status, passback_reason(answer.reason)
        else:  # a stored stream replayed (idempotency): its events, not its headers
            headers = [("Content-Type", "text/event-stream"), *ids.items()]
            headers.append(("x-egress-replayed", "true"))
            status, reason = 200, None
        self._response = RelayResponse(status=status, reason=reason, headers=headers)
        try:
            await self._response.prepare(self._request)
        except (ConnectionError, RuntimeError) as exc:
            raise AgentGone from exc
        self.started = True

    async def send(self, chunk: bytes) -> None:
        held = self._held
        held += chunk
        whole = complete_events(held)
        if not whole:
            return
        piece = bytes(held[:whole])
        del held[:whole]
        await self._write(piece)

    async def _write(self, piece: bytes) -> None:
        assert self._response is not None
        try:
            await self._response.write(redaction.scrub_bytes(piece))
        except (ConnectionError, RuntimeError) as exc:
            raise AgentGone from exc

    async def finish(
        self, status: int, response: ExternalCallResponse, dialect: Dialect
    ) -> web.StreamResponse:
        """End the relayed stream: the rest of it when it was complete, else (in place of
        a partial event) the provider's error event saying what went wrong."""
        assert self._response is not None
        error = response.error
        if error is not None and error.details.get("reason") == AGENT_STALLED:
            drop_connection(self._request)  # it reads nothing: a last event would hang too
            return self._response
        with contextlib.suppress(AgentGone, ConnectionError, RuntimeError):
            if error is None:
                if self._held:
                    await self._write(bytes(self._held))
            elif error.details.get("reason") not in _ENDED_BY_ITSELF:
                event = dialect.stream_error(status, error.code.value, error.message)
                await self._write(event)
            await self._response.write_eof()
        return self._response
