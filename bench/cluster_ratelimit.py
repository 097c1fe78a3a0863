"""Benchmark: the cost of a cluster-scope admission (Redis round trips and latency).

    /work/venv/bin/python bench/cluster_ratelimit.py [--calls N] [--concurrency C]

Starts a private ``redis-server`` on a free loopback port, admits N calls through a
:class:`gateway.ratelimit.cluster.ClusterRateLimitGroup` whose limits never bind (C at a
time), once without and once with a token budget (each call then also reconciles its
usage), and prints, from the server's own ``INFO commandstats``, the commands the client
sent per call, with the admission latency percentiles. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.policy import RateLimitGroupSpec, RedisSpec
from gateway.ratelimit.cluster import ClusterLimits
from gateway.stores.redis import RedisClient

#: Commands that only run inside the Lua scripts (not round trips).
SCRIPT_INTERNAL = {"time", "get", "set", "del", "hmget", "hget", "hset", "pexpire"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def run(url: str, calls: int, concurrency: int, tokens: bool) -> list[float]:
    spec = RateLimitGroupSpec(
        requests_per_second=100_000,
        burst=100_000,
        tokens_per_minute=10**9 if tokens else None,
        scope="cluster",
    )
    client = RedisClient(RedisSpec(key_prefix="bench", pool_size=concurrency), url=url)
    limits = ClusterLimits(client)
    group = limits.group("bench", spec)
    latencies: list[float] = []
    gate = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with gate:
            started = time.perf_counter()
            await group.acquire(tokens=100 if tokens else 0, deadline=1e12)
            latencies.append(time.perf_counter() - started)
            if tokens:
                group.reconcile(100, 60)

    await group.acquire(deadline=1e12)  # connect and load the script before measuring
    if tokens:
        group.reconcile(100, 60)
    await limits.aclose()
    latencies.clear()
    admin = redis.Redis.from_url(url)
    admin.config_resetstat()
    await asyncio.gather(*(one() for _ in range(calls)))
    await limits.aclose()
    stats = admin.info("commandstats")
    admin.close()
    await client.aclose()
    sent = {
        name.removeprefix("cmdstat_"): int(v["calls"])
        for name, v in stats.items()
        if name.removeprefix("cmdstat_") not in SCRIPT_INTERNAL
    }
    sent.pop("info", None)
    sent.pop("config|resetstat", None)
    label = "with tokens_per_minute" if tokens else "requests only"
    print(f"{label}: {calls} calls, client commands per call:")
    for name, count in sorted(sent.items()):
        print(f"  {name:14s} {count / calls:.3f}")
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server is not on PATH")
    port = free_port()
    with tempfile.TemporaryDirectory() as workdir:
        server = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", workdir],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            url = f"redis://127.0.0.1:{port}/0"
            admin = redis.Redis.from_url(url)
            for _ in range(200):
                try:
                    admin.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.01)
            admin.close()
            for tokens in (False, True):
                lat = asyncio.run(run(url, args.calls, args.concurrency, tokens))
                q = statistics.quantiles(lat, n=100)
                print(f"  admission latency p50 {q[49] * 1e3:.3f} ms, p99 {q[98] * 1e3:.3f} ms")
        finally:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
