"""Added latency of one sequential call: the sidecar's wall time per call at c=1 (not a test).

    python bench/latency.py [--calls 2000] [--variant full] [--route envelope|proxy]
                            [--strace]

Starts the benchmark's upstream (bench/upstream.py), the bare pass-through
(bench/passthrough.py, on the sidecar's event loop) and one sidecar (a policy variant of
bench/run.py). One client, one keep-alive connection to each, a raw socket writing
prebuilt requests (each envelope with its own correlation_id), so the client's own cost
is the same for all three and small. The three are called in turn, call after call (the
order rotating), so that the machine's drift hits them alike. Printed: p50 / p90 / p99 of
each, and the added p50 (the proxy's minus direct's, per call pair: the median of the
differences), the figure issue 21's "added p50 at c=1" is.

With ``--strace`` the sidecar's system calls during the measured calls are counted
(``strace -c -f -p``), per call: how many event-loop iterations (``epoll_wait``), reads,
writes and other calls one call costs (strace slows each call; the timings of that run
are not the figure to quote).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import BenchError, Child, start
from run import BENCH_DIR, PARAMETERS, PY, Bench, check_call, envelope_template, policy_for


class Conn:
    """One keep-alive HTTP/1.1 connection; ``call`` sends prebuilt bytes, reads one answer."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def call(self, request: bytes) -> tuple[float, bytes]:
        started = time.perf_counter()
        self.sock.sendall(request)
        buf = self.buf
        while b"\r\n\r\n" not in buf:
            buf += self._recv()
        head, _, rest = buf.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(rest) < length:
            rest += self._recv()
        elapsed = time.perf_counter() - started
        self.buf = rest[length:]
        status = head.split(b" ", 2)[1]
        if status != b"200":
            raise BenchError(f"answer {status!r}: {rest[:300]!r}")
        return elapsed, rest[:length]

    def _recv(self) -> bytes:
        data = self.sock.recv(65536)
        if not data:
            raise BenchError("connection closed")
        return data


def _schedstat(child: Child) -> tuple[int, ...]:
    """The process's threads' ``/proc/PID/task/TID/schedstat`` summed (nanoseconds on a
    CPU, nanoseconds runnable but waiting for one, times scheduled in), then the
    voluntary and involuntary context switches of their ``status``."""
    total = [0, 0, 0, 0, 0]
    for task in Path(f"/proc/{child.pid}/task").iterdir():
        try:
            fields = (task / "schedstat").read_text().split()
            status = (task / "status").read_text()
        except OSError:
            continue  # a thread that ended meanwhile
        for i in range(3):
            total[i] += int(fields[i])
        for line in status.splitlines():
            if line.startswith("voluntary_ctxt_switches"):
                total[3] += int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches"):
                total[4] += int(line.split()[1])
    return tuple(total)


def _request(path: str, body: bytes, host: str) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--variant", default="full")
    parser.add_argument("--route", default="envelope", choices=("envelope", "proxy"))
    parser.add_argument("--strace", action="store_true")
    parser.add_argument("--cprofile", type=Path, help="run the sidecar under cProfile, stats here")
    parser.add_argument(
        "--sidecar-checkout",
        type=Path,
        help="run the sidecar's package from this directory (e.g. `git archive COMMIT`)",
    )
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="egw-latency-"))
    bench = Bench(args, workdir)
    try:
        bench.upstream = bench.spawn("upstream", [PY, str(BENCH_DIR / "upstream.py")], "listening")
        up = bench.upstream.address
        policy = policy_for(up, bench.secret_file, workdir / "audit.jsonl", args.variant)
        (workdir / "policy.yaml").write_text(yaml.safe_dump(policy, sort_keys=False))
        argv = [PY, "-m", "gateway", "serve", "--policy", str(workdir / "policy.yaml")]
        argv += ["--port", "0", "--ops-port", "0"]
        env = None
        if args.cprofile is not None:
            argv[1:1] = ["-m", "cProfile", "-o", str(args.cprofile.resolve())]
        if args.sidecar_checkout is not None:
            # -P: not this directory first on sys.path, so the other checkout's package
            argv[1:1] = ["-P"]
            env = dict(os.environ, PYTHONPATH=str(args.sidecar_checkout.resolve()))
        sidecar = start("sidecar", argv, workdir, ready="calls", env=env)
        bench.children.append(sidecar)
        check_call(sidecar, tokens=32 if args.variant not in ("no_usage", "minimal") else None)
        loop = str((sidecar.info or {}).get("loop", "asyncio"))
        loop = "uvloop" if "uvloop" in loop else "asyncio"
        pt_argv = [PY, str(BENCH_DIR / "passthrough.py"), "--loop", loop, "--upstream"]
        passthrough = bench.spawn(
            "passthrough", [*pt_argv, f"http://{up}/v1/chat/completions"], "listening"
        )
        raw = json.dumps(PARAMETERS, separators=(",", ":")).encode()
        template = envelope_template()
        conns = {
            "direct": Conn(up),
            "passthrough": Conn(passthrough.address),
            "sidecar": Conn(sidecar.address),
        }
        fixed = {
            "direct": _request("/v1/chat/completions", raw, up),
            "passthrough": _request("/v1/calls", raw, passthrough.address),
        }
        proxy_path = "/proxy/openai/v1/chat/completions"

        def sidecar_request(tag: str) -> bytes:
            if args.route == "proxy":
                head = (
                    f"POST {proxy_path} HTTP/1.1\r\nHost: {sidecar.address}\r\n"
                    "Content-Type: application/json\r\n"
                    f"Idempotency-Key: {tag}\r\nContent-Length: {len(raw)}\r\n\r\n"
                )
                return head.encode() + raw
            body = template.replace("@ID@", tag).encode()
            return _request("/v1/calls", body, sidecar.address)

        names = list(conns)

        def one_round(i: int, tag: str) -> dict[str, float]:
            out = {}
            for k in range(3):
                name = names[(i + k) % 3]
                request = fixed.get(name) or sidecar_request(f"{tag}-{i}")
                out[name] = conns[name].call(request)[0]
            return out

        for i in range(args.warmup):
            one_round(i, f"warm{bench.tag}")
        tracers = []
        if args.strace:
            for child in (passthrough, sidecar):
                out = workdir / f"strace-{child.name}.txt"
                argv = ["strace", "-c", "-f", "-o", str(out), "-p", str(child.pid)]
                tracers.append((child.name, out, subprocess.Popen(argv, stderr=subprocess.DEVNULL)))
            time.sleep(1.0)  # strace attaches to every thread; no event to wait on
        samples: dict[str, list[float]] = {n: [] for n in names}
        procs = {"passthrough": passthrough, "sidecar": sidecar}
        sched0 = {n: _schedstat(c) for n, c in procs.items()}
        for i in range(args.calls):
            for name, value in one_round(i, f"run{bench.tag}").items():
                samples[name].append(value)
        sched = {n: _schedstat(c) for n, c in procs.items()}
        for name, out, tracer in tracers:
            tracer.send_signal(signal.SIGINT)
            tracer.wait(30)
            print(f"{name}, {args.calls} calls:\n{out.read_text()}")

        def pct(values: list[float], q: float) -> float:
            ordered = sorted(values)
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

        result: dict[str, object] = {"route": args.route, "variant": args.variant, "loop": loop}
        for name, values in samples.items():
            result[name] = {
                q: round(pct(values, v), 3) for q, v in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
            }
        for name in ("passthrough", "sidecar"):
            diffs = [a - b for a, b in zip(samples[name], samples["direct"], strict=True)]
            result[f"{name}_added_p50_ms"] = round(statistics.median(diffs) * 1000, 3)
        diffs = [a - b for a, b in zip(samples["sidecar"], samples["passthrough"], strict=True)]
        result["sidecar_minus_passthrough_p50_ms"] = round(statistics.median(diffs) * 1000, 3)
        for name in procs:
            ran, waited, _, voluntary, preempted = (
                b - a for a, b in zip(sched0[name], sched[name], strict=True)
            )
            result[f"{name}_per_call"] = {
                "cpu_us": round(ran / args.calls / 1000, 1),
                "runqueue_wait_us": round(waited / args.calls / 1000, 1),
                "sleeps": round(voluntary / args.calls, 2),
                "preempted": round(preempted / args.calls, 2),
            }
        print(json.dumps(result))
    except BenchError as exc:
        print(f"latency failed: {exc}", file=sys.stderr)
        return 1
    finally:
        bench.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
