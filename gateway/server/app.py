"""The HTTP face of the sidecar: the only module that knows aiohttp.web.

Routes of the calls listener (loopback by default):

* ``POST /v1/calls``: body an ExternalCallRequest; the answer is always an
  ExternalCallResponse JSON, whatever happened, with an HTTP status that mirrors the
  outcome (README, "Error codes").
* ``GET /healthz`` (process alive) and ``GET /readyz`` (ready to forward).
* ``GET /openapi.json``: this API as an OpenAPI 3.1 document (both listeners).

The ops listener (``server.ops_host``/``ops_port``) serves only ``/healthz``, ``/readyz``,
``/metrics`` and ``/openapi.json`` so probes and scrapers can reach it without exposing
the calls API.
Any other path or method gets a JSON error answer too, never an HTML page.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Final

from aiohttp import web

from gateway import openapi, redaction
from gateway.audit import get_logger
from gateway.call.record import refusal_record
from gateway.call.relay import AgentGone
from gateway.envelope import ExternalCallResponse
from gateway.errors import GatewayError, InternalError, InvalidPayload, error_response
from gateway.server.eventloop import loop_name
from gateway.server.reload import PolicyWatcher
from gateway.server.runtime import Gateway

GATEWAY_KEY: Final = web.AppKey("gateway", Gateway)
#: Set on the calls application: its refusals are audited (the ops listener's are not).
AUDITED_KEY: Final = web.AppKey("audited", bool)
CALLS_PATH: Final = "/v1/calls"
_log = get_logger("gateway.server")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json_answer(status: int, response: ExternalCallResponse) -> web.Response:
    try:
        raw = response.model_dump_json()
    except ValueError as exc:  # the pipeline rules this out; if not, still an envelope
        _log.error("answer_not_writable", error=str(exc)[:200], trace_id=response.trace_id)
        note = {"content_type": None, "text": "the answer's data could not be written as JSON"}
        raw = response.model_copy(update={"data": note}).model_dump_json()
    body = redaction.scrub_bytes(raw.encode())
    return web.Response(status=status, body=body, content_type="application/json")


def _error_answer(exc: GatewayError, started: float, request: web.Request) -> web.Response:
    """The answer to a request refused here, before the pipeline (which audits its own
    answers): on the calls listener it gets its one audit record."""
    response = error_response(exc, latency_ms=(time.monotonic() - started) * 1000)
    gateway = request.app[GATEWAY_KEY]
    if request.app.get(AUDITED_KEY) and gateway.audit is not None:
        gateway.audit.call(
            refusal_record(
                gateway.policy.policy.agent_id,
                response,
                http_method=request.method,
                http_path=request.rel_url.raw_path,
                http_status=exc.http_status,
            )
        )
    return _json_answer(exc.http_status, response)


@web.middleware
async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn aiohttp's own HTTP errors (404, 405, 413...) into JSON answers."""
    started = time.monotonic()
    try:
        return await handler(request)
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


async def _calls(request: web.Request) -> web.StreamResponse:
    started = time.monotonic()
    gateway = request.app[GATEWAY_KEY]
    limit = gateway.policy.policy.server.max_request_bytes
    try:
        if request.content_length is not None and request.content_length > limit:
            raise _too_large(request.content_length, limit)
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _too_large(None, limit) from None
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
        self._response = web.StreamResponse(
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
        final = response.model_copy(update={"data": None}).model_dump_json().encode()
        with contextlib.suppress(ConnectionError, RuntimeError):  # the agent may be gone
            await self._response.write(
                b"event: egress.response\ndata: " + redaction.scrub_bytes(final) + b"\n\n"
            )
            await self._response.write_eof()
        return self._response


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


def create_app(gateway: Gateway, *, manage_lifecycle: bool = True) -> web.Application:
    """The calls application. With ``manage_lifecycle`` it starts and closes ``gateway``."""
    app = web.Application(
        client_max_size=gateway.policy.policy.server.max_request_bytes,
        middlewares=[_json_errors],
    )
    app[GATEWAY_KEY] = gateway
    app[AUDITED_KEY] = True
    app.router.add_post(CALLS_PATH, _calls)
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
    runner = web.AppRunner(
        create_app(gateway), access_log=None, handle_signals=False, handler_cancellation=False
    )
    await runner.setup()
    sites = [web.TCPSite(runner, host, port, reuse_address=True)]
    ops_runner = None
    if ops_port is not None:
        ops_runner = web.AppRunner(create_ops_app(gateway), access_log=None)
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


def _bound(site: web.TCPSite) -> str:
    server = site._server  # aiohttp exposes no public accessor for the bound socket
    sockets = getattr(server, "sockets", None) or []
    if sockets:
        host, port = sockets[0].getsockname()[:2]
        return f"{host}:{port}"
    return site.name
