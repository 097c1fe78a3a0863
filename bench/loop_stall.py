"""The event loop's longest stall while one worst-case envelope is handled (not a test).

    python bench/loop_stall.py [--size-mib 1] [--rounds 3] [CASE ...]

The timing half of tests/test_bounded_work.py, which counts the work instead (function
calls, whatever the machine's speed): a real sidecar (``gateway.server``) on loopback in
this process, a recording upstream, and for each worst-case envelope of the test
(``--size-mib`` MiB, the policy's ``server.max_request_bytes``) a heartbeat task that
wakes every 5 ms and records the gaps while the envelope is answered. Prints, per case,
the longest gap of the best and of the worst round in milliseconds, one JSON line each.
On a shared machine the figures move with the load: compare runs made side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aiohttp import web  # noqa: E402

from gateway.server import create_app  # noqa: E402
from gateway.server.runtime import Gateway  # noqa: E402
from tests.conftest import SidecarServer, compile_policy, envelope, openai_target  # noqa: E402
from tests.test_bounded_work import WORST, _worst  # noqa: E402


async def _longest_stall(call: Any) -> float:
    gaps: list[float] = []
    stop = asyncio.Event()

    async def heartbeat() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    beat = asyncio.create_task(heartbeat())
    await asyncio.sleep(0.02)
    await call
    stop.set()
    await beat
    return max(gaps)


async def _case(case: str, size: int, rounds: int) -> dict[str, Any]:
    async def ok(_: web.Request) -> web.StreamResponse:
        return web.json_response({"ok": True})

    upstream_app = web.Application()
    upstream_app.router.add_route("*", "/{tail:.*}", ok)
    upstream = SidecarServer(upstream_app, host="127.0.0.1")
    await upstream.start_server()
    policy = compile_policy(
        {"fake-openai": openai_target(f"http://127.0.0.1:{upstream.port}")},
        server={"max_request_bytes": size},
        envelope={"unknown_fields": "warn" if case.endswith("-warn") else "reject"},
    )
    gateway = Gateway(policy, log_stream=io.StringIO())  # the audit records: not printed
    sidecar = SidecarServer(create_app(gateway), host="127.0.0.1")
    await sidecar.start_server()
    body = _worst(size)[case][0]
    url = f"http://127.0.0.1:{sidecar.port}/v1/calls"
    headers = {"Content-Type": "application/json"}
    stalls: list[float] = []
    try:
        import aiohttp  # the benchmark's own client

        async with aiohttp.ClientSession() as session:

            async def call(data: bytes) -> None:
                async with session.post(url, data=data, headers=headers) as resp:
                    await resp.read()

            await call(json.dumps(envelope()).encode())  # warm: imports, connections
            for _ in range(rounds):
                stalls.append(await _longest_stall(call(body)))
    finally:
        await sidecar.close()
        await upstream.close()
    return {
        "case": case,
        "bytes": len(body),
        "best_ms": round(min(stalls) * 1000, 1),
        "worst_ms": round(max(stalls) * 1000, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("cases", nargs="*", default=list(WORST))
    args = parser.parse_args()
    size = int(args.size_mib * 1024 * 1024)
    os.environ.setdefault("TEST_OPENAI_KEY", "sk-fake-TEST-0001-NOTREAL")  # the tests' target
    for case in args.cases:
        print(json.dumps(asyncio.run(_case(case, size, args.rounds))), flush=True)


if __name__ == "__main__":
    main()
