"""CPU and instructions per call of one sidecar, measures that hold on a busy machine.

    python bench/cpucall.py [--variant full] [--route envelope|proxy|passthrough]
                            [--calls 4000] [--rounds 3] [--concurrency 16] [--callgrind]

Starts the benchmark's upstream and one sidecar (a policy variant of bench/run.py), or
the bare pass-through, warms it up, then sends ``--calls`` calls with wrk at
``--concurrency`` connections (``WRK_STOP_AFTER``: a fixed number of answers) per
round, and prints the process's ``utime + stime`` (``/proc/PID/stat``) per call: the
best round and the median. Another process on the same cores slows a call down but
hardly changes the CPU the sidecar spends on it.

With ``--callgrind`` the process runs under ``valgrind --tool=callgrind`` (about 50
times slower): its counters are zeroed after the warm-up (``callgrind_control -z``) and
dumped after the calls (``-d``), and the instructions per call are printed (exact and
repeatable whatever else runs; ``callgrind_annotate`` on the kept dump shows where they
go, ``BENCH_KEEP=1``). Not a test; A/B two checkouts by running it in each.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import BenchError, Child, start
from run import BENCH_DIR, FEATURES, PARAMETERS, PY, Bench, check_call, policy_for


def _callgrind_total(out: Path) -> int:
    # The dump's "summary:" (or "totals:") line: Ir of everything since the last zeroing.
    for line in out.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise BenchError(f"no totals in {out}")


def _spawn(bench: Bench, args: argparse.Namespace, workdir: Path) -> Child:
    assert bench.upstream is not None
    prefix: list[str] = []
    if args.callgrind:
        prefix = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={workdir}/cg.%p"]
    if args.route == "passthrough":
        url = f"http://{bench.upstream.address}/v1/chat/completions"
        argv = [PY, str(BENCH_DIR / "passthrough.py"), "--upstream", url, "--port", "0"]
        return bench.spawn("passthrough", prefix + argv, "listening")
    policy = policy_for(
        bench.upstream.address, bench.secret_file, workdir / "audit.jsonl", args.variant
    )
    path = workdir / "policy.yaml"
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    argv = [PY, "-m", "gateway", "serve", "--policy", str(path), "--port", "0", "--ops-port", "0"]
    child = start("sidecar", prefix + argv, workdir, ready="calls", timeout_s=300)
    bench.children.append(child)
    if not args.callgrind:
        check_call(child, tokens=32 if args.variant not in ("no_usage", "minimal") else None)
    return child


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default="full", choices=sorted(FEATURES))
    parser.add_argument("--route", default="envelope", choices=("envelope", "proxy", "passthrough"))
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--callgrind", action="store_true")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="egw-cpucall-"))
    bench = Bench(args, workdir)
    (workdir / "raw.json").write_text(json.dumps(PARAMETERS, separators=(",", ":")))
    try:
        bench.upstream = bench.spawn("upstream", [PY, str(BENCH_DIR / "upstream.py")], "listening")
        child = _spawn(bench, args, workdir)
        path = {"envelope": "/v1/calls", "proxy": "/proxy/openai/v1/chat/completions"}.get(
            args.route, "/v1/calls"
        )
        url = f"http://{child.address}{path}"
        raw = args.route == "proxy"
        warm = max(args.calls // 4, 200) if not args.callgrind else 300
        bench.load("warmup", url, args.concurrency, 600, [child], raw=raw, stop_after=warm)
        per_call, instr = [], []
        for _ in range(args.rounds):
            if args.callgrind:
                subprocess.run(["callgrind_control", "-z", str(child.pid)], check=True,
                               capture_output=True)  # fmt: skip
            res = bench.load(
                "run", url, args.concurrency, 600, [child], raw=raw, stop_after=args.calls
            )
            if sum(res.errors.values()):
                raise BenchError(f"errors: {res.errors}")
            per_call.append(res.cpu_s[child.name] / res.requests * 1e6)
            if args.callgrind:
                # Each dump is a new file, cg.PID.N, written once complete.
                before = set(workdir.glob(f"cg.{child.pid}.*"))
                subprocess.run(["callgrind_control", "-d", str(child.pid)], check=True,
                               capture_output=True)  # fmt: skip
                give_up = time.monotonic() + 120
                new: set[Path] = set()
                while not new and time.monotonic() < give_up:
                    time.sleep(0.2)
                    new = set(workdir.glob(f"cg.{child.pid}.*")) - before
                if not new:
                    raise BenchError("callgrind wrote no dump")
                dump = max(new, key=lambda p: p.stat().st_mtime)
                instr.append(_callgrind_total(dump) / res.requests)
        result = {
            "route": args.route,
            "variant": args.variant,
            "concurrency": args.concurrency,
            "calls": args.calls,
            "cpu_us_per_call_min": round(min(per_call), 1),
            "cpu_us_per_call_median": round(statistics.median(per_call), 1),
        }
        if instr:
            result["instructions_per_call_min"] = round(min(instr))
            result["instructions_per_call_median"] = round(statistics.median(instr))
        print(json.dumps(result))
    except BenchError as exc:
        print(f"cpucall failed: {exc}", file=sys.stderr)
        return 1
    finally:
        bench.close()
        if os.environ.get("BENCH_KEEP"):
            print(f"kept {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
