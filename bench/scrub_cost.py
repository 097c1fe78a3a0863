"""What the secret scrub costs per answer, by the number of registered secrets (not a test).

    python bench/scrub_cost.py [--secrets 1 10 50] [--calls 2000] [--callgrind]
                               [CHECKOUT ...]

Each registered secret (a provider key, each agent's token, the chain's signing key, an
operator's token...) is looked for in every answer head and body, audit record and log
line (``gateway.redaction``). For each checkout (default: this one) and each count N, a
fresh process registers N realistic secrets (40-character tokens, as
``secrets.token_hex(20)`` makes; one with characters that encodings change), then scrubs a
1.6 KB chat completion answer holding none of them ``--calls`` times with
``scrub_bytes`` (the answer writer), and its text with ``scrub`` (the header and audit
writers). Printed: one JSON line per checkout and count, microseconds per call
(``time.process_time``), or with ``--callgrind`` instructions per call (the process run
twice under ``valgrind --tool=callgrind``, with ``--calls`` and twice as many; the
difference over ``--calls``: startup and registration cancel out; repeatable to ~0.1 %
under any load).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONTENT = "The answer, in plain words: " + "tokens flow through the sidecar unchanged. " * 32
ANSWER = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "model": "gpt-4o-mini",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": CONTENT}}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 300, "total_tokens": 312},
    },
    separators=(",", ":"),
).encode()[:1600]


def child(secrets: int, calls: int, what: str) -> float:
    """In the measured process: register ``secrets`` values, scrub ``calls`` times."""
    from gateway import redaction

    for i in range(secrets):
        value = hashlib.sha256(b"bench-%d" % i).hexdigest()[:40]  # as secrets.token_hex(20)
        redaction.register(value if i else "gk+key/with space=" + value)
    text = ANSWER.decode()
    assert redaction.scrub_bytes(ANSWER) == ANSWER  # nothing to redact: the common case
    started = time.process_time()
    if what == "bytes":
        for _ in range(calls):
            redaction.scrub_bytes(ANSWER)
    else:
        for _ in range(calls):
            redaction.scrub(text)
    return (time.process_time() - started) / calls * 1e6


def _instructions(checkout: Path, secrets: int, calls: int, what: str) -> int:
    with tempfile.TemporaryDirectory(prefix="scrub-cost-") as work:
        out = Path(work) / "callgrind.out"
        argv = [
            "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
            str(HERE / "scrub_cost.py"), "--child", str(secrets), str(calls), what,
        ]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=str(checkout), PYTHONHASHSEED="0")
        subprocess.run(argv, check=True, capture_output=True, env=env, cwd=checkout)
        for line in out.read_text(errors="replace").splitlines():
            if line.startswith("totals:"):
                return int(line.split()[1])
    raise RuntimeError("no totals in the callgrind output")


def measure(checkout: Path, secrets: int, calls: int, callgrind: bool) -> dict[str, object]:
    """One checkout, one count of secrets: the cost of one scrub, bytes and str."""
    result: dict[str, object] = {"checkout": str(checkout), "secrets": secrets}
    for what in ("bytes", "str"):
        if callgrind:
            once = _instructions(checkout, secrets, calls, what)
            twice = _instructions(checkout, secrets, 2 * calls, what)
            result[f"{what}_instructions"] = round((twice - once) / calls)
        else:
            argv = [sys.executable, str(HERE / "scrub_cost.py"), "--child", str(secrets),
                    str(calls), what]  # fmt: skip
            env = dict(os.environ, PYTHONPATH=str(checkout))
            done = subprocess.run(argv, check=True, capture_output=True, text=True, env=env)
            result[f"{what}_us"] = round(float(done.stdout), 2)
    return result


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        secrets, calls, what = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
        print(child(secrets, calls, what))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkouts", nargs="*", type=Path, default=[HERE.parent])
    parser.add_argument("--secrets", nargs="+", type=int, default=[1, 10, 50])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--callgrind", action="store_true")
    args = parser.parse_args()
    for checkout in args.checkouts:
        for secrets in args.secrets:
            row = measure(checkout.resolve(), secrets, args.calls, args.callgrind)
            print(json.dumps({"bytes": len(ANSWER), "calls": args.calls, **row}), flush=True)


if __name__ == "__main__":
    main()
