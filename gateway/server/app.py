"""The HTTP face of the sidecar: the aiohttp.web application, its listeners and routes
(the drop-in and MCP routes' handlers in :mod:`gateway.server.proxy` and
:mod:`gateway.server.mcp`, the other owners of aiohttp.web).

Routes of the calls listener (loopback by default):

* ``POST /v1/calls``: body an ExternalCallRequest; the answer is always an
  ExternalCallResponse JSON, whatever happened, with an HTTP status that mirrors the
  outcome (README, "Error codes").
* ``ANY /proxy/{target}/{path}``: a provider SDK's own request, the same call as an
  envelope, answered as the provider would (:mod:`gateway.server.proxy`).
* ``ANY /mcp/{target}``: an MCP client's streamable HTTP, its tool calls checked by the
  target's ``mcp`` rules (:mod:`gateway.server.mcp`).
* ``GET /healthz`` (process alive) and ``GET /readyz`` (ready to forward).
* ``GET /openapi.json``: this API as an OpenAPI 3.1 document (both listeners).

The ops listener (``server.ops_host``/``ops_port``) serves only ``/healthz``, ``/readyz``,
``/metrics`` and ``/openapi.json`` so probes and scrapers can reach it without exposing
the calls API.
Any other path or method gets a JSON error answer too, never an HTML page (under
``/proxy`` and ``/mcp`` in that route's shape: :func:`gateway.server.proxy.edge_errors`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Final

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError

from gateway import openapi, redaction
from gateway.audit import get_logger
from gateway.call.idempotent import rendered
from gateway.call.relay import AGENT_STALLED, AgentGone
from gateway.envelope import ExternalCallResponse
from gateway.errors import GatewayError, InternalError, InvalidPayload
from gateway.server.eventloop import loop_name
from gateway.server.mcp import McpRoute
from gateway.server.proxy import (
    WRITE_BUFFERED_BYTES,
    ProxyRoute,
    RelayResponse,
    drop_connection,
    edge_errors,
    send_bounded,
)
from gateway.server.reload import PolicyWatcher
from gateway.server.runtime import Gateway

GATEWAY_KEY: Final = web.AppKey("gateway", Gateway)
#: Set on the calls application: its refusals are audited (the ops listener's are not).
AUDITED_KEY: Final = web.AppKey("audited", bool)
CALLS_PATH: Final = "/v1/calls"
#: Slow and idle clients (README, "Running it"). aiohttp closes a connection that has
#: been idle this long: from its opening, and again from each answer, until a request's
#: headers are complete. So it bounds slow headers as well as idle keep-alive.
KEEPALIVE_TIMEOUT_S: Final = 75.0
#: The whole envelope must arrive within this long of its headers, or the answer is 408
#: (INVALID_PAYLOAD, ``details.reason: body_timeout``) and the connection is closed.
BODY_TIMEOUT_S: Final = 30.0
BODY_TIMEOUT_KEY: Final = web.AppKey("body_timeout_s", float)
#: After an answer sent before its body was read whole (413, 404, 408...), aiohttp reads
#: and drops what more of the body comes for at most this long, so that the agent gets
#: the answer rather than a reset, then closes (aiohttp's default, made explicit).
LINGERING_TIME_S: Final = 10.0
#: The Content-Encodings of an envelope that aiohttp decodes before the handler reads it
#: (its ``http_parser``: one coding, ASCII, any case). ``br`` and ``zstd`` need the
#: optional Brotli and backports.zstd packages; without them aiohttp's parser refuses
#: the request itself (400, text) before any handler runs.
_DECODED_ENCODINGS: Final = frozenset({"gzip", "deflate", "br", "zstd"})
_log = get_logger("gateway.server")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json_answer(status: int, response: ExternalCallResponse) -> web.Response:
    # An answer just stored for its idempotency key was written as JSON for the store:
    # the same bytes, not a second serialisation.
    raw = rendered(response)
    if raw is None:
        try:
            raw = response.model_dump_json().encode()
        except ValueError as exc:  # the pipeline rules this out; if not, still an envelope
            _log.error("answer_not_writable", error=str(exc)[:200], trace_id=response.trace_id)
            note = {"content_type": None, "text": "the answer's data could not be written as JSON"}
            raw = response.model_copy(update={"data": note}).model_dump_json().encode()
    body = redaction.scrub_bytes(raw)
    return web.Response(status=status, body=body, content_type="application/json")


def _error_answer(exc: GatewayError, started: float, request: web.Request) -> web.Response:
    """The answer to a request refused here, before the pipeline (which audits its own
    answers): on the calls listener it gets its one audit record."""
    response = request.app[GATEWAY_KEY].refused_early(
        exc,
        started=started,
        http_method=request.method,
        http_path=request.rel_url.raw_path,
        audited=request.app.get(AUDITED_KEY, False),
    )
    return _json_answer(exc.http_status, response)


@web.middleware
async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn aiohttp's own HTTP errors (404, 405, 413...) into JSON answers; write a large
    answer within ``body_timeout_s`` (:func:`gateway.server.proxy.send_bounded`)."""
    started = time.monotonic()
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code_exc: GatewayError = InvalidPayload(
            f"{request.method} {request.path}: {exc.reason}; the sidecar serves "
            f"POST {CALLS_PATH}, GET /healthz, GET /readyz, GET /metrics and GET /openapi.json",
            details={"reason": "route", "http_status": exc.status},
            http_status=exc.status,
        )
        answer = _error_answer(code_exc, started, request)
        if "Allow" in exc.headers:  # a 405 must say what is allowed (RFC 9110, 15.5.6)
            answer.headers["Allow"] = exc.headers["Allow"]
        return answer
    if (
        isinstance(response, web.Response)
        and not response.prepared
        and ((response.content_length or 0) > WRITE_BUFFERED_BYTES or _unsent(request))
    ):
        await send_bounded(request, response, request.app.get(BODY_TIMEOUT_KEY, BODY_TIMEOUT_S))
    return response


def _unsent(request: web.Request) -> bool:
    """Whether the agent has not yet taken an earlier answer on this connection (bytes
    still in the transport's buffer): even a small answer may then wait for the socket to
    drain (aiohttp's ``write_eof``), so it is written within the bound too."""
    transport = request.transport
    return transport is not None and transport.get_write_buffer_size() > 0


async def _calls(request: web.Request) -> web.StreamResponse:
    started = time.monotonic()
    gateway = request.app[GATEWAY_KEY]
    limit = gateway.policy.policy.server.max_request_bytes
    try:
        if request.content_length is not None and request.content_length > limit:
            raise _too_large(request.content_length, limit)
        body = await _read_body(request, limit)
        relay = _SseRelay(request) if _wants_stream(request) else None
        status, response = await gateway.call(body, relay=relay)
    except GatewayError as exc:
        return _error_answer(exc, started, request)
    except Exception:  # noqa: BLE001 - the answer must be JSON whatever broke
        _log.exception("handler_error")
        return _error_answer(InternalError("the sidecar failed unexpectedly"), started, request)
    if relay is not None and relay.started:
        return await relay.finish(response)
    return _json_answer(status, response)


def _wants_stream(request: web.Request) -> bool:
    """``Accept: text/event-stream`` (design.md, "Streaming to the agent")."""
    return "text/event-stream" in request.headers.get("Accept", "")


class _SseRelay:
    """The agent's ``200 text/event-stream`` answer, opened at the first upstream chunk
    (:class:`gateway.call.relay.Relay`); ends with one ``event: egress.response`` whose
    data is the ExternalCallResponse (``data`` null: the agent has had the events)."""

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self._response = RelayResponse(
            status=200,
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
        )
        self.started = False

    async def start(self) -> None:
        try:
            await self._response.prepare(self._request)
        except (ConnectionError, RuntimeError) as exc:
            raise AgentGone from exc
        self.started = True

    async def send(self, chunk: bytes) -> None:
        # The answer's bytes are the upstream's, scrubbed like every answer we write.
        try:
            await self._response.write(redaction.scrub_bytes(chunk))
        except (ConnectionError, RuntimeError) as exc:
            raise AgentGone from exc

    async def finish(self, response: ExternalCallResponse) -> web.StreamResponse:
        if response.error is not None and response.error.details.get("reason") == AGENT_STALLED:
            drop_connection(self._request)  # it reads nothing: the final event would hang
            return self._response
        final = response.model_copy(update={"data": None}).model_dump_json().encode()
        with contextlib.suppress(ConnectionError, RuntimeError):  # the agent may be gone
            await self._response.write(
                b"event: egress.response\ndata: " + redaction.scrub_bytes(final) + b"\n\n"
            )
            await self._response.write_eof()
        return self._response


async def _read_body(request: web.Request, limit: int) -> bytes:
    """The envelope's bytes, as aiohttp decoded them from their Content-Encoding, read
    within the app's body timeout.

    Raises :class:`InvalidPayload`: 413 past ``limit`` bytes (decoded); 415 for a
    Content-Encoding aiohttp does not decode (``details.reason: content_encoding``);
    400 for a body that is not what its Content-Encoding says (same reason) or whose
    framing broke part-way (``framing``: a bad chunk or a connection closed early); 408
    when it does not arrive in time (``body_timeout``). After any of these but the first
    the connection is closed once the answer is sent: what follows on it cannot be
    trusted to start a request.
    """
    encodings = request.headers.getall("Content-Encoding", [])
    if not _decoded(encodings):
        _close_after_answer(request)
        raise InvalidPayload(
            f"Content-Encoding {', '.join(encodings)!r} is not supported: send the "
            "envelope as is, or encoded with one of gzip or deflate",
            details={
                "reason": "content_encoding",
                "content_encoding": ", ".join(encodings)[:128],
                "supported": ["identity", "gzip", "deflate"],
            },
            http_status=415,
        )
    timeout_s = request.app.get(BODY_TIMEOUT_KEY, BODY_TIMEOUT_S)
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(None, limit) from None
    except TimeoutError:
        _close_after_answer(request)
        raise InvalidPayload(
            f"the envelope did not arrive within {timeout_s:g} s of its headers; "
            "send the whole body at once",
            details={"reason": "body_timeout", "timeout_s": timeout_s},
            http_status=408,
        ) from None
    except web.RequestPayloadError as exc:
        _close_after_answer(request)
        if isinstance(exc.__cause__, ContentEncodingError):
            raise InvalidPayload(
                f"the body is not {', '.join(encodings)}-encoded data, as its "
                "Content-Encoding says; send it as is, without the header, or encode it",
                details={"reason": "content_encoding", "content_encoding": encodings[0]},
            ) from None
        raise InvalidPayload(
            "the request body could not be read: its framing broke part-way "
            "(Transfer-Encoding chunks or Content-Length)",
            details={"reason": "framing"},
        ) from None
    except ConnectionError:  # the agent hung up part-way: nobody reads this answer
        raise InvalidPayload(
            "the connection closed before the whole envelope arrived",
            details={"reason": "framing"},
        ) from None


def _decoded(encodings: list[str]) -> bool:
    """True if aiohttp has decoded a body sent with these Content-Encoding values (or
    there is nothing to decode: none, empty, or ``identity``)."""
    if not encodings:
        return True
    if len(encodings) > 1:
        return False
    encoding = encodings[0]
    return encoding.isascii() and encoding.lower() in _DECODED_ENCODINGS | {"", "identity"}


_CLOSE_KEY: Final = web.RequestKey("close_after_answer", bool)


def _close_after_answer(request: web.Request) -> None:
    request[_CLOSE_KEY] = True


async def _close_if_asked(request: web.Request, response: web.StreamResponse) -> None:
    """Send ``Connection: close`` and close after this answer, when its request's body
    could not be read whole: nothing more on that connection is read as a request."""
    if request.get(_CLOSE_KEY):
        response.force_close()
        # This hook runs after aiohttp has chosen the headers, before it writes them.
        response.headers["Connection"] = "close"


def _too_large(size: int | None, limit: int) -> InvalidPayload:
    said = f"{size} bytes" if size is not None else "larger than the limit"
    return InvalidPayload(
        f"the envelope is {said}; this sidecar accepts at most {limit} bytes "
        "(server.max_request_bytes in the policy)",
        details={"reason": "too_large", "limit_bytes": limit},
        http_status=413,
    )


async def _healthz(_: web.Request) -> web.Response:
    return web.json_response({"status": "alive"})


async def _metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[GATEWAY_KEY].metrics.render(request.headers.get("Accept"))
    resp = web.Response(body=body)
    resp.headers["Content-Type"] = content_type
    return resp


async def _openapi(_: web.Request) -> web.Response:
    return web.Response(body=openapi.document_bytes(), content_type="application/json")


async def _readyz(request: web.Request) -> web.Response:
    ready, checks = request.app[GATEWAY_KEY].ready()
    return web.json_response(
        {"status": "ready" if ready else "not_ready", "checks": checks},
        status=200 if ready else 503,
    )


def create_app(
    gateway: Gateway, *, manage_lifecycle: bool = True, body_timeout_s: float = BODY_TIMEOUT_S
) -> web.Application:
    """The calls application. With ``manage_lifecycle`` it starts and closes ``gateway``.
    ``body_timeout_s``: seconds for an envelope's body to arrive after its headers."""
    app = web.Application(
        client_max_size=gateway.policy.policy.server.max_request_bytes,
        middlewares=[_json_errors, edge_errors],
    )
    app[GATEWAY_KEY] = gateway
    app[AUDITED_KEY] = True
    app[BODY_TIMEOUT_KEY] = body_timeout_s
    app.on_response_prepare.append(_close_if_asked)
    app.router.add_post(CALLS_PATH, _calls)
    for route in (ProxyRoute(gateway, _read_body), McpRoute(gateway, _read_body)):
        route.install(app)  # its route, and its answer to paths under it that miss it
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/openapi.json", _openapi)
    if manage_lifecycle:

        async def lifecycle(_: web.Application) -> AsyncIterator[None]:
            await gateway.start()
            yield
            await gateway.aclose()

        app.cleanup_ctx.append(lifecycle)
    return app


def create_ops_app(gateway: Gateway) -> web.Application:
    """Health, readiness and metrics only: safe to bind on the pod IP."""
    app = web.Application(middlewares=[_json_errors])
    app[GATEWAY_KEY] = gateway
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/openapi.json", _openapi)
    return app


def make_runner(
    app: web.Application,
    *,
    keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S,
    lingering_time_s: float = LINGERING_TIME_S,
    handler_cancellation: bool = False,
) -> web.AppRunner:
    """The runner of one listener, with the sidecar's limits on slow and idle clients.

    ``keepalive_timeout_s`` (aiohttp's ``keepalive_timeout``) closes a connection idle
    that long, counted from its opening and from each answer until the next request's
    headers are complete. Request lines and header fields are cut at aiohttp's 8190
    bytes, and at 128 header fields (400 from its parser). A body is bounded by the
    calls app's ``body_timeout_s``; after an early answer (413, 404, 408...) aiohttp reads
    and drops the rest of a body for at most ``lingering_time_s`` and closes. Writing
    the answer to an agent that does not read it is not bounded here.
    """
    return web.AppRunner(
        app,
        access_log=None,
        handle_signals=False,
        handler_cancellation=handler_cancellation,
        keepalive_timeout=keepalive_timeout_s,
        lingering_time=lingering_time_s,
    )


async def serve(
    gateway: Gateway,
    *,
    host: str,
    port: int,
    ops_host: str | None = None,
    ops_port: int | None = None,
    started: asyncio.Event | None = None,
    accept_new_calls: bool | None = None,
) -> None:
    """Run until SIGTERM or SIGINT, then drain and stop (README, "Graceful shutdown").

    Readiness turns false in the signal's own callback. New calls are then served while
    draining when ``accept_new_calls`` (None: the policy's
    ``server.shutdown.accept_new_calls``; the CLI passes
    ``GATEWAY_SHUTDOWN_ACCEPT_NEW_CALLS``), refused with SHUTTING_DOWN otherwise. The
    drain ends once nothing is in flight (and, when accepting, nothing arrived for
    ``server.shutdown.quiet_s``), or after ``server.drain_s``; what still runs then is
    cancelled and answered (:meth:`Gateway.drain`).
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    accept = accept_new_calls

    def on_stop() -> None:
        nonlocal accept
        if accept is None:  # decided at the signal, under the policy then in force
            accept = gateway.policy.policy.server.shutdown.accept_new_calls
        gateway.begin_drain(accept_new_calls=accept)  # only the first signal counts
        stop.set()
        # A person's second Ctrl-C means "now", not after the drain.
        loop.add_signal_handler(signal.SIGINT, _exit_now)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_stop)
    watcher = PolicyWatcher(
        gateway.policy.source,
        gateway.reload,
        interval_s=gateway.policy.policy.server.reload_interval_s,
    )
    reloads: set[asyncio.Task[bool]] = set()

    def on_sighup() -> None:
        task = asyncio.create_task(gateway.reload(), name="policy-reload-sighup")
        reloads.add(task)
        task.add_done_callback(reloads.discard)
        task.add_done_callback(lambda _: watcher.mark_seen())

    loop.add_signal_handler(signal.SIGHUP, on_sighup)
    # handler_cancellation off (aiohttp's default, made explicit): an agent hanging up
    # must not cancel its call half-way (Gateway.call).
    runner = make_runner(create_app(gateway), handler_cancellation=False)
    await runner.setup()
    sites = [web.TCPSite(runner, host, port, reuse_address=True)]
    ops_runner = None
    if ops_port is not None:
        ops_runner = make_runner(create_ops_app(gateway))
        await ops_runner.setup()
        sites.append(web.TCPSite(ops_runner, ops_host or host, ops_port, reuse_address=True))
    try:
        for site in sites:
            await site.start()
        bound = [_bound(site) for site in sites]
        _log.info(
            "listening",
            calls=bound[0],
            ops=bound[1] if len(bound) > 1 else None,
            loop=loop_name(loop),
        )
        watcher.start()
        if started is not None:
            started.set()
        await stop.wait()
        server = gateway.policy.policy.server
        began = time.monotonic()
        _log.info(
            "draining",
            inflight=gateway.inflight,
            drain_s=server.drain_s,
            accept_new_calls=bool(accept),
            quiet_s=server.shutdown.quiet_s,
            waiting_for=f"{gateway.inflight} calls in flight, at most {server.drain_s:g} s "
            "(a second Ctrl-C exits at once)",
        )
        cancelled = await gateway.drain(
            server.drain_s, accept_new_calls=bool(accept), quiet_s=server.shutdown.quiet_s
        )
        _log.info(
            "drained",
            cancelled=cancelled,
            served_while_draining=gateway.served_while_draining,
            waited_s=round(time.monotonic() - began, 3),
        )
    finally:
        await watcher.aclose()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        if ops_runner is not None:
            await ops_runner.cleanup()
        await runner.cleanup()


def _exit_now() -> None:
    """A second Ctrl-C: exit at once (130, as for SIGINT), the calls in flight unanswered.

    Not by raising KeyboardInterrupt: the loop's shutdown would then wait for every task,
    and a call waiting on its upstream keeps the process for as long as the upstream
    takes. Audit lines are flushed as they are written; stdout is flushed here."""
    _log.warning("interrupted", reason="second SIGINT during the drain")
    sys.stdout.flush()
    os._exit(130)


def _bound(site: web.TCPSite) -> str:
    server = site._server  # aiohttp exposes no public accessor for the bound socket
    sockets = getattr(server, "sockets", None) or []
    if sockets:
        host, port = sockets[0].getsockname()[:2]
        return f"{host}:{port}"
    return site.name
