"""Process handling and measurement for bench/run.py: child processes, /proc, wrk.

Everything here reads the machine the way an operator would: CPU time from
``/proc/PID/stat`` (utime + stime, in clock ticks), memory from ``/proc/PID/status``
(``VmRSS`` now, ``VmHWM`` the peak), load and latency from wrk's own counters.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
LUA = BENCH_DIR / "envelope.lua"
CLK_TCK = os.sysconf("SC_CLK_TCK")


class BenchError(RuntimeError):
    """The benchmark cannot go on (a process did not start, wrk failed)."""


@dataclass
class Child:
    """A child process whose stdout goes to a log file."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    address: str = ""
    info: dict[str, Any] | None = None
    idle_memory: dict[str, int] | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu_s(self) -> float:
        """User + system CPU seconds used so far (``/proc/PID/stat`` fields 14 and 15)."""
        stat = Path(f"/proc/{self.pid}/stat").read_text()
        fields = stat.rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def memory_kib(self) -> dict[str, int]:
        """``VmRSS`` and ``VmHWM`` in KiB."""
        out: dict[str, int] = {}
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
        return out

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start(
    name: str,
    argv: list[str],
    logdir: Path,
    *,
    ready: str,
    env: dict[str, str] | None = None,
    timeout_s: float = 30.0,
) -> Child:
    """Start ``argv``; wait (bounded) for a JSON stdout line holding the key ``ready``
    (its value is the bound ``host:port``)."""
    log = logdir / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=BENCH_DIR.parent
        )
    child = Child(name, proc, log)
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        # Whether it has exited is read before its output: a child that reports and
        # exits between two looks (a short load run) is still read.
        exited = proc.poll() is not None
        for line in log.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict) and doc.get(ready):
                child.address = str(doc[ready])
                child.info = doc
                return child
        if exited:
            raise BenchError(f"{name} exited with {proc.returncode}; see {log}")
        time.sleep(0.05)
    child.stop()
    raise BenchError(f"{name} did not report {ready!r} within {timeout_s} s; see {log}")


@dataclass
class LoadResult:
    """One wrk run and what the measured processes spent meanwhile."""

    label: str
    concurrency: int
    requests: int
    duration_s: float
    errors: dict[str, int]
    latency_us: dict[str, float]
    cpu_s: dict[str, float]
    memory_kib: dict[str, dict[str, int]]

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s else 0.0

    def cpu_us_per_call(self, name: str) -> float | None:
        spent = self.cpu_s.get(name)
        return spent / self.requests * 1e6 if spent is not None and self.requests else None

    def as_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "concurrency": self.concurrency,
            "requests": self.requests,
            "duration_s": round(self.duration_s, 3),
            "rps": round(self.rps, 1),
            "errors": self.errors,
            "latency_us": self.latency_us,
            "cpu_us_per_call": {
                n: round(v, 1) for n in self.cpu_s if (v := self.cpu_us_per_call(n)) is not None
            },
            "memory_kib": self.memory_kib,
        }


def wrk(
    label: str,
    url: str,
    template: Path,
    *,
    prefix: str,
    concurrency: int,
    duration_s: float,
    watch: list[Child],
    stop_after: int | None = None,
) -> LoadResult:
    """Run wrk (one thread) at ``concurrency`` connections for ``duration_s`` seconds, or
    until ``stop_after`` answers; measure the CPU of each process in ``watch``."""
    env = dict(os.environ)
    if stop_after:
        env["WRK_STOP_AFTER"] = str(stop_after)
    argv = [
        "wrk",
        "-t1",
        f"-c{concurrency}",
        f"-d{max(round(duration_s), 1)}s",
        "--timeout",
        "10s",
        "-s",
        str(LUA),
        url,
        "--",
        prefix,
        str(template),
    ]
    before = {c.name: c.cpu_s() for c in watch}
    done = subprocess.run(argv, capture_output=True, env=env, check=False, timeout=duration_s + 60)
    after = {c.name: c.cpu_s() for c in watch}
    line = next((x for x in done.stdout.decode().splitlines() if x.startswith("BENCH_JSON ")), None)
    if done.returncode != 0 or line is None:
        raise BenchError(f"wrk failed ({done.returncode}): {done.stderr.decode()[-500:]}")
    doc = json.loads(line.removeprefix("BENCH_JSON "))
    return LoadResult(
        label=label,
        concurrency=concurrency,
        requests=int(doc["requests"]),
        duration_s=doc["duration_us"] / 1e6,
        errors={k.removeprefix("errors_"): v for k, v in doc.items() if k.startswith("errors_")},
        latency_us={
            k.removeprefix("lat_").removesuffix("_us"): v
            for k, v in doc.items()
            if k.startswith("lat_")
        },
        cpu_s={n: after[n] - before[n] for n in before},
        memory_kib={c.name: c.memory_kib() for c in watch},
    )
