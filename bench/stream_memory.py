"""What an open stream holds in the sidecar, by counting (not a test).

    python bench/stream_memory.py [--route drop-in|envelope] [--streams N] [--held H]
                                  [--frames F] [--top T]

A real ``python -m gateway serve`` (bench/run.py's realistic policy, every feature on, as
in ``make bench-streams``), optionally with tracemalloc (``F`` frames per allocation), and
a stand-in upstream in this process that sends each stream ``H`` chunks, then holds it
open until told to end it; the client is in this process too. After two rounds of 5
streams (what the first calls import and load), the RSS (and the traced heap) is read;
then rounds of N streams opened at once, each held until every stream has received its
H chunks:

* the first round: ``rss_per_stream_kib`` is the sidecar's ``VmRSS`` with the N held,
  less the RSS before, over N (what ``make bench-streams`` reports as RSS per open
  stream, without the load's timing: repeatable to ~0.05 KiB); with tracemalloc also the
  traced heap then and its peak over the round, per stream;
* a third round after a second (the heap grown): a tracemalloc snapshot (SIGUSR1) with
  the N held, and another once they ended: the heap an open stream holds
  (``heap_per_stream_bytes``) and the ``T`` largest differences grouped by traceback and
  by line (bytes and blocks per stream). ``--keep DIR`` keeps the snapshots (and one at
  the start) for other groupings.

The heap after the streams ended also holds what a call leaves behind on purpose: with
this policy each answer is stored for its idempotency key (bounded by
``server.idempotency_max_entries`` / ``_max_bytes``), and the client's connections stay
open for reuse. tracemalloc's bookkeeping inflates the RSS: ``--frames 0`` for the RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as bench_run
from harness import Child, start
from relay_cost import serve_stand_in

PY = sys.executable
CHUNK = b'data: {"object":"chat.completion.chunk","i":%d,"choices":[{"index":0,"delta":{"content":"tok"},"finish_reason":null}]}\n\n'  # noqa: E501
LAST = (
    b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":'
    b'{"prompt_tokens":10,"completion_tokens":3,"total_tokens":13}}\n\ndata: [DONE]\n\n'
)

#: Runs the sidecar with a SIGUSR1 handler that dumps a tracemalloc snapshot to argv[1].
SIDECAR = """
import os, runpy, signal, sys, tracemalloc
out = sys.argv.pop(1)
def dump(signum, frame):
    if tracemalloc.is_tracing():
        tracemalloc.take_snapshot().dump(out + ".tmp")
    else:
        open(out + ".tmp", "w").close()
    os.replace(out + ".tmp", out)
def traced(signum, frame):  # the traced heap now and its peak since the last call
    now, peak = tracemalloc.get_traced_memory() if tracemalloc.is_tracing() else (0, 0)
    tracemalloc.reset_peak() if tracemalloc.is_tracing() else None
    with open(out + ".traced.tmp", "w") as f:
        f.write(f"{now} {peak}")
    os.replace(out + ".traced.tmp", out + ".traced")
signal.signal(signal.SIGUSR1, dump)
signal.signal(signal.SIGUSR2, traced)
sys.argv[0] = "gateway"
runpy.run_module("gateway", run_name="__main__", alter_sys=True)
"""


class StandIn:
    """The upstream: ``held`` chunks, then the stream waits for ``release``."""

    def __init__(self, held: int) -> None:
        self.held = held
        self.release = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(self.held):
            await resp.write(CHUNK % i)
        await self.release.wait()
        await resp.write(LAST)
        await resp.write_eof()
        return resp


async def _one(
    session: aiohttp.ClientSession, url: str, body: bytes, held: int, got: asyncio.Queue[int]
) -> None:
    headers = {"Accept": "text/event-stream", "Content-Type": "application/json"}
    seen, buf, told = 0, b"", False
    async with session.post(url, data=body, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {await resp.text()}")
        async for chunk in resp.content.iter_any():
            buf += chunk
            *events, buf = buf.split(b"\n\n")
            seen += sum(e.startswith(b'data: {"object"') for e in events)
            if seen >= held and not told:
                told = True
                got.put_nowait(1)


def _body(route: str, tag: str) -> bytes:
    params = {**bench_run.PARAMETERS, "stream": True, "user": tag}
    if route == "envelope":
        return json.dumps(
            {
                "trace_id": "tr-stream-memory",
                "correlation_id": tag,
                "target_system": "openai",
                "endpoint": "/v1/chat/completions",
                "method": "POST",
                "parameters": params,
                "timeout": 600,
            }
        ).encode()
    return json.dumps(params).encode()


async def _round(
    session: aiohttp.ClientSession, stand_in: StandIn, url: str, args: argparse.Namespace,
    tag: str, at_peak: Any, n: int | None = None,
) -> Any:  # fmt: skip
    """N (or ``n``) streams at once; ``at_peak()`` once all hold their chunks; then they
    end."""
    n = args.streams if n is None else n
    stand_in.release = asyncio.Event()
    got: asyncio.Queue[int] = asyncio.Queue()
    bodies = [_body(args.route, f"{tag}-{i}") for i in range(n)]
    tasks = [asyncio.ensure_future(_one(session, url, b, args.held, got)) for b in bodies]
    for _ in range(n):
        await got.get()
    peak = await at_peak()
    stand_in.release.set()
    await asyncio.gather(*tasks)
    return peak


def _snapshot(sidecar: Child, path: Path) -> None:
    path.unlink(missing_ok=True)
    os.kill(sidecar.pid, signal.SIGUSR1)


async def _wait_file(path: Path) -> None:
    for _ in range(6000):
        if await asyncio.to_thread(path.exists):
            return
        await asyncio.sleep(0.01)
    raise RuntimeError(f"no snapshot at {path}")


async def _measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    stand_in = StandIn(args.held)
    runner = await serve_stand_in(stand_in.handle, work)
    snap = work / "snapshot"
    argv = [PY, "-c", SIDECAR, str(snap), "serve", "--policy", str(work / "policy.json"),
            "--port", "0", "--ops-port", "0"]  # fmt: skip
    env = dict(os.environ)
    if args.frames:
        env["PYTHONTRACEMALLOC"] = str(args.frames)
    sidecar: Child = await asyncio.to_thread(
        start, "sidecar", argv, work, ready="calls", env=env, timeout_s=300
    )
    path = "/v1/calls" if args.route == "envelope" else "/proxy/openai/v1/chat/completions"
    url = f"http://{sidecar.address}{path}"

    async def open_snapshot() -> tuple[int, Any]:
        rss = sidecar.memory_kib()["VmRSS"]
        _snapshot(sidecar, snap)
        await _wait_file(snap)
        return rss, tracemalloc.Snapshot.load(str(snap)) if args.frames else None

    traced = Path(f"{snap}.traced")

    async def traced_now() -> tuple[int, int]:
        await asyncio.to_thread(traced.unlink, missing_ok=True)
        os.kill(sidecar.pid, signal.SIGUSR2)
        await _wait_file(traced)
        now, peak = (await asyncio.to_thread(traced.read_text)).split()
        return int(now), int(peak)

    async def rss_now() -> tuple[int, tuple[int, int]]:
        return sidecar.memory_kib()["VmRSS"], await traced_now()

    async def nothing() -> None:
        return None

    try:
        conn = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
            for w in range(2):  # imports, price data, pools: what the first calls load
                await _round(session, stand_in, url, args, f"s{w}", nothing, n=5)
            rss_start = sidecar.memory_kib()["VmRSS"]
            if args.keep is not None and args.frames:
                _, snap_start = await open_snapshot()
                await asyncio.to_thread(snap_start.dump, str(args.keep / "start.snapshot"))
            heap_start, _ = await traced_now()  # and the peak reset
            first, (heap_first, heap_peak) = await _round(
                session, stand_in, url, args, "w0", rss_now
            )
            await _round(session, stand_in, url, args, "w1", nothing)  # the heap grown
            rss_open, snap_open = await _round(session, stand_in, url, args, "m", open_snapshot)
            await asyncio.sleep(0.5)  # the streams' ends (audit records) written
            rss_after, snap_after = await open_snapshot()
    finally:
        sidecar.stop()
        await runner.cleanup()
    n = args.streams
    result: dict[str, Any] = {
        "route": args.route,
        "streams": n,
        "held_chunks": args.held,
        "frames": args.frames,
        "rss_start_kib": rss_start,
        "rss_first_open_kib": first,
        "rss_per_stream_kib": round((first - rss_start) / n, 2),
        "heap_first_open_per_stream_bytes": round((heap_first - heap_start) / n),
        "heap_peak_per_stream_bytes": round((heap_peak - heap_start) / n),
        "rss_open_kib": rss_open,
        "rss_after_kib": rss_after,
    }
    if snap_open is not None:
        filters = [tracemalloc.Filter(False, tracemalloc.__file__)]
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            snap_open.dump(str(args.keep / "open.snapshot"))
            snap_after.dump(str(args.keep / "after.snapshot"))
        snap_open = snap_open.filter_traces(filters)
        snap_after = snap_after.filter_traces(filters)
        heap = sum(s.size for s in snap_open.statistics("filename")) - sum(
            s.size for s in snap_after.statistics("filename")
        )
        result["heap_per_stream_bytes"] = round(heap / n)
        top = []
        for stat in snap_open.compare_to(snap_after, "traceback")[: args.top]:
            frames = [_where(f) for f in stat.traceback]
            top.append(
                {
                    "bytes_per_stream": round(stat.size_diff / n),
                    "blocks_per_stream": round(stat.count_diff / n, 2),
                    "where": frames[-args.show :],
                }
            )
        result["top"] = top
        by_line = []
        for stat in snap_open.compare_to(snap_after, "lineno")[: args.top]:
            by_line.append(
                f"{round(stat.size_diff / n):6} B {stat.count_diff / n:6.2f} blk "
                + _where(stat.traceback[0])
            )
        result["by_line"] = by_line
    return result


def _where(frame: tracemalloc.Frame) -> str:
    return f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--route", choices=("drop-in", "envelope"), default="drop-in")
    parser.add_argument("--streams", type=int, default=200, help="streams open at once")
    parser.add_argument("--held", type=int, default=3, help="chunks relayed before the hold")
    parser.add_argument("--frames", type=int, default=12, help="tracemalloc frames (0: off)")
    parser.add_argument("--top", type=int, default=30, help="largest differences shown")
    parser.add_argument("--show", type=int, default=4, help="innermost frames shown of each")
    parser.add_argument("--keep", type=Path, help="keep both snapshots in this directory")
    args = parser.parse_args()
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-stream-memory-") as tmp:
        result = asyncio.run(_measure(args, Path(tmp)))
    print(json.dumps(result, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
