"""Many paced streams open at once: what the sidecar adds to each (not a test).

    python bench/streams.py [--streams K] [--chunks N] [--pace-ms P] [--no-nginx]
                            [--no-litellm] [--peer-timeout-s S] [--routes drop-in,envelope]
    make bench-streams

A stand-in upstream (a child process) answers every POST with a 200 ``text/event-stream``
of N OpenAI chat chunks, P ms apart, each stamped with the stand-in's
``time.monotonic()`` (system-wide on Linux, so comparable across processes). A load
generator (another child process) opens K streams at once and records, per stream, the
time to its first chunk and, per chunk, how long after its stamp it arrived. Run against:

* the stand-in directly (the floor: the generator's and the stand-in's own delays);
* the sidecar (``python -m gateway serve``, bench/run.py's realistic policy, every
  feature on) on its drop-in route (``/proxy/openai/v1/chat/completions``) and on its
  envelope route (``POST /v1/calls`` with ``Accept: text/event-stream``);
* nginx (``proxy_buffering off``, one worker) when installed (``apt-get install nginx``);
* LiteLLM's proxy (bench/peers.py's version and config, one worker), installed into
  ``bench/.peers/`` on first use: its pass-through endpoint (bytes relayed as they are)
  and its ``/chat/completions`` (each chunk re-encoded, so no per-chunk delay), each
  run cut after ``--peer-timeout-s`` (streams not ended by then did not end well).

Reported per setup: p50/p99 time to first byte and p99 per-chunk delay, and the added
figures (the setup's p99 minus the direct p99); for the sidecar and nginx also:

* CPU per chunk over the whole run (``/proc/PID/stat``, user + system, over the run /
  the chunks received: K intakes, the relay and K stream ends together);
* the same by phase, from the process's user and system CPU read by the generator itself
  at four instants: when it starts, when every stream has had its first byte
  (``all_first``), when the first stream ends, and at the end. *Intake*: start ->
  all_first, per stream (it also holds the relaying of the ``intake_chunks`` chunks
  received meanwhile); *relay*: all_first -> end, per chunk received between (the
  target's figure: no intake in it, but the K stream ends, last event and audit record);
  *steady*: all_first -> first stream's end, per chunk received between (nothing but
  relaying; absent when a stream ended before the last one began; CPU is counted in
  ticks of 10 ms, so a window of few chunks is coarse: its chunks are printed);
* its RSS per open stream (the peak ``VmRSS`` sampled while the streams are open, minus
  the RSS before, over K; with this policy the peak also holds the answers of the
  streams that ended, stored for their idempotency keys; ``bench/stream_memory.py``
  measures held streams alone).

For nginx the CPU is its master's and worker's together. Every process shares the
machine's cores: at K=1,000, N=50, P=20 the stand-in and the
generator alone write and parse 50,000 chunks/s, so on a 2-core box the box, not the
sidecar, sets the delays (the direct row shows how much). Results go to
``bench/results/streams-<UTC time>.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers
import run as bench_run
from harness import BENCH_DIR, BenchError, Child, start
from peers import Tree, _spawn_http, family

PY = sys.executable

STAND_IN = """
import asyncio, json, sys, time
from aiohttp import web
N, PACE_S = int(sys.argv[1]), float(sys.argv[2]) / 1000
HEAD = b'data: {"object":"chat.completion.chunk","t":'
TAIL = b',"choices":[{"index":0,"delta":{"content":"tok"},"finish_reason":null}]}\\n\\n'
LAST = ("data: " + json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": N, "total_tokens": 10 + N}})
        + "\\n\\ndata: [DONE]\\n\\n").encode()
async def stream(request):
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(N - 1):
        await resp.write(HEAD + repr(time.monotonic()).encode() + TAIL)
        await asyncio.sleep(PACE_S)
    await resp.write(LAST)
    await resp.write_eof()
    return resp
async def main():
    app = web.Application()
    app.router.add_post("/{tail:.*}", stream)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
    await site.start()
    host, port = runner.addresses[0][:2]
    print(json.dumps({"listening": f"{host}:{port}"}), flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""

LOAD = """
import asyncio, json, os, re, sys, time
import aiohttp
URL, K, BODY, HEADERS = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode(), json.loads(sys.argv[4])
PIDS = [int(p) for p in sys.argv[5].split(",")]
TOTAL_S = float(sys.argv[6])  # every stream ended or cut by then: counted as not ended well
TICK = os.sysconf("SC_CLK_TCK")
STAMP = re.compile(rb'^data: [{]"object":"chat.completion.chunk","t":([0-9.]+)')
def cpu():  # the watched processes' user and system CPU seconds, read at this instant
    user = system = 0
    for pid in PIDS:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        user += int(fields[11])
        system += int(fields[12])
    return [user / TICK, system / TICK]
marks = {}
def mark(name, delays):  # CPU and chunks received so far, once per name
    if name not in marks:
        marks[name] = {"cpu_s": cpu(), "chunks": len(delays), "t": time.monotonic()}
async def one(session, ttfb, delays, ok, i):
    began = time.monotonic()
    first = None
    body = BODY.replace(b"@ID@", b"%d-%d" % (time.monotonic_ns(), i))  # never a replay
    async with session.post(URL, data=body, headers=HEADERS) as resp:
        buf = b""
        async for chunk in resp.content.iter_any():
            now = time.monotonic()
            if first is None:
                first = now - began
                ttfb.append(first)
                if len(ttfb) == K:
                    mark("all_first", delays)
            buf += chunk
            *events, buf = buf.split(b"\\n\\n")
            for event in events:
                m = STAMP.match(event)  # a relayed chunk, not the envelope's last event
                if m:
                    delays.append(now - float(m.group(1)))
        if resp.status == 200 and (b"[DONE]" in chunk or b"egress.response" in chunk):
            ok.append(1)
    mark("first_end", delays)
    if first is None:  # no first byte: it counts as the slowest (an infinite wait)
        ttfb.append(float("inf"))
async def main():
    ttfb, delays, ok = [], [], []
    conn = aiohttp.TCPConnector(limit=0)
    mark("start", delays)
    bound = aiohttp.ClientTimeout(total=TOTAL_S)
    async with aiohttp.ClientSession(connector=conn, timeout=bound) as s:
        calls = [one(s, ttfb, delays, ok, i) for i in range(K)]
        await asyncio.gather(*calls, return_exceptions=True)
    mark("end", delays)
    def pct(v, q):
        v = sorted(v)
        return v[min(len(v) - 1, int(q * len(v)))] * 1000 if v else None
    print(json.dumps({"done": True, "streams_ok": len(ok), "chunks": len(delays),
        "first_bytes": sum(1 for t in ttfb if t != float("inf")),
        "ttfb_ms": {"p50": pct(ttfb, 0.5), "p99": pct(ttfb, 0.99), "max": pct(ttfb, 1)},
        "chunk_delay_ms": {"p50": pct(delays, 0.5), "p99": pct(delays, 0.99)},
        "marks": marks}), flush=True)
asyncio.run(main())
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _nginx(upstream: str, work: Path) -> Tree:
    port = _free_port()
    conf = work / "nginx.conf"
    conf.write_text(f"""
worker_processes 1;
worker_rlimit_nofile 16384;
daemon off;
pid {work}/nginx.pid;
error_log {work}/nginx-error.log error;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  client_body_temp_path {work}/nginx-body;
  proxy_temp_path {work}/nginx-proxy;
  upstream up {{ server {upstream}; keepalive 64; }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location = /ready {{ return 200 "ok"; }}
    location / {{
      proxy_pass http://up;
      proxy_http_version 1.1;
      proxy_buffering off;
      proxy_set_header Connection "";
    }}
  }}
}}
""")
    argv = ["nginx", "-c", str(conf), "-e", str(work / "nginx-e.log")]
    return _spawn_http("nginx", argv, work, port, "/ready")


def _load(
    label: str,
    url: str,
    body: bytes,
    headers: dict[str, str],
    k: int,
    work: Path,
    watch: Child,
    total_s: float = 600.0,
) -> dict[str, Any]:
    """Run the generator once against ``url``; ``watch``'s CPU and peak RSS meanwhile.
    A stream still open after ``total_s`` seconds is cut and not counted as ended well."""
    rss0 = watch.memory_kib()["VmRSS"]
    cpu0 = watch.cpu_s()
    peak = [rss0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.02):
            try:
                peak[0] = max(peak[0], watch.memory_kib()["VmRSS"])
            except (OSError, KeyError):
                return

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    pids = ",".join(str(p) for p in sorted(family(watch.pid)))
    argv = [PY, "-c", LOAD, url, str(k), body.decode(), json.dumps(headers), pids, str(total_s)]
    gen = start(f"load-{label}", argv, work, ready="done", timeout_s=total_s + 300)
    stop.set()
    sampler.join()
    assert gen.info is not None
    result = dict(gen.info)
    del result["done"]
    result["cpu_s"] = watch.cpu_s() - cpu0
    result["rss_before_kib"] = rss0
    result["rss_peak_kib"] = peak[0]
    gen.stop()
    return result


def _sidecar(work: Path, upstream: str) -> Child:
    secret = work / "secret"
    secret.write_text(bench_run.SECRET)
    policy = bench_run.policy_for(upstream, secret, work / "audit.jsonl", "full")
    path = work / "policy.json"
    path.write_text(json.dumps(policy))
    argv = [PY, "-m", "gateway", "serve", "--policy", str(path), "--port", "0", "--ops-port", "0"]
    return start("sidecar", argv, work, ready="calls")


def _runs(args: argparse.Namespace, work: Path, stand_in: Child) -> dict[str, Any]:
    params = {**bench_run.PARAMETERS, "stream": True}
    raw = json.dumps(params).encode()
    env = json.dumps(
        {
            "trace_id": "tr-streams",
            "correlation_id": "corr-@ID@",  # the envelope route keys replays on it
            "target_system": "openai",
            "endpoint": "/v1/chat/completions",
            "method": "POST",
            "parameters": params,
            "timeout": 600,
        }
    ).encode()
    json_h = {"Content-Type": "application/json"}
    sse_h = {**json_h, "Accept": "text/event-stream"}
    k, up = args.streams, stand_in.address
    runs: dict[str, Any] = {}
    direct = f"http://{up}/v1/chat/completions"
    runs["direct"] = _load("direct", direct, raw, json_h, k, work, stand_in)
    sidecar = _sidecar(work, up)
    try:
        base = f"http://{sidecar.address}"
        for label, url, body, headers in (  # warm-up: imports, price data, pools
            ("warm-drop-in", base + "/proxy/openai/v1/chat/completions", raw, json_h),
            ("warm-envelope", base + "/v1/calls", env, sse_h),
        ):
            _load(label, url, body, headers, min(k, 20), work, sidecar)
        routes = {
            "drop-in": (base + "/proxy/openai/v1/chat/completions", raw, json_h),
            "envelope": (base + "/v1/calls", env, sse_h),
        }
        for label in args.routes:  # one sidecar, in this order (the second has a grown heap)
            url, body, headers = routes[label]
            runs[label] = _load(label, url, body, headers, k, work, sidecar)
    finally:
        sidecar.stop()
    if args.nginx and shutil.which("nginx"):
        nginx = _nginx(up, work)
        try:
            url = f"http://{nginx.address}/v1/chat/completions"
            runs["nginx"] = _load("nginx", url, raw, json_h, k, work, nginx)
        finally:
            nginx.stop()
    elif args.nginx:
        runs["nginx"] = {"skipped": "nginx is not installed (apt-get install nginx)"}
    if args.litellm:
        runs.update(_litellm_runs(args, work, up, raw, json_h))
    return runs


def _litellm_runs(
    args: argparse.Namespace, work: Path, up: str, raw: bytes, json_h: dict[str, str]
) -> dict[str, Any]:
    """LiteLLM's proxy (bench/peers.py installs it into bench/.peers/ on first use) on its
    pass-through endpoint, which relays the stand-in's bytes as they are (so each chunk's
    stamp arrives and its delay is measured), and on ``/chat/completions``, which
    re-encodes each chunk (time to first byte and streams ended well only). Each run is
    cut after ``--peer-timeout-s``: what has not ended by then did not end well."""
    why = peers.install("litellm")
    if why is not None:
        return {"litellm": {"skipped": f"LiteLLM: {why}"}}
    runs: dict[str, Any] = {}
    proxy = peers._litellm(up, work)
    try:
        base = f"http://{proxy.address}"
        auth = {**json_h, "Authorization": f"Bearer {peers.LITELLM_KEY}"}
        _load("warm-litellm", base + "/bench/chat/completions", raw, auth, 4, work, proxy)
        for label, path in (
            ("litellm-passthrough", "/bench/chat/completions"),
            ("litellm-chat", "/chat/completions"),
        ):
            runs[label] = _load(
                label, base + path, raw, auth, args.streams, work, proxy, args.peer_timeout_s
            )
    finally:
        proxy.stop()
    return runs


def _derive(runs: dict[str, Any], k: int, chunks: int) -> None:
    direct = runs["direct"]
    for label, r in runs.items():
        if label == "direct" or "skipped" in r:
            continue
        r["added_ttfb_p99_ms"] = r["ttfb_ms"]["p99"] - direct["ttfb_ms"]["p99"]
        chunk_p99 = r["chunk_delay_ms"]["p99"]  # None: no chunk kept its stamp (re-encoded)
        r["added_chunk_delay_p99_ms"] = (
            None if chunk_p99 is None else chunk_p99 - direct["chunk_delay_ms"]["p99"]
        )
        r["cpu_us_per_chunk"] = r["cpu_s"] / r["chunks"] * 1e6 if r["chunks"] else None
        r["rss_per_stream_kib"] = (r["rss_peak_kib"] - r["rss_before_kib"]) / k
        r.update(_phases(r["marks"], k))


def _phases(marks: dict[str, Any], k: int) -> dict[str, Any]:
    """CPU by phase from the generator's marks (user and system seconds, read at the mark).

    ``intake_cpu_us_per_stream``: start -> every stream's first byte, over K (it also
    holds the relaying of the ``intake_chunks`` chunks received meanwhile).
    ``relay_cpu_us_per_chunk``: every stream's first byte -> the last stream's end, over
    the chunks received between (it also holds the K streams' ends: last event, audit
    record). ``steady_cpu_us_per_chunk``: every first byte -> the first stream's end,
    nothing but relaying; absent when a stream ended before the last first byte.
    """
    out: dict[str, Any] = {}

    def span(a: str, b: str, per: float) -> dict[str, float] | None:
        if per <= 0:
            return None
        user, system = (marks[b]["cpu_s"][i] - marks[a]["cpu_s"][i] for i in (0, 1))
        return {
            "total": (user + system) / per * 1e6,
            "user": user / per * 1e6,
            "system": system / per * 1e6,
        }

    if "all_first" not in marks:  # a stream never got its first byte
        return out
    out["intake_chunks"] = marks["all_first"]["chunks"]
    out["intake_cpu_us_per_stream"] = span("start", "all_first", k)
    relayed = marks["end"]["chunks"] - marks["all_first"]["chunks"]
    out["relay_chunks"] = relayed
    out["relay_cpu_us_per_chunk"] = span("all_first", "end", relayed)
    steady = marks["first_end"]["chunks"] - marks["all_first"]["chunks"]
    if marks["first_end"]["t"] > marks["all_first"]["t"] and steady > 0:
        out["steady_chunks"] = steady
        out["steady_cpu_us_per_chunk"] = span("all_first", "first_end", steady)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000, help="streams open at once")
    parser.add_argument("--chunks", type=int, default=50, help="chunks per stream")
    parser.add_argument("--pace-ms", type=float, default=20.0, help="gap between chunks")
    parser.add_argument("--no-nginx", dest="nginx", action="store_false")
    parser.add_argument(
        "--no-litellm",
        dest="litellm",
        action="store_false",
        help="leave out LiteLLM's proxy (installed into bench/.peers/ on first use)",
    )
    parser.add_argument(
        "--peer-timeout-s",
        type=float,
        default=120.0,
        help="a peer's run is cut after this long; streams not ended by then did not end well",
    )
    parser.add_argument(
        "--routes",
        type=lambda text: text.split(","),
        default=["drop-in", "envelope"],
        help="the sidecar's routes to run, in this order (default: drop-in,envelope)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-streams-") as tmp:
        work = Path(tmp)
        argv = [PY, "-c", STAND_IN, str(args.chunks), str(args.pace_ms)]
        stand_in = start("stand-in", argv, work, ready="listening")
        try:
            runs = _runs(args, work, stand_in)
        except BenchError as exc:
            print(f"bench-streams: {exc}", file=sys.stderr)
            return 1
        finally:
            stand_in.stop()
    _derive(runs, args.streams, args.chunks)
    result = {
        "streams": args.streams,
        "chunks_per_stream": args.chunks,
        "pace_ms": args.pace_ms,
        "runs": runs,
    }
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = BENCH_DIR / "results" / f"streams-{stamp}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(_summary(result, out))
    return 0


def _summary(result: dict[str, Any], out: Path) -> str:
    lines = [
        f"{result['streams']} paced streams at once, {result['chunks_per_stream']} chunks "
        f"{result['pace_ms']:g} ms apart (targets: added p99 TTFB and per-chunk <= 50 ms, "
        "<= 25 us CPU per chunk, <= 64 KiB RSS per stream)"
    ]
    for label, r in result["runs"].items():
        if "skipped" in r:
            lines.append(f"  {label:19} skipped: {r['skipped']}")
            continue
        line = (
            f"  {label:19} ok {r['streams_ok']:5}  ttfb p50 {r['ttfb_ms']['p50']:8.1f} "
            f"p99 {r['ttfb_ms']['p99']:8.1f} ms  chunk delay p99 "
            f"{_ms(r['chunk_delay_ms']['p99'])}"
        )
        if "added_ttfb_p99_ms" in r:
            cpu = r["cpu_us_per_chunk"]
            line += (
                f"  added: ttfb p99 {r['added_ttfb_p99_ms']:+.1f} ms, chunk p99 "
                f"{_ms(r['added_chunk_delay_p99_ms'], '+')}; "
                f"{'-' if cpu is None else f'{cpu:.1f}'} us CPU/chunk, "
                f"{r['rss_per_stream_kib']:.1f} KiB RSS/stream"
            )
        lines.append(line)
        if r.get("relay_cpu_us_per_chunk"):
            lines.append("  " + " " * 19 + " " + _phase_line(r))
    lines.append(f"results: {out}")
    return "\n".join(lines)


def _ms(value: float | None, sign: str = "") -> str:
    """``value`` ms as the summary prints it; ``-`` when not measured (no stamped chunk)."""
    return "       -" if value is None else f"{value:{sign}8.1f} ms"


def _phase_line(r: dict[str, Any]) -> str:
    def cpu(d: dict[str, float]) -> str:
        return f"{d['total']:.1f} us (user {d['user']:.1f}, sys {d['system']:.1f})"

    line = (
        f"by phase: intake {cpu(r['intake_cpu_us_per_stream'])}/stream "
        f"(+{r['intake_chunks']} chunks); relay {cpu(r['relay_cpu_us_per_chunk'])}/chunk"
    )
    if "steady_cpu_us_per_chunk" in r:
        line += f"; steady {cpu(r['steady_cpu_us_per_chunk'])}/chunk over {r['steady_chunks']}"
    return line


if __name__ == "__main__":
    raise SystemExit(main())
