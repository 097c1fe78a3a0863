"""Resident memory of an idle sidecar (docs/performance.md, "Memory"; not a test).

    PYTHONPATH=$PWD python bench/rss.py [--variants minimal,full] [--runs 3] [--breakdown]
                                        [--bytecode]

For each of bench/run.py's policy variants, a real ``python -m gateway serve`` against
bench/upstream.py (each in its own process): ``VmRSS`` 2 s after it reported ready,
then 1 s after its first call (bench/run.py's check call: one envelope call, priced
with the ``full`` policy). With ``--runs`` > 1 the median of the runs. With
``--breakdown``, also ``VmRSS`` of one fresh interpreter after each step of what a
sidecar loads (each library, then the sidecar's own modules and its policy), in the
order a sidecar would load them. With ``--bytecode``, the sidecar's modules are compiled
first (into a private ``PYTHONPYCACHEPREFIX``) and loaded from their bytecode, as in the
image (its Dockerfile runs compileall); without it they are compiled from source at each
start when ``PYTHONDONTWRITEBYTECODE`` is set, which leaves ~0.7 MiB more resident.
Prints one JSON document (MiB).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import BENCH_DIR, start
from run import PY, SECRET, check_call, policy_for


def measure(
    variant: str, workdir: Path, upstream: str, env: dict[str, str] | None
) -> tuple[float, float]:
    secret = workdir / "openai-key"
    secret.write_text(SECRET + "\n")
    policy = policy_for(upstream, secret, workdir / f"{variant}-audit.jsonl", variant)
    path = workdir / f"{variant}.yaml"
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    argv = [PY, "-m", "gateway", "serve", "--policy", str(path), "--port", "0", "--ops-port", "0"]
    child = start(variant, argv, workdir, ready="calls", env=env)
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


#: (step, statement) run in order in one fresh interpreter by ``--breakdown``.
STEPS: tuple[tuple[str, str], ...] = (
    ("python", "from gateway.imports import without"),
    ("asyncio (ssl, OpenSSL)", "import asyncio, ssl"),
    ("aiohttp, aiohttp.web", "import aiohttp, aiohttp.web"),
    ("pydantic (a model built)", "import pydantic\nclass _M(pydantic.BaseModel):\n    a: int"),
    # As the sidecar imports them: structlog without rich and colorama, pybreaker without
    # redis-py (gateway/imports.py).
    ("structlog", "with without('rich', 'colorama'):\n    import structlog"),
    ("orjson, pybreaker", "import orjson\nwith without('redis'):\n    import pybreaker"),
    ("prometheus-client", "import prometheus_client"),
    ("PyYAML", "import yaml"),
    ("uvloop", "import uvloop"),
    ("policy models", "import gateway.policy"),
    (
        "server, API and call modules",
        "import gateway.server.app, gateway.server.runtime, gateway.cli",
    ),
    ("the policy loaded", "from gateway.policy import load_policy\nload_policy(POLICY)"),
)

BREAKDOWN = """
import json, sys
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024
POLICY = sys.argv[1]
out = []
for name, statement in json.loads(sys.argv[2]):
    try:
        exec(statement)
    except ImportError:
        continue
    out.append([name, round(rss(), 1)])
print(json.dumps(out))
"""


def breakdown(workdir: Path) -> dict[str, float]:
    """RSS after each of :data:`STEPS` (MiB), in one fresh interpreter."""
    secret = workdir / "openai-key"
    secret.write_text(SECRET + "\n")
    path = workdir / "breakdown.yaml"
    policy = policy_for("127.0.0.1:9", secret, workdir / "breakdown-audit.jsonl", "minimal")
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    done = subprocess.run(
        [PY, "-c", BREAKDOWN, str(path), json.dumps(STEPS)],
        capture_output=True, text=True, check=True, cwd=BENCH_DIR.parent,
    )  # fmt: skip
    return dict(json.loads(done.stdout))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default="minimal,full")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument("--bytecode", action="store_true")
    args = parser.parse_args()
    out: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="egw-rss-") as tmp:
        workdir = Path(tmp)
        env = None
        if args.bytecode:
            env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
            env["PYTHONPYCACHEPREFIX"] = str(workdir / "pycache")
            gateway = str(BENCH_DIR.parent / "gateway")
            subprocess.run([PY, "-m", "compileall", "-q", gateway], env=env, check=True)
        if args.breakdown:
            out["breakdown"] = breakdown(workdir)
        upstream = start(
            "upstream", [PY, str(BENCH_DIR / "upstream.py")], workdir, ready="listening"
        )
        try:
            for variant in args.variants.split(","):
                runs = [measure(variant, workdir, upstream.address, env) for _ in range(args.runs)]
                out[variant] = {
                    "start_mib": round(statistics.median(r[0] for r in runs), 1),
                    "after_first_call_mib": round(statistics.median(r[1] for r in runs), 1),
                }
        finally:
            upstream.stop()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
