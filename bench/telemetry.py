"""What tracing costs a call: ``Pipeline.handle`` in-process, tracing off and on.

    python bench/telemetry.py [--calls N] [--rounds R] [--tracing]

Two call shapes, each N calls per round, R rounds (the best round's median is reported,
so a busy machine's noise stays out of it):

* ``denied``: an envelope for a target the policy does not know: intake, the egress
  decision, the audit record and metrics, no I/O; it measures the per-call hooks
  (``begin``/``end``) against the rest of a call's fixed cost;
* ``forwarded``: a POST through the whole pipeline (rate-limit group, env:// secret, one
  attempt) to a loopback aiohttp upstream in the same process; it adds the limiter,
  secret and attempt hooks.

With ``--tracing`` the spans are exported (sampled 100%) to a loopback OTLP/HTTP
receiver that answers 200 (another process). Run it against another checkout
(``PYTHONPATH=/path/to/other``) for a before/after comparison with tracing off.
Prints one JSON line per shape: wall microseconds per call (the median of the best round)
and the process's CPU microseconds per call (the best round; the upstream's share, the
same in every run, included), which a busy machine disturbs less.
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import aiohttp.web

from gateway.policy import PolicySet, parse_policy
from gateway.server.runtime import Gateway


class _Receiver(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *_: Any) -> None:
        return None


def _policy(url: str) -> PolicySet:
    text = json.dumps(
        {
            "version": 1,
            "agent_id": "bench",
            "egress": {"allow_cidrs": ["127.0.0.0/8"]},
            "audit": {"sink": "file", "path": os.devnull},
            "targets": {
                "llm": {
                    "base_url": url,
                    "credential": {"header": "Authorization", "format": "Bearer {secret}",
                                   "default_ref": "env://BENCH_KEY"},
                    "endpoints": [{"path": "/v1/chat/completions", "methods": ["POST"]}],
                    "rate_limit_group": "llm",
                    "usage": "openai",
                }
            },
            "rate_limit_groups": {"llm": {"requests_per_second": 100000, "burst": 100000}},
        }
    )  # fmt: skip
    return PolicySet.compile(parse_policy(text, "bench.yaml"))


def _envelope(target: str, i: int) -> bytes:
    return json.dumps(
        {
            "trace_id": f"bench-{i}",
            "correlation_id": f"c-{i}",
            "target_system": target,
            "endpoint": "/v1/chat/completions",
            "method": "POST",
            "parameters": {"model": "m-1", "messages": [{"role": "user", "content": "hi"}]},
        }
    ).encode()


async def _upstream() -> tuple[aiohttp.web.AppRunner, str]:
    answer = {"model": "m-1-0613", "usage": {"prompt_tokens": 3, "completion_tokens": 1}}

    async def chat(_: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response(answer)

    app = aiohttp.web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = aiohttp.web.AppRunner(app, access_log=None)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def main(calls: int, rounds: int) -> None:
    os.environ["BENCH_KEY"] = "sk-bench-not-a-secret"
    runner, url = await _upstream()
    gateway = Gateway(_policy(url), log_stream=open(os.devnull, "w"))  # noqa: SIM115, ASYNC230
    await gateway.start()
    pipeline = gateway.pipeline
    assert pipeline is not None
    tracing = bool(getattr(getattr(pipeline, "tracer", None), "enabled", False))
    for shape, target in (("denied", "nowhere"), ("forwarded", "llm")):
        for i in range(200):  # warm up
            await pipeline.handle(_envelope(target, i))
        medians, cpus = [], []
        for _ in range(rounds):
            times = []
            cpu = time.process_time()
            for i in range(calls):
                body = _envelope(target, i)
                started = time.perf_counter()
                status, _ = await pipeline.handle(body)
                times.append(time.perf_counter() - started)
            cpus.append((time.process_time() - cpu) / calls)
            assert status in (200, 403), status
            medians.append(statistics.median(times))
        result = {
            "shape": shape,
            "tracing": tracing,
            "us_per_call": round(min(medians) * 1e6, 2),
            "cpu_us_per_call": round(min(cpus) * 1e6, 2),
        }
        print(json.dumps(result))
    await gateway.aclose()
    await runner.cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tracing", action="store_true")
    parser.add_argument("--receiver", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receiver:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
        print(server.server_port, flush=True)
        server.serve_forever()
    receiver = None
    if args.tracing:
        # The receiver is another process: its CPU is not the sidecar's.
        receiver = subprocess.Popen(
            [sys.executable, __file__, "--receiver"], stdout=subprocess.PIPE, text=True
        )
        assert receiver.stdout is not None
        port = int(receiver.stdout.readline())
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{port}"
        os.environ["OTEL_TRACES_SAMPLER"] = "always_on"
    else:
        for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
            os.environ.pop(name, None)
    try:
        asyncio.run(main(args.calls, args.rounds))
    finally:
        if receiver is not None:
            receiver.terminate()
            receiver.wait()
