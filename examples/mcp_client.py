"""The MCP Python SDK's client, unchanged but for its URL, through the egress sidecar.

    .venv/bin/python examples/mcp_client.py                   # against a stand-in MCP server
    .venv/bin/python examples/mcp_client.py --sidecar http://127.0.0.1:8181 --target github

Without ``--sidecar`` it starts, on free loopback ports, a small stand-in MCP server (the
SDK's ``MCPServer`` with three tools: ``search_issues``, ``create_issue``,
``delete_repo``; it checks the bearer token the sidecar injects) and a sidecar whose
policy allows searching, allows creating issues only in ``acme/*`` repositories, and
denies deleting. Then, as an agent would: list the tools (``delete_repo`` is not
listed), call one, call one with an argument the policy refuses, and one the policy
denies; both refusals raise the SDK's own ``MCPError`` with the sidecar's reason. The
agent holds no token for the server. Needs the ``mcp`` package (the dev extra has it:
``make test`` installs it; or ``pip install mcp``).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import socket
import sys
from pathlib import Path

import uvicorn
from aiohttp import web
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.server.mcpserver import Context, MCPServer
from mcp.shared.exceptions import MCPError

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing it

from gateway.policy import PolicySet, parse_policy  # noqa: E402
from gateway.server import create_app  # noqa: E402
from gateway.server.runtime import Gateway  # noqa: E402

TOKEN = "mcp-demo-0001-NOT-A-REAL-TOKEN"  # noqa: S105 - what env://DEMO_MCP_TOKEN resolves to
POLICY = """
version: 1
agent_id: example-agent
egress: {allow_cidrs: ["127.0.0.0/8"]}      # the stand-in is on loopback
targets:
  github:
    base_url: http://127.0.0.1:%(port)d/mcp
    credential: {header: Authorization, format: "Bearer {secret}", default_ref: "env://DEMO_MCP_TOKEN"}
    mcp:
      tools: {allow: ["search_*", "create_issue"], deny: ["delete_*"]}
      arguments:
        create_issue: {repo: {pattern: "acme/[a-z0-9-]+"}, title: {max_length: 80}}
"""


def stand_in() -> MCPServer:
    server = MCPServer("issues-stand-in", log_level="WARNING")

    def check(ctx: Context) -> None:
        if (ctx.headers or {}).get("authorization") != f"Bearer {TOKEN}":
            raise PermissionError("the stand-in wants the sidecar's token")

    @server.tool()
    def search_issues(query: str, ctx: Context) -> list[str]:
        """Search issues."""
        check(ctx)
        return [f"#1 {query} is flaky", f"#2 {query} times out"]

    @server.tool()
    def create_issue(repo: str, title: str, ctx: Context) -> str:
        """Create an issue."""
        check(ctx)
        return f"created {repo}#3: {title}"

    @server.tool()
    def delete_repo(repo: str, ctx: Context) -> str:
        """Delete a repository."""
        check(ctx)
        return f"deleted {repo}"

    return server


async def use_the_sdk(url: str) -> None:
    """What an agent writes: the SDK's client, pointed at the sidecar's /mcp/{target}."""
    async with (
        streamable_http_client(url) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        tools = await session.list_tools()
        print(f"tools:    {sorted(t.name for t in tools.tools)}")
        found = await session.call_tool("search_issues", {"query": "login"})
        print(f"search:   {found.structured_content}")
        for name, arguments in (
            ("create_issue", {"repo": "evil/site", "title": "hello"}),
            ("delete_repo", {"repo": "acme/web"}),
        ):
            try:
                await session.call_tool(name, arguments)
            except MCPError as exc:
                data = exc.error.data or {}
                print(f"refused:  {name}: {data.get('egress_code')} {exc.error.message}")
        made = await session.call_tool("create_issue", {"repo": "acme/web", "title": "hello"})
        print(f"created:  {made.structured_content}")


async def with_stand_in() -> int:
    os.environ["DEMO_MCP_TOKEN"] = TOKEN
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = stand_in().streamable_http_app(host="127.0.0.1")
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    for _ in range(500):  # bounded: at most ~5 s for the stand-in to listen
        if server.started or serving.done():
            break
        await asyncio.sleep(0.01)
    policy = PolicySet.compile(parse_policy(POLICY % {"port": port}, "example.yaml"))
    log = io.StringIO()
    sidecar = web.AppRunner(create_app(Gateway(policy, log_stream=log)), access_log=None)
    await sidecar.setup()
    await web.TCPSite(sidecar, "127.0.0.1", 0).start()
    url = "http://{}:{}/mcp/github".format(*sidecar.addresses[0][:2])
    try:
        await use_the_sdk(url)
    finally:
        await sidecar.cleanup()
        server.should_exit = True
        await serving
    print("\naudit records (one per JSON-RPC request):")
    for line in log.getvalue().splitlines():
        record = json.loads(line)
        if record.get("event") == "egress_call" and record.get("mcp_method"):
            fields = ("mcp_method", "mcp_tool", "decision", "error_code", "mcp_is_error")
            print("  " + "  ".join(f"{k}={record[k]}" for k in fields))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sidecar", help="a running sidecar, e.g. http://127.0.0.1:8181")
    parser.add_argument("--target", default="github", help="the MCP target of its policy")
    args = parser.parse_args()
    if args.sidecar:
        asyncio.run(use_the_sdk(f"{args.sidecar.rstrip('/')}/mcp/{args.target}"))
        return 0
    return asyncio.run(with_stand_in())


if __name__ == "__main__":
    sys.exit(main())
