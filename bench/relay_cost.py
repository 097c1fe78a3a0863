"""The relay's cost per chunk and per stream, by counting (not a test).

    python bench/relay_cost.py [--route drop-in|envelope] [--streams S]
                               [--chunks LO HI] [--callgrind] [--keep DIR]

Streams whose chunks arrive one read at a time, whatever the machine's load: a stand-in
upstream in this process writes a stream's chunk i+1 only once the client (also in this
process) has received chunk i through the sidecar, so the sidecar relays each chunk in
exactly one read and one write. The sidecar is ``python -m gateway serve`` with
bench/run.py's realistic policy (every feature on), as in ``make bench-streams``.

S streams of LO chunks, then S streams of HI chunks (all S at once each time, after a
warm-up): the sidecar's cost of the second less the first, over S x (HI - LO), is what one
more relayed chunk costs; the rest, per stream, is what opening and ending a stream
costs (intake, egress decision, upstream request, audit). The cost is the sidecar's CPU
time (``/proc/PID/stat``), or with ``--callgrind`` its user-space instructions
(``valgrind --tool=callgrind``; repeatable to ~1 % under any load). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as bench_run
from harness import Child, start

PY = sys.executable
CHUNK = b'data: {"object":"chat.completion.chunk","i":%d,"choices":[{"index":0,"delta":{"content":"tok"},"finish_reason":null}]}\n\n'  # noqa: E501


def _last(n: int) -> bytes:
    usage = {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n}
    last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": usage}
    return b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n"


class StandIn:
    """The upstream: chunk i+1 of stream ``user`` goes out once the client saw chunk i."""

    def __init__(self) -> None:
        self.chunks = 0
        self.seen: dict[str, asyncio.Queue[int]] = {}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        user = body["user"]
        seen = self.seen.setdefault(user, asyncio.Queue())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(self.chunks - 1):
            await resp.write(CHUNK % i)
            await seen.get()
        await resp.write(_last(self.chunks))
        await resp.write_eof()
        del self.seen[user]
        return resp


async def _one(
    session: aiohttp.ClientSession, stand_in: StandIn, url: str, body: dict[str, Any], user: str
) -> int:
    seen = stand_in.seen.setdefault(user, asyncio.Queue())
    headers = {"Accept": "text/event-stream"}
    got, buf = 0, b""
    async with session.post(url, json=body, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {await resp.text()}")
        async for chunk in resp.content.iter_any():
            buf += chunk
            *events, buf = buf.split(b"\n\n")
            for event in events:
                if event.startswith(b'data: {"object":"chat.completion.chunk","i":'):
                    got += 1
                    seen.put_nowait(got)
    return got


async def _streams(
    session: aiohttp.ClientSession, stand_in: StandIn, url: str, route: str, n: int, s: int,
    tag: str,
) -> None:  # fmt: skip
    stand_in.chunks = n
    calls = []
    for i in range(s):
        params = {**bench_run.PARAMETERS, "stream": True, "user": f"{tag}-{i}"}
        if route == "envelope":
            body: dict[str, Any] = {
                "trace_id": "tr-relay-cost",
                "correlation_id": f"{tag}-{i}",
                "target_system": "openai",
                "endpoint": "/v1/chat/completions",
                "method": "POST",
                "parameters": params,
                "timeout": 600,
            }
        else:
            body = params
        calls.append(_one(session, stand_in, url, body, f"{tag}-{i}"))
    got = await asyncio.gather(*calls)
    if got != [n - 1] * s:
        raise RuntimeError(f"streams relayed {sorted(set(got))} chunks, not {n - 1}")


def _callgrind(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True)


class _Callgrind:
    """Instructions of the sidecar (under callgrind) between :meth:`begin` and :meth:`end`."""

    def __init__(self, sidecar: Child, work: Path, keep: Path | None) -> None:
        self.pid, self.work, self.keep = sidecar.pid, work, keep
        self.before: set[Path] = set()

    def begin(self) -> None:
        self.before = set(self.work.glob("callgrind.out*"))
        _callgrind(self.pid, "-z")
        _callgrind(self.pid, "-i", "on")

    def end(self, label: str) -> int:
        _callgrind(self.pid, "-i", "off")
        _callgrind(self.pid, "-d")
        total = 0
        for dump in set(self.work.glob("callgrind.out*")) - self.before:
            for line in dump.read_text(errors="replace").splitlines():
                if line.startswith("totals:"):
                    total += int(line.split()[1])
            if self.keep is not None:
                self.keep.mkdir(parents=True, exist_ok=True)
                (self.keep / f"{dump.name}.{label}").write_bytes(dump.read_bytes())
        return total


async def serve_stand_in(handle: Any, work: Path) -> web.AppRunner:
    """``handle`` serving every POST on a loopback port, and in ``work`` the benchmark's
    full policy (bench/run.py) aimed at it: ``policy.json``, its key in ``secret``."""
    app = web.Application()
    app.router.add_post("/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
    await site.start()
    host, port = runner.addresses[0][:2]
    secret = work / "secret"
    secret.write_text(bench_run.SECRET)
    policy = bench_run.policy_for(f"{host}:{port}", secret, work / "audit.jsonl", "full")
    (work / "policy.json").write_text(json.dumps(policy))
    return runner


async def _measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    stand_in = StandIn()
    runner = await serve_stand_in(stand_in.handle, work)
    argv = [PY, "-m", "gateway", "serve", "--policy", str(work / "policy.json"),
            "--port", "0", "--ops-port", "0"]  # fmt: skip
    env = dict(os.environ, PYTHONHASHSEED="0")
    if args.profile:
        argv = [PY, "-m", "cProfile", "-o", str(args.profile.resolve()), *argv[1:]]
    if args.callgrind:
        out = work / "callgrind.out"
        argv = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                f"--callgrind-out-file={out}", *argv]  # fmt: skip
    sidecar: Child = await asyncio.to_thread(
        start, "sidecar", argv, work, ready="calls", env=env, timeout_s=600
    )
    path = "/v1/calls" if args.route == "envelope" else "/proxy/openai/v1/chat/completions"
    url = f"http://{sidecar.address}{path}"
    cost: dict[int, float] = {}
    try:
        timeout = aiohttp.ClientTimeout(total=3600)
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
            for w in range(2):  # warm-up: imports, price data, pools, both sizes
                for n in args.chunks:
                    await _streams(session, stand_in, url, args.route, n, args.streams, f"w{w}{n}")
            for n in args.chunks:
                measure = _Callgrind(sidecar, work, args.keep) if args.callgrind else None
                cpu0 = sidecar.cpu_s()
                if measure is not None:
                    await asyncio.to_thread(measure.begin)
                await _streams(session, stand_in, url, args.route, n, args.streams, f"m{n}")
                if measure is not None:
                    cost[n] = await asyncio.to_thread(measure.end, f"{args.route}.{n}")
                else:
                    cost[n] = sidecar.cpu_s() - cpu0
    finally:
        if args.profile:
            sidecar.stop(60)  # SIGTERM: cProfile writes its file at a clean exit
        sidecar.proc.kill()
        sidecar.proc.wait(30)
        await runner.cleanup()
    lo, hi = args.chunks
    s = args.streams
    per_chunk = (cost[hi] - cost[lo]) / (s * (hi - lo))
    per_stream = cost[lo] / s - lo * per_chunk
    unit = "instructions" if args.callgrind else "us"
    scale = 1 if args.callgrind else 1e6
    return {
        "route": args.route,
        "streams": s,
        "chunks": [lo, hi],
        "unit": unit,
        "per_chunk": round(per_chunk * scale, 1),
        "per_stream": round(per_stream * scale, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--route", choices=("drop-in", "envelope"), default="drop-in")
    parser.add_argument("--streams", type=int, default=50, help="streams at once")
    parser.add_argument("--chunks", type=int, nargs=2, default=[5, 45], metavar=("LO", "HI"))
    parser.add_argument("--callgrind", action="store_true", help="count instructions")
    parser.add_argument("--profile", type=Path, help="run the sidecar under cProfile, to FILE")
    parser.add_argument("--keep", type=Path, help="keep the callgrind dumps here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-relay-") as tmp:
        result = asyncio.run(_measure(args, Path(tmp)))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
