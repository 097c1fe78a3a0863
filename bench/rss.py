"""Resident memory of an idle sidecar (docs/performance.md, "Memory"; not a test).

    PYTHONPATH=$PWD python bench/rss.py [--variants minimal,full] [--runs 3]

For each of bench/run.py's policy variants, a real ``python -m gateway serve`` against
bench/upstream.py (each in its own process): ``VmRSS`` 2 s after it reported ready,
then 1 s after its first call (bench/run.py's check call: one envelope call, priced
with the ``full`` policy). With ``--runs`` > 1 the median of the runs. Prints one JSON
document (MiB).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import BENCH_DIR, start
from run import PY, SECRET, check_call, policy_for


def measure(variant: str, workdir: Path, upstream: str) -> tuple[float, float]:
    secret = workdir / "openai-key"
    secret.write_text(SECRET + "\n")
    policy = policy_for(upstream, secret, workdir / f"{variant}-audit.jsonl", variant)
    path = workdir / f"{variant}.yaml"
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    argv = [PY, "-m", "gateway", "serve", "--policy", str(path), "--port", "0", "--ops-port", "0"]
    child = start(variant, argv, workdir, ready="calls")
    try:
        time.sleep(2.0)
        at_start = child.memory_kib()["VmRSS"] / 1024
        priced = policy["targets"]["openai"]["usage"] != "none"
        check_call(child, tokens=32 if priced else None)
        time.sleep(1.0)
        after = child.memory_kib()["VmRSS"] / 1024
    finally:
        child.stop()
    return at_start, after


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default="minimal,full")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    out: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="egw-rss-") as tmp:
        workdir = Path(tmp)
        upstream = start(
            "upstream", [PY, str(BENCH_DIR / "upstream.py")], workdir, ready="listening"
        )
        try:
            for variant in args.variants.split(","):
                runs = [measure(variant, workdir, upstream.address) for _ in range(args.runs)]
                out[variant] = {
                    "start_mib": round(statistics.median(r[0] for r in runs), 1),
                    "after_first_call_mib": round(statistics.median(r[1] for r in runs), 1),
                }
        finally:
            upstream.stop()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
