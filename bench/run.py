"""Benchmark of the sidecar hop: throughput, added latency, CPU and memory (not a test).

    python bench/run.py [--quick] [--duration S] [--soak-calls N] [--soak-budget-s S]
                        [--no-features] [--no-soak]
    make bench

Starts on loopback, each in its own process: a fast local upstream (bench/upstream.py,
an OpenAI-style JSON answer with usage), a minimal aiohttp pass-through proxy
(bench/passthrough.py, the baseline, on the same event loop as the sidecar) and the
sidecar itself as ``python -m gateway serve`` with a realistic policy (allowlist,
rate-limit group with headroom and a token budget, circuit breaker, a file:// secret,
idempotency on POST, audit records to a rotating file, OpenAI usage parsing). wrk (from
the Debian package) is the load generator; every envelope carries its own
correlation_id, so every call derives a new idempotency key and the store fills up.

Measured in one run: requests/s at 16 and 64 connections; latency p50/p99 at 1 and 16
connections for direct calls, the pass-through and the sidecar (added latency = the
difference with direct); sidecar CPU per call (``/proc/PID/stat``) and peak RSS
(``VmHWM``); the cost of each feature (a fresh sidecar per policy variant); RSS after
10 thousand calls vs after up to 1 million (``--soak-calls``, stopped at
``--soak-budget-s``; the JSON says how far it got). Results go to
``bench/results/<UTC timestamp>.json``; a short table is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import BENCH_DIR, BenchError, Child, LoadResult, start, wrk
from report import summarise, table

PY = sys.executable
SECRET = "sk-bench-" + "x" * 40  # a fake key: the upstream accepts anything
PARAMETERS = {
    "model": "gpt-4o-mini",
    "messages": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is the capital of France? One sentence."},
    ],
    "max_tokens": 64,
    "temperature": 0,
}
SOAK_CHECKPOINTS = (10_000, 50_000, 100_000, 250_000, 500_000, 750_000, 1_000_000)

#: Policy variants for the feature costs: name -> (what is off, how to change the policy).
FEATURES: dict[str, str] = {
    "full": "everything on (the realistic policy)",
    "audit_devnull": "audit records rendered but written to /dev/null",
    "audit_chain": "audit hash chain ON (extra: the example policy uses it)",
    "no_idempotency": "no idempotency block",
    "no_ratelimit": "no rate-limit group",
    "no_breaker": "circuit_breaker: null",
    "no_usage": "usage: none (no token parsing)",
    "minimal": "all of the above off (audit to /dev/null)",
    "cluster_group": "the rate-limit group with scope: cluster on Redis 127.0.0.1:6379",
}

#: Request headers a variant's calls carry. ``controls`` (bench/instructions.py only, not
#: a feature of the load run, whose calls carry no token): ``minimal`` with every agent
#: control on (identity by token, signed chain, stop switch, repeated-call breaker, an
#: approval rule that does not match, a fallback).
VARIANT_HEADERS: dict[str, dict[str, str]] = {
    "controls": {"x-egress-agent-token": "bench-agent-token"},
}
#: The controls of the ``controls`` variant one can leave out: ``controls-no-NAME``
#: (bench/instructions.py) is ``controls`` less that one, what it costs is the difference
#: (the stop switch is always on).
CONTROLS: tuple[str, ...] = ("identity", "chain", "repeats", "approval", "fallback")
for _name in CONTROLS:
    VARIANT_HEADERS[f"controls-no-{_name}"] = (
        {} if _name == "identity" else VARIANT_HEADERS["controls"]
    )


def policy_for(upstream: str, secret_file: Path, audit_file: Path, variant: str) -> dict[str, Any]:
    target: dict[str, Any] = {
        "base_url": f"http://{upstream}",
        "credential": {
            "header": "Authorization",
            "format": "Bearer {secret}",
            "default_ref": f"file://{secret_file}",
            "allowed_refs": [f"file://{secret_file}"],
        },
        "endpoints": [
            {"path": "/v1/chat/completions", "methods": ["POST"]},
            {"path": "/v1/models/*", "methods": ["GET"]},
        ],
        "rate_limit_group": "llm",
        "timeout_s": 30,
        "retry": {"max_retries": 2, "backoff_base_s": 0.05, "backoff_max_s": 1},
        "circuit_breaker": {"fail_max": 5, "reset_timeout_s": 30},
        "usage": "openai",
        "idempotency": {"header": "Idempotency-Key", "methods": ["POST"], "ttl_s": 86400},
    }
    audit: dict[str, Any] = {
        "sink": "file",
        "path": str(audit_file),
        "payloads": "summary",
        "chain": False,
        "max_bytes": 64 * 1024 * 1024,  # bounded disk during the 1M-call soak
        "backup_count": 1,
    }
    policy: dict[str, Any] = {
        "version": 1,
        "agent_id": "bench-agent",
        "server": {"host": "127.0.0.1", "ops_host": "127.0.0.1"},
        "egress": {"allow_cidrs": ["127.0.0.0/8"]},  # the upstream is on loopback
        "targets": {"openai": target},
        "rate_limit_groups": {
            # Headroom: far above what two cores can drive, so nothing ever waits.
            "llm": {
                "requests_per_second": 100_000,
                "burst": 100_000,
                "tokens_per_minute": 1_000_000_000,
                "max_queue_s": 5,
            }
        },
        "audit": audit,
    }
    without = variant.removeprefix("controls-no-") if variant.startswith("controls-no-") else None
    if without is not None:
        if without not in CONTROLS:
            raise ValueError(f"unknown control {without!r} (one of {', '.join(CONTROLS)})")
        variant = "controls"
    if variant in ("audit_devnull", "minimal", "controls"):
        audit.update(path="/dev/null", max_bytes=None)
    if variant == "audit_chain":
        audit["chain"] = True
    if variant in ("no_idempotency", "minimal", "controls"):
        del target["idempotency"]
    if variant in ("no_ratelimit", "minimal", "controls"):
        del target["rate_limit_group"]
        policy["rate_limit_groups"] = {}
    if variant in ("no_breaker", "minimal", "controls"):
        target["circuit_breaker"] = None
    if variant in ("no_usage", "minimal", "controls"):
        target["usage"] = "none"
    if variant == "cluster_group":
        # One Lua script per admission on the local Redis (docs/cluster.md); a private
        # key prefix so runs do not share buckets.
        policy["rate_limit_groups"]["llm"]["scope"] = "cluster"
        policy["redis"] = {
            "url": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
            "key_prefix": f"egw-bench-{os.getpid()}",
        }
    if variant == "controls":
        _with_controls(policy, target, secret_file, without)
    return policy


def _with_controls(
    policy: dict[str, Any], target: dict[str, Any], secret_file: Path, without: str | None = None
) -> None:
    """The agent controls of the ``controls`` variant, none of which refuses the bench's
    calls: identity by token (``VARIANT_HEADERS``), chains signed with the fleet's key,
    the repeated-call breaker (its cap far above the calls of a run), an approval rule
    for another endpoint and a fallback target (the same upstream). The stop switch is
    always on (local). ``without``: a name of :data:`CONTROLS` left out."""
    token = secret_file.with_name("agent-token")
    token.write_text(VARIANT_HEADERS["controls"]["x-egress-agent-token"] + "\n")
    chain_key = secret_file.with_name("chain-key")
    chain_key.write_text("bench-chain-signing-key-0123456789abcdef\n")
    if without != "identity":
        policy["agents"] = {"bench-agent": {"token_ref": f"file://{token}"}}
    if without != "chain":
        policy["chain"] = {"signing_key_ref": f"file://{chain_key}"}
    if without != "repeats":
        policy["controls"] = {"repeated_calls": {"max_repeats": 10_000, "window_s": 1}}
    policy["operators"] = {"bench-operator": {"token_ref": f"file://{token}"}}
    if without != "approval":
        target["approval"] = {"endpoints": [{"path": "/v1/files/*", "methods": ["DELETE"]}]}
    if without != "fallback":
        target["fallbacks"] = [{"target": "openai_b"}]
        policy["targets"]["openai_b"] = {**target, "fallbacks": []}


def envelope_template() -> str:
    envelope = {
        "trace_id": "bench-trace",
        "correlation_id": "@ID@",
        "target_system": "openai",
        "endpoint": "/v1/chat/completions",
        "method": "POST",
        "parameters": PARAMETERS,
        "timeout": 10.0,
        "max_retries": 2,
        "metadata": {"task": "benchmark"},
    }
    return json.dumps(envelope, separators=(",", ":"))


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.children: list[Child] = []
        self.seq = 0
        self.tag = f"{int(time.time())}{os.getpid()}"
        self.envelope = workdir / "envelope.json"
        self.envelope.write_text(envelope_template())
        self.raw = workdir / "parameters.json"
        self.raw.write_text(json.dumps(PARAMETERS, separators=(",", ":")))
        self.secret_file = workdir / "openai-key"
        self.secret_file.write_text(SECRET + "\n")
        self.upstream: Child | None = None

    def prefix(self) -> str:
        self.seq += 1
        return f"{self.tag}-{self.seq}"

    def spawn(self, name: str, argv: list[str], ready: str) -> Child:
        child = start(name, argv, self.workdir, ready=ready)
        self.children.append(child)
        return child

    def sidecar(self, variant: str, name: str) -> Child:
        assert self.upstream is not None
        policy = policy_for(
            self.upstream.address, self.secret_file, self.workdir / f"{name}-audit.jsonl", variant
        )
        path = self.workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(policy, sort_keys=False))
        argv = [PY, "-m", "gateway", "serve", "--policy", str(path), "--port", "0"]
        argv += ["--ops-port", "0"]
        child = self.spawn(name, argv, ready="calls")
        check_call(child, tokens=32 if policy["targets"]["openai"]["usage"] != "none" else None)
        child.idle_memory = child.memory_kib()  # after its first call, before any load
        return child

    def load(
        self,
        label: str,
        url: str,
        concurrency: int,
        duration_s: float,
        watch: list[Child],
        *,
        raw: bool = False,
        stop_after: int | None = None,
    ) -> LoadResult:
        return wrk(
            label,
            url,
            self.raw if raw else self.envelope,
            prefix=self.prefix(),
            concurrency=concurrency,
            duration_s=duration_s,
            watch=watch,
            stop_after=stop_after,
        )

    def stop(self, child: Child) -> None:
        child.stop()
        self.children.remove(child)

    def close(self) -> None:
        for child in reversed(self.children):
            child.stop()
        self.children.clear()


def check_call(sidecar: Child, *, tokens: int | None) -> None:
    """One call through the sidecar must succeed (with the upstream's usage, if parsed)."""
    body = envelope_template().replace("@ID@", "bench-check").encode()
    req = urllib.request.Request(f"http://{sidecar.address}/v1/calls", data=body, method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310
        doc = json.loads(resp.read())
    if not doc.get("success") or doc.get("tokens_used") != tokens:
        raise BenchError(f"{sidecar.name}: unexpected answer {json.dumps(doc)[:300]}")


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    bench = Bench(args, workdir)
    d = args.duration
    try:
        bench.upstream = up = bench.spawn(
            "upstream", [PY, str(BENCH_DIR / "upstream.py")], "listening"
        )
        sidecar = bench.sidecar("full", "sidecar")
        loop = (sidecar.info or {}).get("loop", "asyncio")
        passthrough = bench.spawn(
            "passthrough",
            [PY, str(BENCH_DIR / "passthrough.py"), "--loop", loop, "--upstream",
             f"http://{up.address}/v1/chat/completions"],
            "listening",
        )  # fmt: skip
        direct_url = f"http://{up.address}/v1/chat/completions"
        pt_url = f"http://{passthrough.address}/v1/calls"
        sc_url = f"http://{sidecar.address}/v1/calls"
        # The drop-in route: an SDK's own request body, straight to /proxy/{target}/...
        proxy_url = f"http://{sidecar.address}/proxy/openai/v1/chat/completions"
        setups = {
            "direct": (direct_url, [up], True),
            "passthrough": (pt_url, [passthrough, up], False),
            "sidecar": (sc_url, [sidecar, up], False),
            "proxy": (proxy_url, [sidecar, up], True),
        }
        for name, (url, watch, raw) in setups.items():  # warm-up: connections, caches
            bench.load(f"warmup-{name}", url, 16, max(d / 3, 1), watch, raw=raw)
        main: list[dict[str, Any]] = []
        for conc in (1, 16, 64):
            for name, (url, watch, raw) in setups.items():
                res = bench.load(name, url, conc, d, watch, raw=raw)
                main.append(res.as_json())
                print(f"  {name:12s} c={conc:<3d} {res.rps:9.0f} req/s  "
                      f"p50 {res.latency_us['p50']:7.0f} us  p99 {res.latency_us['p99']:7.0f} us",
                      flush=True)  # fmt: skip
        sidecar_memory = sidecar.memory_kib()
        bench.stop(passthrough)
        bench.stop(sidecar)

        features: list[dict[str, Any]] = []
        if not args.no_features:
            for variant, what in FEATURES.items():
                child = bench.sidecar(variant, f"sidecar-{variant}")
                url = f"http://{child.address}/v1/calls"
                bench.load("warmup", url, 16, max(d / 3, 1), [child, up])
                c16 = bench.load(variant, url, 16, d, [child, up])
                c1 = bench.load(variant, url, 1, d, [child, up])
                features.append(
                    {"variant": variant, "off": what, "c16": c16.as_json(), "c1": c1.as_json()}
                )
                cpu = c16.cpu_us_per_call(child.name) or 0
                print(
                    f"  feature {variant:15s} {c16.rps:7.0f} req/s  {cpu:6.0f} us CPU/call",
                    flush=True,
                )
                bench.stop(child)

        soak: dict[str, Any] = {"skipped": True}
        if not args.no_soak:
            soak = run_soak(bench, args)
        return {
            "main": main,
            "sidecar_memory_kib": sidecar_memory,
            "sidecar_idle_memory_kib": sidecar.idle_memory,
            "loop": loop,
            "features": features,
            "soak": soak,
        }
    finally:
        bench.close()


def run_soak(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    """A fresh sidecar; calls in chunks up to each checkpoint, RSS after each."""
    assert bench.upstream is not None
    child = bench.sidecar("full", "sidecar-soak")
    url = f"http://{child.address}/v1/calls"
    points: list[dict[str, Any]] = []
    total = 0
    started = time.monotonic()
    stopped = "completed"
    try:
        for checkpoint in (c for c in SOAK_CHECKPOINTS if c <= args.soak_calls):
            elapsed = time.monotonic() - started
            if elapsed > args.soak_budget_s:
                stopped = f"time budget of {args.soak_budget_s:.0f} s reached"
                break
            try:
                res = bench.load(
                    "soak", url, 16, 3600, [child, bench.upstream], stop_after=checkpoint - total
                )
            except BenchError as exc:
                stopped = f"error: {exc}"
                break
            total += res.requests
            mem = child.memory_kib()
            points.append({
                "calls": total,
                "rss_kib": mem["VmRSS"],
                "hwm_kib": mem["VmHWM"],
                "rps": round(res.rps, 1),
                "cpu_us_per_call": round(res.cpu_us_per_call(child.name) or 0, 1),
                "non_2xx": res.errors.get("status", 0),
                "elapsed_s": round(time.monotonic() - started, 1),
            })  # fmt: skip
            print(f"  soak {total:>9,d} calls  RSS {mem['VmRSS'] / 1024:6.1f} MiB  "
                  f"{res.rps:6.0f} req/s", flush=True)  # fmt: skip
    finally:
        bench.stop(child)
    return {"target_calls": args.soak_calls, "stopped": stopped, "points": points}


def meta(args: argparse.Namespace) -> dict[str, Any]:
    def version(mod: str) -> str | None:
        try:
            return str(__import__(mod).__version__)
        except (ImportError, AttributeError):
            return None

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False,
        cwd=BENCH_DIR.parent,
    ).stdout.strip()  # fmt: skip
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
        text=True, check=False, cwd=BENCH_DIR.parent,
    ).stdout.strip()  # fmt: skip
    if commit and dirty:
        commit += "+uncommitted"  # the tree measured is not that commit
    wrk_v = subprocess.run(["wrk", "-v"], capture_output=True, text=True, check=False)
    return {
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": commit or None,
        "python": platform.python_version(),
        "aiohttp": version("aiohttp"),
        "uvloop": version("uvloop"),
        "orjson": version("orjson"),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "wrk": (wrk_v.stdout + wrk_v.stderr).splitlines()[0] if wrk_v.returncode < 2 else None,
        "quick": args.quick,
        "duration_s": args.duration,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 s runs, 50k-call soak")
    parser.add_argument("--duration", type=float, help="seconds per measured run (default 10)")
    parser.add_argument("--soak-calls", type=int, help="calls in the soak (default 1,000,000)")
    parser.add_argument("--soak-budget-s", type=float, default=1500.0,
                        help="stop the soak after this many seconds (default 1500)")  # fmt: skip
    parser.add_argument("--no-features", action="store_true", help="skip the feature costs")
    parser.add_argument("--no-soak", action="store_true", help="skip the soak")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results")
    args = parser.parse_args()
    args.duration = args.duration or (3.0 if args.quick else 10.0)
    args.soak_calls = args.soak_calls or (50_000 if args.quick else 1_000_000)
    if shutil.which("wrk") is None:
        print("wrk is not installed: apt-get install -y wrk", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="egw-bench-"))
    try:
        results = {"meta": meta(args), **run(args, workdir)}
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    finally:
        if not os.environ.get("BENCH_KEEP"):
            shutil.rmtree(workdir, ignore_errors=True)
    results["summary"] = summarise(results)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.out / f"{stamp}.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print()
    print(table(results))
    print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
