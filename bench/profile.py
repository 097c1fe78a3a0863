"""Profile the sidecar's hot path under load with py-spy (not a test).

    python bench/profile.py [--variant full] [--duration 15] [--concurrency 16] [--top 40]

Starts the benchmark's upstream and one sidecar (a policy variant of bench/run.py), runs
wrk against it while ``py-spy record --format raw`` samples the sidecar, then prints
the functions holding the most samples: by self time (the innermost frame) and by
inclusive time (any frame), plus the CPU per call measured from /proc. Needs py-spy
(``pip install py-spy``) and wrk. The raw stacks stay in the temporary directory when
``BENCH_KEEP=1``.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import BenchError
from run import BENCH_DIR, FEATURES, PY, Bench


def _frames(stack: str) -> list[str]:
    # py-spy raw: "frame;frame;... count", outermost first; a frame is
    # "function (path/to/file.py:line)". Coroutines run by uvloop start at their own
    # frame (the loop is C), so a stack need not reach main().
    out = []
    for frame in stack.split(";"):
        name, _, where = frame.partition(" (")
        path = where.rsplit(":", 1)[0]
        parts = Path(path).parts
        short = "/".join(parts[-2:]) if parts else path
        out.append(f"{name} ({short})")
    return out


def summarise(raw: Path, top: int) -> str:
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = _frames(stack)
        if not frames:
            continue
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            incl[frame] += n
    lines = [f"{total} samples", "", "self:"]
    lines += [f"  {n / total:6.1%}  {f}" for f, n in own.most_common(top)]
    lines += ["", "inclusive:"]
    lines += [f"  {n / total:6.1%}  {f}" for f, n in incl.most_common(top)]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default="full", choices=sorted(FEATURES))
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    spy = shutil.which("py-spy") or str(Path(PY).with_name("py-spy"))
    if not Path(spy).exists() or not shutil.which("wrk"):
        print("needs py-spy (pip install py-spy) and wrk (apt-get install wrk)", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="egw-profile-"))
    bench = Bench(args, workdir)
    try:
        bench.upstream = up = bench.spawn(
            "upstream", [PY, str(BENCH_DIR / "upstream.py")], "listening"
        )
        child = bench.sidecar(args.variant, "sidecar")
        url = f"http://{child.address}/v1/calls"
        bench.load("warmup", url, args.concurrency, 3, [child, up])
        raw = workdir / "stacks.txt"
        spy_proc = subprocess.Popen(
            [spy, "record", "--format", "raw", "--rate", "250", "--nonblocking",
             "--duration", str(round(args.duration)), "--pid", str(child.pid),
             "--output", str(raw)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            res = bench.load("profile", url, args.concurrency, args.duration, [child, up])
        finally:
            spy_proc.wait(args.duration + 60)
        cpu = res.cpu_us_per_call(child.name) or 0
        print(f"{args.variant}: {res.rps:.0f} req/s, {cpu:.0f} us CPU/call (sampling included)")
        print(summarise(raw, args.top))
    except BenchError as exc:
        print(f"profile failed: {exc}", file=sys.stderr)
        return 1
    finally:
        bench.close()
        if not os.environ.get("BENCH_KEEP"):
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
