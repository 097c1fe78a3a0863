"""The baseline: the least an aiohttp proxy can do (benchmark only).

    python bench/passthrough.py --upstream http://127.0.0.1:PORT/v1/chat/completions
                                [--port 0] [--loop asyncio|uvloop]

``POST /v1/calls``: read the body, POST it to the upstream URL over one pooled
``ClientSession``, answer with the upstream's status and body. No parsing, no policy, no
logging. What the sidecar costs beyond this is the price of its features. Prints
``{"listening": "host:port"}`` on stdout once bound; stops on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

from aiohttp import ClientSession, TCPConnector, web

SESSION: web.AppKey[ClientSession] = web.AppKey("session", ClientSession)
UPSTREAM: web.AppKey[str] = web.AppKey("upstream", str)


async def _forward(request: web.Request) -> web.Response:
    body = await request.read()
    session = request.app[SESSION]
    async with session.post(
        request.app[UPSTREAM], data=body, headers={"Content-Type": "application/json"}
    ) as resp:
        data = await resp.read()
        return web.Response(status=resp.status, body=data, content_type="application/json")


async def _main(upstream: str, host: str, port: int) -> None:
    app = web.Application()
    app[UPSTREAM] = upstream
    app.router.add_post("/v1/calls", _forward)

    async def session_ctx(app: web.Application):  # type: ignore[no-untyped-def]
        app[SESSION] = ClientSession(connector=TCPConnector(limit=0))
        yield
        await app[SESSION].close()

    app.cleanup_ctx.append(session_ctx)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    sock = site._server.sockets[0]  # type: ignore[union-attr]
    bound = sock.getsockname()
    print(json.dumps({"listening": f"{bound[0]}:{bound[1]}"}), flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="URL to POST each body to")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    args = parser.parse_args()
    coro = _main(args.upstream, args.host, args.port)
    if args.loop == "uvloop":
        import uvloop

        uvloop.run(coro)
    else:
        asyncio.run(coro)
    return 0


if __name__ == "__main__":
    sys.exit(main())
