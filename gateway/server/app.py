"""The sidecar's listeners: one handler per API (:mod:`gateway.api`), probes, metrics.

Routes of the calls listener (loopback by default):

* ``POST /v1/calls``: body an ExternalCallRequest; the answer is always an
  ExternalCallResponse JSON, whatever happened, with an HTTP status that mirrors the
  outcome (docs/api/envelope.md).
* ``ANY /proxy/{target}/{path}``: a provider SDK's own request, the same call as an
  envelope, answered as the provider would (:mod:`gateway.api.proxy`).
* ``ANY /mcp/{target}``: an MCP client's streamable HTTP, its tool calls checked by the
  target's ``mcp`` rules (:mod:`gateway.api.mcp`).
* ``/a2a/{target}``: an A2A client's JSON-RPC and its card, methods checked by the
  target's ``a2a`` rules, the call chain carried; ``/a2a/in/{path}``: calls to this
  sidecar's own agent (``inbound.agent_url``), their chain admitted (:mod:`gateway.api.a2a`).
* ``GET /healthz`` (alive), ``/readyz`` (ready), ``/openapi.json`` (both listeners).

The ops listener (``server.ops_host``/``ops_port``) serves ``/healthz``, ``/readyz``,
``/metrics``, ``/openapi.json``, the stop switch (:mod:`gateway.server.ops`) and the
approvals and dead letters (:mod:`gateway.server.desk`).
Any other path or method gets a JSON error answer too, never an HTML page (under
``/proxy``, ``/mcp`` and ``/a2a`` in that route's shape: :func:`gateway.api.http.edge_answer`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Middleware

from gateway import openapi
from gateway.agents.identity import identify
from gateway.api import a2a, envelope, http, mcp, proxy, writer
from gateway.api.admission import ByteBudget
from gateway.api.envelope import CALLS_PATH
from gateway.api.http import BODY_TIMEOUT_KEY, BODY_TIMEOUT_S, BUDGET_KEY, BUDGET_LIMIT_KEY, Handler
from gateway.audit import get_logger
from gateway.audit.held import HELD_RECORDS, Held
from gateway.errors import GatewayError, InvalidPayload
from gateway.server import desk, ops
from gateway.server.eventloop import loop_name
from gateway.server.listeners import calls_sites, start_sites
from gateway.server.reload import PolicyWatcher
from gateway.server.runtime import Gateway

GATEWAY_KEY: Final = web.AppKey("gateway", Gateway)
#: Set on the calls application: its refusals are audited (the ops listener's are not).
AUDITED_KEY: Final = web.AppKey("audited", bool)
#: Slow and idle clients (docs/running.md). aiohttp closes a connection that has
#: been idle this long: from its opening, and again from each answer, until a request's
#: headers are complete. So it bounds slow headers as well as idle keep-alive.
KEEPALIVE_TIMEOUT_S: Final = 75.0
#: After an answer sent before its body was read whole (413, 404, 408...), aiohttp reads
#: and drops what more of the body comes for at most this long, so that the agent gets
#: the answer rather than a reset, then closes (aiohttp's default, made explicit).
LINGERING_TIME_S: Final = 10.0
_log = get_logger("gateway.server")


def _json_errors(
    budget: ByteBudget | None = None, limit_now: Callable[[], int] | None = None
) -> Middleware:
    """The application's one middleware. Turns aiohttp's own HTTP errors (404, 405,
    413...) into JSON answers (under a route family, ``/proxy``, ``/mcp``, in that
    family's shape: :func:`gateway.api.http.edge_answer`); writes the answer (a large one
    within ``body_timeout_s``: :func:`gateway.api.writer.deliver`), the request's audit
    records held until it is written (:class:`gateway.audit.held.Held`). With ``budget`` (the
    calls application's), each request gets its body's charge (:func:`gateway.api.http.
    charge`, its limit ``limit_now()``: the policy in force) and gives it back whatever
    happened, after the answer is written. One middleware for all of it, as each one
    more is a coroutine around every call; the charge is its local, not looked up again."""

    @web.middleware
    async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.monotonic()
        charge = None
        if budget is not None:
            if limit_now is not None:
                budget.limit_bytes = limit_now()
            charge = http.charge(request, budget)
        # The request's audit records wait for its answer to be written, so that they say
        # what the agent got (gateway.audit.held).
        waiting = Held()
        token = HELD_RECORDS.set(waiting)
        try:
            try:
                response = await handler(request)
            except web.HTTPException as exc:
                if exc.status < 400:
                    raise
                edge = http.edge_answer(request, exc)
                response = _route_error(request, exc, started) if edge is None else edge
            if not response.prepared:  # a whole answer (a stream wrote itself)
                timeout_s = request.app.get(BODY_TIMEOUT_KEY, BODY_TIMEOUT_S)
                response = await writer.deliver(request, response, timeout_s)
            _closing_after_upgrade(request, response)
            return response
        finally:
            if charge is not None:  # the answer is written: its body's bytes are free again
                charge.release()
            HELD_RECORDS.reset(token)
            waiting.release()

    return json_errors


def _closing_after_upgrade(request: web.Request, response: web.StreamResponse) -> None:
    """Close the connection after ``response`` (written) when its request asked to switch
    protocols (``Upgrade``; the sidecar switches to none, RFC 9110 section 7.8): aiohttp's
    parser stops reading HTTP after such a request, so a request pipelined behind it was
    neither forwarded nor answered, its agent left waiting for the keep-alive timeout.
    The close tells the agent at once (nothing behind it was forwarded)."""
    if "Upgrade" in request.headers:
        response.force_close()


def _route_error(request: web.Request, exc: web.HTTPException, started: float) -> web.Response:
    """aiohttp's HTTP error ``exc`` (404, 405, 413...) as the sidecar's JSON answer."""
    code_exc: GatewayError = InvalidPayload(
        f"{request.method} {request.path}: {exc.reason}; the sidecar serves "
        f"POST {CALLS_PATH} (envelopes), {proxy.PREFIX}/{{target}}/... (an SDK's requests), "
        f"{mcp.PREFIX}/{{target}} (MCP), {a2a.PREFIX}/{{target}}/... and "
        f"{a2a.INBOUND_PREFIX}/... (A2A), GET /healthz, GET /readyz, GET /metrics and "
        "GET /openapi.json",
        details={"reason": "route", "http_status": exc.status},
        http_status=exc.status,
    )
    gateway = request.app[GATEWAY_KEY]
    audited = request.app.get(AUDITED_KEY, False)
    answer = writer.respond(
        envelope.refusal(
            gateway,
            code_exc,
            started=started,
            method=request.method,
            path=request.rel_url.raw_path,
            audited=audited,
            identity=(
                identify(request.transport, request.headers, gateway.agents) if audited else None
            ),
        )
    )
    if "Allow" in exc.headers:  # a 405 must say what is allowed (RFC 9110, 15.5.6)
        answer.headers["Allow"] = exc.headers["Allow"]
    return answer


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
    # The memory request bodies in flight may hold, its limit read at each request from
    # the policy then in force (a hot key: server.components.Listeners).
    budget = ByteBudget(gateway.policy.policy.server.max_inflight_request_bytes)

    def limit_now() -> int:
        return gateway.policy.policy.server.max_inflight_request_bytes

    app = web.Application(
        client_max_size=gateway.policy.policy.server.max_request_bytes,
        middlewares=[_json_errors(budget, limit_now)],
    )
    app[GATEWAY_KEY] = gateway
    app[AUDITED_KEY] = True
    app[BODY_TIMEOUT_KEY] = body_timeout_s
    app[BUDGET_KEY] = budget
    app[BUDGET_LIMIT_KEY] = limit_now
    app.on_response_prepare.append(http.close_if_asked)
    app.router.add_post(CALLS_PATH, envelope.handler(gateway))
    drop_in = http.TargetRoute(proxy.PREFIX, proxy.handler(gateway))
    drop_in.register(app.router, proxy.shortcuts(gateway.policy))
    app.router.add_route("*", mcp.MCP_ROUTE, mcp.handler(gateway))
    app.router.add_route("*", a2a.INBOUND_ROUTE, a2a.inbound_handler(gateway))  # before a target's
    app.router.add_route("*", a2a.A2A_ROUTE, a2a.handler(gateway))
    app.router.add_route("*", a2a.CARD_ROUTE, a2a.handler(gateway))
    # The answer of each route family to the paths under it that its route misses.
    app[http.EDGES_KEY] = {
        proxy.PREFIX: proxy.unmatched(gateway),
        mcp.PREFIX: mcp.unmatched(gateway),
        a2a.PREFIX: a2a.unmatched(gateway),
    }
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
    """Health, readiness, metrics, the operator's routes (operator token): safe on the pod IP."""
    app = web.Application(middlewares=[_json_errors()])
    app[GATEWAY_KEY] = gateway
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/openapi.json", _openapi)
    ops.install(app, gateway)  # the stop switch's routes (operator token)
    return desk.install(app, gateway)  # approvals and dead letters (operator token)


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
    unix_socket: str | None = None,
) -> None:
    """Run until SIGTERM or SIGINT, then drain and stop (docs/running.md).

    With ``unix_socket`` (a path) the calls API is on that Unix socket too
    (:mod:`gateway.server.listeners`).

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
    _reload_on_sighup(loop, gateway, watcher)
    # handler_cancellation off (aiohttp's default, made explicit): an agent hanging up
    # must not cancel its call half-way (Gateway.call).
    runner = make_runner(create_app(gateway), handler_cancellation=False)
    await runner.setup()
    sites = calls_sites(runner, host, port, unix_socket)
    ops_runner = None
    if ops_port is not None:
        ops_runner = make_runner(create_ops_app(gateway))
        await ops_runner.setup()
        sites.append(web.TCPSite(ops_runner, ops_host or host, ops_port, reuse_address=True))
    try:
        bound = await start_sites(sites, unix_socket)
        _log.info(
            "listening",
            calls=bound[0],
            ops=bound[1] if len(bound) > 1 else None,
            unix_socket=unix_socket,
            loop=loop_name(loop),
        )
        watcher.start()
        if started is not None:
            started.set()
        await stop.wait()
        await _drain(gateway, bool(accept))
    finally:
        await watcher.aclose()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        if ops_runner is not None:
            await ops_runner.cleanup()
        await runner.cleanup()


def _reload_on_sighup(
    loop: asyncio.AbstractEventLoop, gateway: Gateway, watcher: PolicyWatcher
) -> None:
    """SIGHUP reloads the policy now (a task kept until it ends); the watcher then takes
    the file as seen, so that it does not reload it again."""
    reloads: set[asyncio.Task[bool]] = set()

    def on_sighup() -> None:
        task = asyncio.create_task(gateway.reload(), name="policy-reload-sighup")
        reloads.add(task)
        task.add_done_callback(reloads.discard)
        task.add_done_callback(lambda _: watcher.mark_seen())

    loop.add_signal_handler(signal.SIGHUP, on_sighup)


async def _drain(gateway: Gateway, accept: bool) -> None:
    """The drain after the stop signal, logged as it begins and ends (``draining``,
    ``drained``), under the policy in force then (:meth:`Gateway.drain`)."""
    server = gateway.policy.policy.server
    began = time.monotonic()
    _log.info(
        "draining",
        inflight=gateway.inflight,
        drain_s=server.drain_s,
        accept_new_calls=accept,
        quiet_s=server.shutdown.quiet_s,
        waiting_for=f"{gateway.inflight} calls in flight, at most {server.drain_s:g} s "
        "(a second Ctrl-C exits at once)",
    )
    cancelled = await gateway.drain(
        server.drain_s, accept_new_calls=accept, quiet_s=server.shutdown.quiet_s
    )
    _log.info(
        "drained",
        cancelled=cancelled,
        served_while_draining=gateway.served_while_draining,
        waited_s=round(time.monotonic() - began, 3),
    )


def _exit_now() -> None:
    """A second Ctrl-C: exit at once (130, as for SIGINT), the calls in flight unanswered.

    Not by raising KeyboardInterrupt: the loop's shutdown would then wait for every task,
    and a call waiting on its upstream keeps the process for as long as the upstream
    takes. Audit lines are flushed as they are written; stdout is flushed here."""
    _log.warning("interrupted", reason="second SIGINT during the drain")
    sys.stdout.flush()
    os._exit(130)
