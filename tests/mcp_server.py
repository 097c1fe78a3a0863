"""A real MCP server for the tests (the ``mcp`` SDK's ``MCPServer``, streamable HTTP) on
loopback, in a thread with its own event loop (uvicorn), recording every HTTP request it
receives (method, path, headers, body) before the SDK sees it.

Tools: ``echo``, ``headers`` (the credential headers it got), ``create_issue`` and
``delete_repo`` (side effects, counted), ``progress`` (progress notifications, then the
result, on one SSE answer), ``hold`` (one progress notification, then the call stays
open for ``seconds``), ``fail`` (a tool error: ``isError``), ``internal_admin``
(never allowed by the tests' policy).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from mcp.server.mcpserver import Context, MCPServer


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class McpTestServer:
    url: str
    requests: list[Received] = field(default_factory=list)
    side_effects: list[str] = field(default_factory=list)

    def posts(self) -> list[Received]:
        return [r for r in self.requests if r.method == "POST"]

    def bodies(self) -> str:
        return "\n".join(r.body.decode(errors="replace") for r in self.requests)


def _build(record: McpTestServer) -> MCPServer:
    server = MCPServer("egress-test", log_level="WARNING")

    @server.tool()
    def echo(text: str) -> str:
        """Echo the text."""
        return text

    @server.tool()
    def headers(ctx: Context) -> dict[str, str]:
        """The credential-bearing headers this request carried."""
        got = {k.lower(): v for k, v in (ctx.headers or {}).items()}
        return {k: got[k] for k in ("authorization", "x-api-key", "cookie") if k in got}

    @server.tool()
    def create_issue(repo: str, title: str) -> str:
        """Create an issue (a side effect)."""
        record.side_effects.append(f"create_issue {repo} {title}")
        return f"created in {repo}"

    @server.tool()
    def delete_repo(repo: str) -> str:
        """Delete a repository (a side effect the policy denies)."""
        record.side_effects.append(f"delete_repo {repo}")
        return "deleted"

    @server.tool()
    def internal_admin() -> str:
        """Not in the policy's allow list."""
        record.side_effects.append("internal_admin")
        return "admin"

    @server.tool()
    async def progress(steps: int, ctx: Context) -> str:
        """Report progress, then answer."""
        for i in range(steps):
            await ctx.report_progress(progress=i + 1, total=steps, message=f"step {i + 1}")
        return f"done after {steps}"

    @server.tool()
    async def hold(seconds: float, ctx: Context) -> str:
        """Report one progress step, then hold the call open (a call in flight)."""
        await ctx.report_progress(progress=0, total=1, message="holding")
        await asyncio.sleep(seconds)
        return "held"

    @server.tool()
    def fail() -> str:
        """A tool that fails (the result carries isError)."""
        raise ValueError("the tool failed on purpose")

    return server


class _Recorder:
    """ASGI middleware: keeps every HTTP request (its whole body) before the app runs."""

    def __init__(self, app: Any, record: McpTestServer) -> None:
        self.app = app
        self.record = record

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        entry = Received(scope["method"], scope["path"], headers, b"")
        self.record.requests.append(entry)
        chunks: list[bytes] = []

        async def recv() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                entry.body = b"".join(chunks)
            return message

        await self.app(scope, recv, send)


class RunningServer:
    """Start with :meth:`start` (waits, bounded, until it listens); :meth:`stop`."""

    def __init__(self, *, stateless: bool = False, json_response: bool = False) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        port = self._sock.getsockname()[1]
        self.record = McpTestServer(url=f"http://127.0.0.1:{port}/mcp")
        app = _build(self.record).streamable_http_app(
            stateless_http=stateless, json_response=json_response, host="127.0.0.1"
        )
        config = uvicorn.Config(
            _Recorder(app, self.record), log_level="warning", lifespan="on", ws="none"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="mcp-test-server", daemon=True)

    def _run(self) -> None:
        asyncio.run(self._server.serve(sockets=[self._sock]))

    def start(self, timeout_s: float = 10.0) -> McpTestServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the MCP test server did not start")
            time.sleep(0.01)
        return self.record

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()
