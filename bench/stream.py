"""The streaming relay's cost: added time to first byte and the sidecar's CPU per event.

    python bench/stream.py [--events N] [--streams K] [--ttfb-calls M]

A stand-in upstream (in this process's child, an aiohttp server) answers every POST with a
200 ``text/event-stream`` of N OpenAI chat chunks, ``[DONE]`` last, written as fast as it
can. The sidecar runs as ``python -m gateway serve`` (policy: one target, ``usage:
openai``, audit to a file). Measured from an aiohttp client in this process:

* time to first byte, c=1, M calls each: straight to the upstream, and through the
  sidecar with ``Accept: text/event-stream``; the difference of the medians (and p99s) is
  the added time to first byte (target: <= 1 ms at c=1);
* CPU per relayed event: the sidecar's utime+stime (``/proc/PID/stat``) over K streams of
  N events, divided by K*N (target: <= 20 us).

Writes ``bench/results/stream-<time>.json`` and prints a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import BENCH_DIR, Child, start

PY = sys.executable
#: The paced stand-in's stream: a model's tokens arrive over time, not in one read.
PACED_EVENTS = 10
UPSTREAM = """
import asyncio, json, sys
from aiohttp import web
N = int(sys.argv[1])
PACE_S = float(sys.argv[2]) / 1000 if len(sys.argv) > 2 else 0.0
CHUNK = ("data: " + json.dumps({"object": "chat.completion.chunk", "choices": [{"index": 0,
         "delta": {"content": "tok"}, "finish_reason": None}]}) + "\\n\\n").encode()
LAST = ("data: " + json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": N, "total_tokens": 10 + N}})
        + "\\n\\ndata: [DONE]\\n\\n").encode()
async def stream(request):
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for _ in range(N - 1):
        await resp.write(CHUNK)
        if PACE_S:
            await asyncio.sleep(PACE_S)
    await resp.write(LAST)
    await resp.write_eof()
    return resp
async def main():
    app = web.Application()
    app.router.add_post("/{tail:.*}", stream)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    print(json.dumps({"listening": f"{host}:{port}"}), flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def _policy(upstream: str, paced: str, audit: Path) -> str:
    return json.dumps(
        {
            "version": 1,
            "agent_id": "bench-stream",
            "egress": {"allow_cidrs": ["127.0.0.0/8"]},
            "audit": {"sink": "file", "path": str(audit)},
            "targets": {
                "openai": {
                    "base_url": f"http://{upstream}",
                    "endpoints": [{"path": "/v1/chat/completions", "methods": ["POST"]}],
                    "usage": "openai",
                },
                "paced": {
                    "base_url": f"http://{paced}",
                    "endpoints": [{"path": "/v1/chat/completions", "methods": ["POST"]}],
                    "usage": "openai",
                },
            },
        }
    )


ENVELOPE = {
    "trace_id": "tr-bench",
    "correlation_id": "corr-bench",
    "target_system": "openai",
    "endpoint": "/v1/chat/completions",
    "method": "POST",
    "parameters": {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
}


async def _first_byte(session: aiohttp.ClientSession, url: str, **kw: Any) -> float:
    started = time.perf_counter()
    async with session.post(url, **kw) as resp:
        await resp.content.readany()
        first = time.perf_counter() - started
        await resp.read()
    return first


async def _measure(
    args: argparse.Namespace, upstream: Child, paced: Child, sidecar: Child
) -> dict[str, Any]:
    direct = f"http://{upstream.address}/v1/chat/completions"
    via = f"http://{sidecar.address}/v1/calls"
    sse = {"Accept": "text/event-stream"}
    async with aiohttp.ClientSession() as session:
        for _ in range(50):  # warm-up: connections, caches
            await _first_byte(session, direct, json=ENVELOPE["parameters"])
            await _first_byte(session, via, json=ENVELOPE, headers=sse)
        d_ttfb, s_ttfb = [], []
        for _ in range(args.ttfb_calls):  # alternate, so drift hits both alike
            d_ttfb.append(await _first_byte(session, direct, json=ENVELOPE["parameters"]))
            s_ttfb.append(await _first_byte(session, via, json=ENVELOPE, headers=sse))
        p_direct = f"http://{paced.address}/v1/chat/completions"
        p_envelope = {**ENVELOPE, "target_system": "paced"}
        p_d, p_s = [], []
        for _ in range(args.ttfb_calls):
            p_d.append(await _first_byte(session, p_direct, json=ENVELOPE["parameters"]))
            p_s.append(await _first_byte(session, via, json=p_envelope, headers=sse))
        cpu0 = sidecar.cpu_s()
        wall0 = time.perf_counter()
        for _ in range(args.streams):
            async with session.post(via, json=ENVELOPE, headers=sse) as resp:
                raw = await resp.read()
            if b'"success":true' not in raw[-2000:]:
                raise RuntimeError(f"a stream did not end in success: {raw[-300:]!r}")
        cpu = sidecar.cpu_s() - cpu0
        wall = time.perf_counter() - wall0

    def pct(values: list[float], q: float) -> float:
        return sorted(values)[min(len(values) - 1, int(q * len(values)))] * 1000

    events = args.streams * args.events
    return {
        "events_per_stream": args.events,
        "ttfb_calls": args.ttfb_calls,
        "direct_ttfb_ms": {"p50": pct(d_ttfb, 0.5), "p99": pct(d_ttfb, 0.99)},
        "sidecar_ttfb_ms": {"p50": pct(s_ttfb, 0.5), "p99": pct(s_ttfb, 0.99)},
        "added_ttfb_ms": {
            "p50": statistics.median(s_ttfb) * 1000 - statistics.median(d_ttfb) * 1000,
            "p99": pct(s_ttfb, 0.99) - pct(d_ttfb, 0.99),
        },
        "paced": {
            "events_per_stream": PACED_EVENTS,
            "pace_ms": args.pace_ms,
            "direct_ttfb_ms": {"p50": pct(p_d, 0.5), "p99": pct(p_d, 0.99)},
            "sidecar_ttfb_ms": {"p50": pct(p_s, 0.5), "p99": pct(p_s, 0.99)},
            "added_ttfb_ms": {
                "p50": statistics.median(p_s) * 1000 - statistics.median(p_d) * 1000,
                "p99": pct(p_s, 0.99) - pct(p_d, 0.99),
            },
        },
        "streams": args.streams,
        "events": events,
        "cpu_us_per_event": cpu / events * 1e6,
        "events_per_s": events / wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200, help="events per stream")
    parser.add_argument("--streams", type=int, default=300, help="streams for the CPU figure")
    parser.add_argument("--ttfb-calls", type=int, default=300, help="calls per TTFB sample")
    parser.add_argument("--pace-ms", type=float, default=1.0, help="gap between paced events")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-stream-") as tmp:
        workdir = Path(tmp)
        script = workdir / "upstream.py"
        script.write_text(UPSTREAM)
        upstream = start(
            "upstream", [PY, str(script), str(args.events)], workdir, ready="listening"
        )
        paced = start(
            "paced", [PY, str(script), str(PACED_EVENTS), str(args.pace_ms)], workdir,
            ready="listening",
        )  # fmt: skip
        sidecar = None
        try:
            policy = workdir / "policy.json"
            policy.write_text(_policy(upstream.address, paced.address, workdir / "audit.jsonl"))
            argv = [PY, "-m", "gateway", "serve", "--policy", str(policy), "--port", "0"]
            sidecar = start("sidecar", [*argv, "--ops-port", "0"], workdir, ready="calls")
            result = asyncio.run(_measure(args, upstream, paced, sidecar))
        finally:
            if sidecar is not None:
                sidecar.stop()
            upstream.stop()
            paced.stop()
    out = BENCH_DIR / "results" / f"stream-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    added, paced_added = result["added_ttfb_ms"], result["paced"]["added_ttfb_ms"]
    print(
        f"streaming relay, {args.events} events per stream:\n"
        f"  added time to first byte at c=1, paced upstream ({PACED_EVENTS} events "
        f"{args.pace_ms:g} ms apart): p50 {paced_added['p50']:.3f} ms, "
        f"p99 {paced_added['p99']:.3f} ms   (target p50 <= 1 ms)\n"
        f"  the same, {args.events} events written at once: p50 {added['p50']:.3f} ms, "
        f"p99 {added['p99']:.3f} ms\n"
        f"  sidecar CPU per relayed event:   {result['cpu_us_per_event']:.1f} us "
        f"  (target <= 20 us; {result['events_per_s']:.0f} events/s at c=1)\n"
        f"results: {out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
