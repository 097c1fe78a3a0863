"""Instructions per call of the sidecar, counted by callgrind (not a test).

    python bench/instructions.py [--calls 200] [--warmup 300] [--variant full]
                                 [--route envelope|drop-in] [--keep DIR] [--annotate]
                                 [CHECKOUT ...]

Requests per second on a shared 2-core machine drift by 30 % between runs; instruction
counts do not (the same code, inputs and PYTHONHASHSEED give the same count to ~0.3 %,
whatever else the machine runs). So an A/B of two commits is: check each out (``git
worktree add --detach DIR COMMIT`` and ``make .venv/.fast`` in it) and give the
checkouts; the default is this one.

For each checkout: the benchmark's upstream (bench/upstream.py) and the sidecar as
``python -m gateway serve`` with the benchmark's policy (``policy_for`` of that
checkout's bench/run.py) under ``valgrind --tool=callgrind --instr-atstart=no``; one
keep-alive connection sends ``--warmup`` envelopes uninstrumented (imports, caches,
connection pool), then instrumentation is switched on with ``callgrind_control`` for
``--calls`` envelopes (each its own correlation_id, so each derives a new idempotency
key), switched off and dumped. ``--route drop-in`` sends the same chat body to
``/proxy/openai/v1/chat/completions`` instead (the SDK path). Printed: instructions
(Ir) of the sidecar process per call, one JSON line per checkout. Needs valgrind
(Debian package). ~1 minute per checkout.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def count(
    checkout: Path,
    *,
    calls: int,
    warmup: int,
    variant: str,
    keep: Path | None = None,
    route: str = "envelope",
) -> dict[str, object]:
    """Run one checkout's sidecar under callgrind; return its instructions per call.

    With ``keep``, the callgrind output is copied there as ``callgrind.out.COMMIT``.
    """
    bench = checkout / "bench"
    for name in ("run", "harness", "report"):  # another checkout's, from an earlier one
        sys.modules.pop(name, None)
    sys.path.insert(0, str(bench))
    try:
        import run as bench_run  # that checkout's policy and envelope
        from harness import start
    finally:
        sys.path.remove(str(bench))
    py = str(checkout / ".venv" / "bin" / "python")
    work = Path(tempfile.mkdtemp(prefix="bench-instr-"))
    (work / "key").write_text(bench_run.SECRET + "\n")
    env = dict(os.environ, PYTHONHASHSEED="0")
    upstream = start("upstream", [py, str(bench / "upstream.py")], work, ready="listening")
    sidecar = None
    try:
        policy = bench_run.policy_for(upstream.address, work / "key", work / "audit.jsonl", variant)
        (work / "policy.yaml").write_text(json.dumps(policy))  # JSON is YAML
        out = work / "callgrind.out"
        argv = [
            "valgrind", "--tool=callgrind", "--instr-atstart=no",
            f"--callgrind-out-file={out}", py, "-m", "gateway", "serve",
            "--policy", str(work / "policy.yaml"), "--port", "0", "--ops-port", "0",
        ]  # fmt: skip
        sidecar = start("sidecar", argv, work, ready="calls", env=env, timeout_s=600)
        host, port = sidecar.address.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
        headers = {"content-type": "application/json"}
        headers.update(getattr(bench_run, "VARIANT_HEADERS", {}).get(variant, {}))
        template = bench_run.envelope_template()
        path = "/v1/calls"
        if route == "drop-in":
            template = json.dumps(bench_run.PARAMETERS)
            path = "/proxy/openai/v1/chat/completions"

        def send(n: int, tag: str) -> None:
            for i in range(n):
                body = template.replace("@ID@", f"{tag}-{i}").encode()
                conn.request("POST", path, body, headers)
                answer = conn.getresponse()
                doc = json.loads(answer.read())
                if answer.status != 200 or not (route == "drop-in" or doc.get("success")):
                    raise RuntimeError(f"unexpected answer {answer.status}: {doc}")

        send(warmup, "warmup")
        control = ["callgrind_control", "-i"]
        subprocess.run([*control, "on", str(sidecar.pid)], check=True, capture_output=True)
        send(calls, "measured")
        subprocess.run([*control, "off", str(sidecar.pid)], check=True, capture_output=True)
        subprocess.run(["callgrind_control", "-d", str(sidecar.pid)], check=True,
                       capture_output=True)  # fmt: skip
        conn.close()
    finally:
        if sidecar is not None:
            sidecar.proc.kill()
            sidecar.proc.wait(30)
        upstream.stop()
    total = 0
    for dump in work.glob("callgrind.out*"):
        for line in dump.read_text(errors="replace").splitlines():
            if line.startswith("totals:"):
                total += int(line.split()[1])
    commit = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"],
        capture_output=True, text=True, check=False,
    ).stdout.strip()  # fmt: skip
    kept = None
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        dumps = sorted(work.glob("callgrind.out*"), key=lambda p: p.stat().st_size)
        if dumps:  # the largest dump holds the measured calls
            kept = keep / f"callgrind.out.{commit or 'checkout'}"
            kept.write_bytes(dumps[-1].read_bytes())
    result: dict[str, object] = {
        "checkout": str(checkout),
        "commit": commit,
        "calls": calls,
        "route": route,
        "variant": variant,
        "instructions_per_call": round(total / calls),
    }
    if kept is not None:
        result["kept"] = str(kept)
    return result


def annotate(out: Path, *, calls: int, top: int = 40) -> str:
    """The inclusive callgrind profile of ``out``, per call: the program's total, the top
    ``top`` entries of the libraries' own compiled code (``site-packages``: pydantic-core,
    uvloop, aiohttp's parser, orjson, multidict, yarl...) and any ``gateway/`` entry.

    Python frames show as the interpreter's C functions (``_PyEval_EvalFrameDefault``),
    so they are left out: attribute them with cProfile call counts over N calls in
    process, or py-spy (bench/profile_sidecar.py). Returns the text to print.
    """
    text = subprocess.run(
        ["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(out)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    rows = [line.strip() for line in text.splitlines() if line.strip()[:1].isdigit()]
    total = [r for r in rows if "PROGRAM TOTALS" in r]
    libraries = [r for r in rows if "site-packages" in r][:top]
    own = [r for r in rows if "gateway/" in r]
    lines = []
    for row in total + libraries + own:
        ir, _, rest = row.partition(" ")
        try:
            per_call = int(ir.replace(",", "")) / calls
        except ValueError:
            continue
        lines.append(f"{per_call:>12,.0f}  {rest.strip()}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkouts", nargs="*", type=Path, default=[HERE.parent])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--variant", default="full", help="a policy variant of bench/run.py")
    parser.add_argument("--route", choices=("envelope", "drop-in"), default="envelope")
    parser.add_argument("--keep", type=Path, help="keep each callgrind.out in this folder")
    parser.add_argument("--annotate", action="store_true",
                        help="print the inclusive profile per call (implies --keep)")  # fmt: skip
    args = parser.parse_args()
    keep = args.keep
    if args.annotate and keep is None:
        keep = Path(tempfile.mkdtemp(prefix="bench-instr-keep-"))
    for checkout in args.checkouts:
        result = count(checkout.resolve(), calls=args.calls, warmup=args.warmup,
                       variant=args.variant, keep=keep, route=args.route)  # fmt: skip
        print(json.dumps(result), flush=True)
        if args.annotate and "kept" in result:
            print(annotate(Path(str(result["kept"])), calls=args.calls), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
