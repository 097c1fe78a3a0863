"""Peak RSS of a sidecar holding N large request bodies at once (README, "Memory").

    PYTHONPATH=$PWD python bench/request_memory.py [--route envelope|proxy|mcp]
        [--bytes 8380000] [--counts 1,2,4,8] [--budget BYTES]

A real ``gateway serve`` process and a loopback upstream in this process. For each N the
sidecar's peak (``VmHWM``, reset through ``/proc/PID/clear_refs``) is read after N bodies
of ``--bytes`` were sent at once: the upstream holds every request it receives until each
of the N was either received or refused by the sidecar, so the admitted bodies are all in
flight together. Prints one JSON document: per N, the peak and RSS in KiB, how many were
admitted and refused (and with which codes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Child, start


class HoldingUpstream:
    """Answers ``{"ok": true}`` to every request, once ``release`` is set."""

    def __init__(self) -> None:
        self.received = 0
        self.bytes = 0
        self.release = asyncio.Event()

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.received += 1
        self.bytes += len(body)
        await self.release.wait()
        return web.json_response({"ok": True, "id": 1, "jsonrpc": "2.0", "result": {}})


def policy(url: str, budget: int | None) -> str:
    server: dict[str, Any] = {"reload_interval_s": 0}
    if budget is not None:
        server["max_inflight_request_bytes"] = budget
    target = {
        "base_url": url,
        "endpoints": [{"path": "/v1/*", "methods": ["POST"]}],
        "retry": {"max_retries": 0},
        "usage": "openai",
    }
    doc = {
        "version": 1,
        "agent_id": "bench",
        "egress": {"allow_cidrs": ["127.0.0.0/8"]},
        "server": server,
        "audit": {"sink": "file", "path": os.devnull},
        "targets": {"t": target, "m": {"base_url": url + "/mcp", "mcp": {}}},
    }
    return json.dumps(doc)


#: JSON texts of one value each, for ``--shape``: dense arrays cost most per byte.
UNITS = {"dicts": "{}", "ints": "1234", "floats": "0.1234567", "strs": '"s%05d"'}


def body(route: str, size: int, n: int, shape: str = "string") -> bytes:
    """A JSON body of about ``size`` bytes for ``route``: one long prompt (``shape``
    string), or an array of many small values."""
    if shape != "string":
        unit = UNITS[shape]
        count = max(size - 400, 0) // (len(unit % 0 if "%" in unit else unit) + 1)
        items = ",".join(unit % (i % 100000) if "%" in unit else unit for i in range(count))
        inner = json.loads("[" + items + "]")
        if route == "mcp":
            doc: dict[str, Any] = {
                "jsonrpc": "2.0",
                "id": n,
                "method": "tools/call",
                "params": {"name": "echo", "arguments": {"x": inner}},
            }
            return json.dumps(doc, separators=(",", ":")).encode()
        params = {"model": "m", "input": inner}
        if route == "proxy":
            return json.dumps(params, separators=(",", ":")).encode()
        doc = {
            "trace_id": f"tr-{n}",
            "correlation_id": f"c-{n}",
            "target_system": "t",
            "endpoint": "/v1/chat",
            "method": "POST",
            "parameters": params,
            "timeout": 120,
        }
        return json.dumps(doc, separators=(",", ":")).encode()
    filler = "x" * max(size - 400, 0)
    messages = [{"role": "user", "content": f"{n}:{filler}"}]
    if route == "envelope":
        doc: dict[str, Any] = {
            "trace_id": f"tr-{n}",
            "correlation_id": f"c-{n}",
            "target_system": "t",
            "endpoint": "/v1/chat",
            "method": "POST",
            "parameters": {"model": "m", "messages": messages},
            "timeout": 120,
        }
    elif route == "proxy":
        doc = {"model": "m", "messages": messages}
    else:
        doc = {
            "jsonrpc": "2.0",
            "id": n,
            "method": "tools/call",
            "params": {"name": "echo", "arguments": {"text": filler}},
        }
    return json.dumps(doc).encode()


URLS = {"envelope": "/v1/calls", "proxy": "/proxy/t/v1/chat", "mcp": "/mcp/m"}


async def send(session: aiohttp.ClientSession, url: str, data: bytes) -> tuple[int, str]:
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    async with session.post(url, data=data, headers=headers) as resp:
        raw = await resp.read()
        code = resp.headers.get("x-egress-error-code", "")
        if not code and resp.status != 200:
            code = json.loads(raw).get("error", {}).get("code", str(resp.status))
        return resp.status, code


def reset_peak(pid: int) -> None:
    """Reset ``VmHWM`` of ``pid`` to its current RSS (Linux ``clear_refs``, value 5)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def memory(child: Child) -> dict[str, int]:
    return child.memory_kib()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    holder = HoldingUpstream()
    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/{tail:.*}", holder.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    tmp = Path(tempfile.mkdtemp(prefix="reqmem-"))
    path = tmp / "policy.yaml"
    path.write_text(policy(f"http://127.0.0.1:{port}", args.budget))
    argv = [sys.executable, "-m", "gateway", "serve", "--policy", str(path)]
    argv += ["--port", "0", "--ops-port", "0"]
    env = {**os.environ}
    child = await asyncio.to_thread(start, "sidecar", argv, tmp, ready="calls", env=env)
    out: dict[str, Any] = {"route": args.route, "shape": args.shape, "runs": []}
    try:
        base = f"http://{child.address}"
        out["idle_kib"] = memory(child)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            await send(session, base + URLS[args.route], body(args.route, 1000, 0))  # warm up
            for n in args.counts:
                reset_peak(child.pid)
                before = memory(child)
                holder.received, holder.release = 0, asyncio.Event()
                datas = [body(args.route, args.bytes, i, args.shape) for i in range(n)]
                tasks = [
                    asyncio.create_task(send(session, base + URLS[args.route], d)) for d in datas
                ]
                del datas
                # Polled: the count is the upstream's and the client's together.
                while holder.received + sum(t.done() for t in tasks) < n:  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
                during = memory(child)
                holder.release.set()
                results = await asyncio.gather(*tasks)
                after = memory(child)
                codes: dict[str, int] = {}
                for status, code in results:
                    codes[code or str(status)] = codes.get(code or str(status), 0) + 1
                out["runs"].append(
                    {
                        "concurrent": n,
                        "before_kib": before["VmRSS"],
                        "peak_kib": after["VmHWM"],
                        "held_kib": during["VmRSS"],
                        "after_kib": after["VmRSS"],
                        "received": holder.received,
                        "answers": codes,
                    }
                )
    finally:
        child.stop()
        await runner.cleanup()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--route", choices=sorted(URLS), default="envelope")
    parser.add_argument("--bytes", type=int, default=8 * 1024 * 1024 - 4096)
    parser.add_argument("--counts", default="1,2,4,8")
    parser.add_argument("--budget", type=int, default=None)
    parser.add_argument("--shape", choices=["string", *UNITS], default="string")
    args = parser.parse_args()
    args.counts = [int(c) for c in args.counts.split(",")]
    print(json.dumps(asyncio.run(run(args)), indent=1))


if __name__ == "__main__":
    main()
