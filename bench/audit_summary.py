"""Benchmark: ``audit summary`` over a generated log of 1,000,000 call records.

    /work/venv/bin/python bench/audit_summary.py [--records N] [--keep]

Writes N records shaped like the writer's (every AuditRecord field, chained-size lines)
to a temporary file, then times ``python -m gateway.audit.query summary FILE --format json``
in a child process pinned to one core, and prints records/s and the child's peak RSS.
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

AGENTS = [f"agent-{i:02d}" for i in range(8)]
TARGETS = ["openai", "anthropic", "gemini", "slack", "github", "internal_db"]
CODES = ["CAPACITY_EXCEEDED", "DEPENDENCY_FAILED", "CIRCUIT_OPEN", "AGENT_TIMEOUT"]


def generate(path: Path, count: int, seed: int = 1) -> None:
    rng = random.Random(seed)
    start = datetime(2025, 1, 1, tzinfo=UTC)
    with path.open("w") as out:
        for n in range(count):
            ok = rng.random() > 0.1
            when = start + timedelta(milliseconds=n * 7)
            record = {
                "agent_id": AGENTS[n % len(AGENTS)],
                "trace_id": f"trace-{n // 5:08d}",
                "correlation_id": f"corr-{n:09d}",
                "target_system": TARGETS[n % len(TARGETS)],
                "endpoint": "/v1/chat/completions",
                "method": "POST",
                "upstream": "https://api.example.com:443",
                "decision": "allowed",
                "success": ok,
                "status_code": 200 if ok else 503,
                "error_code": None if ok else CODES[n % len(CODES)],
                "retryable": None if ok else True,
                "attempts": rng.choice((1, 1, 1, 2, 3)),
                "latency_ms": round(rng.lognormvariate(4.0, 0.8), 3),
                "upstream_latency_ms": round(rng.uniform(5, 400), 3),
                "tokens_used": 300,
                "tokens_input": 200,
                "tokens_output": 100,
                "tokens_cached": 0,
                "request_bytes": 1234,
                "request_sha256": f"{n:064x}",
                "response_bytes": 4321,
                "api_key_ref": "vault://openai-key",
                "rate_limit_group": "llm",
                "rate_limit_wait_ms": 12.5 if n % 9 == 0 else 0.0,
                "idempotency_key": None,
                "replayed": False,
                "warnings": [],
                "metadata": {},
                "audit_schema": 1,
                "sidecar_id": "bench:1",
                "event": "egress_call",
                "level": "info" if ok else "warning",
                "timestamp": when.isoformat().replace("+00:00", "Z"),
                "seq": n + 1,
                "prev_hash": "0" * 64,
                "hash": "f" * 64,
            }
            out.write(json.dumps(record, separators=(",", ":")) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--keep", action="store_true", help="keep the generated file")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="audit-bench-"))
    path = folder / "audit.log"
    began = time.perf_counter()
    generate(path, args.records)
    size_mb = path.stat().st_size / 1e6
    print(
        f"generated {args.records:,} records, {size_mb:.0f} MB, "
        f"in {time.perf_counter() - began:.1f} s"
    )
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # the child inherits it
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "gateway.audit.query", "summary", str(path), "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    elapsed = time.perf_counter() - began
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # KiB on Linux
    calls = json.loads(done.stdout)["total"]["calls"]
    assert calls == args.records, calls
    print(
        f"summary: {elapsed:.2f} s, {args.records / elapsed:,.0f} records/s on one core, "
        f"peak RSS {peak_mb:.0f} MiB"
    )
    if args.keep:
        print(f"kept {path}")
    else:
        path.unlink()
        folder.rmdir()


if __name__ == "__main__":
    main()
