"""The sidecar beside the gateways people would pick instead, in one run (not a test).

    python bench/peers.py [--duration S] [--install-only]
    make bench-peers

Optional and not in CI: it installs, on first use, into ``bench/.peers/`` (ignored by
git), each in its own environment so that nothing of theirs reaches the sidecar's venv:

* LiteLLM's proxy (``litellm[proxy]``, PyPI, version :data:`LITELLM`) in its own venv,
  one worker, no database, a master key (it refuses to start without one), measured on
  two routes: its main route (``POST /chat/completions`` with a ``model_list`` entry
  whose ``api_base`` is the upstream) and a configured pass-through endpoint
  (``general_settings.pass_through_endpoints``, the body forwarded as is);
* the Portkey gateway (``@portkey-ai/gateway``, npm, version :data:`PORTKEY`) on the
  machine's Node.js, ``POST /v1/chat/completions`` with ``x-portkey-provider: openai``
  and ``x-portkey-custom-host`` naming the upstream;
* nginx (Debian's package, installed with apt-get when missing and the user is root):
  ``proxy_pass`` with keep-alive upstream connections, one worker (the C floor).

Beside them, as in ``make bench``: direct calls to the upstream (bench/upstream.py), the
bare aiohttp pass-through (bench/passthrough.py, the Python floor) and the sidecar on its
drop-in route (``/proxy/openai/v1/chat/completions``: the same request body as the peers)
and its envelope route, with bench/run.py's realistic policy. Every setup gets the same
OpenAI-shaped body, wrk at 1 and 16 connections (one thread) for ``--duration`` seconds
after a warm-up; CPU per call is the setup's whole process tree (``/proc/PID/stat`` of
the process and its descendants: LiteLLM's and nginx's workers). Each peer is stopped
before the next starts, so that only the measured one competes with wrk for the cores.
A peer that cannot be installed or started is reported as skipped with the reason; the
others still run. Results go to ``bench/results/peers-<UTC timestamp>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as bench_run  # the policy, the body and the secret of make bench
from harness import BENCH_DIR, CLK_TCK, BenchError, Child, start, wrk

LITELLM = "1.108.7"
PORTKEY = "1.15.2"
PEERS = BENCH_DIR / ".peers"
PY = sys.executable
#: LiteLLM's proxy refuses to start without a master key (it would accept any request).
LITELLM_KEY = "sk-bench-litellm-master-" + "0" * 24


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def family(pid: int) -> set[int]:
    """``pid`` and the pids of its live descendants."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry.name)] = int(fields[1])
    members, grew = {pid}, True
    while grew:
        more = {p for p, parent in parents.items() if parent in members} - members
        members |= more
        grew = bool(more)
    return members


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of ``pid`` and every live descendant."""
    total = 0.0
    for member in family(pid):
        try:
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / CLK_TCK
    return total


class Tree(Child):
    """A child whose CPU is that of its whole process tree."""

    def cpu_s(self) -> float:
        return _tree_cpu_s(self.pid)


def _spawn_http(name: str, argv: list[str], logdir: Path, port: int, probe: str, **kw: Any) -> Tree:
    """Start ``argv``; ready once ``GET probe`` on ``port`` answers (bounded, 90 s)."""
    log = logdir / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, **kw)
    child = Tree(name, proc, log, address=f"127.0.0.1:{port}")
    give_up = time.monotonic() + 90
    while time.monotonic() < give_up:
        if proc.poll() is not None:
            raise BenchError(f"{name} exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{probe}", timeout=2):
                return child
        except OSError:
            time.sleep(0.2)
    child.stop()
    raise BenchError(f"{name} did not answer GET {probe} within 90 s; see {log}")


def install(peer: str) -> str | None:
    """Install ``peer`` under bench/.peers/ if missing; None when ready, else why not."""
    PEERS.mkdir(exist_ok=True)
    try:
        if peer == "litellm":
            venv = PEERS / "litellm"
            if not (venv / "bin" / "litellm").exists():
                subprocess.run([PY, "-m", "venv", str(venv)], check=True)
                pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
                subprocess.run([*pip, f"litellm[proxy]=={LITELLM}"], check=True)
        elif peer == "portkey":
            if shutil.which("node") is None or shutil.which("npm") is None:
                return "Node.js and npm are not installed"
            home = PEERS / "portkey"
            if not (home / "node_modules" / "@portkey-ai" / "gateway").exists():
                home.mkdir(exist_ok=True)
                subprocess.run(
                    [
                        "npm",
                        "install",
                        "--prefix",
                        str(home),
                        "--no-audit",
                        "--no-fund",
                        f"@portkey-ai/gateway@{PORTKEY}",
                    ],
                    check=True,
                    stdout=subprocess.DEVNULL,
                )
        elif peer == "nginx" and shutil.which("nginx") is None:
            if os.geteuid() != 0:
                return "nginx is not installed (apt-get install nginx-light, as root)"
            env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
            subprocess.run(["apt-get", "install", "-y", "-qq", "nginx-light"], check=True, env=env)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"install failed: {exc}"
    return None


def _litellm(upstream: str, work: Path) -> Tree:
    port = _free_port()
    config = {
        "model_list": [
            {
                "model_name": "gpt-4o-mini",
                "litellm_params": {
                    "model": "openai/gpt-4o-mini",
                    "api_base": f"http://{upstream}/v1",
                    "api_key": bench_run.SECRET,
                },
            }
        ],
        "general_settings": {
            "pass_through_endpoints": [
                {
                    "path": "/bench/chat/completions",
                    "target": f"http://{upstream}/v1/chat/completions",
                    "headers": {"Authorization": f"Bearer {bench_run.SECRET}"},
                }
            ],
        },
        "litellm_settings": {"telemetry": False},
    }
    path = work / "litellm.json"
    path.write_text(json.dumps(config))  # JSON is YAML
    binary = str(PEERS / "litellm" / "bin" / "litellm")
    argv = [binary, "--config", str(path), "--host", "127.0.0.1", "--port", str(port)]
    env = dict(
        os.environ, LITELLM_LOG="ERROR", LITELLM_TELEMETRY="False", LITELLM_MASTER_KEY=LITELLM_KEY
    )
    env.pop("DATABASE_URL", None)
    return _spawn_http(
        "litellm", [*argv, "--num_workers", "1"], work, port, "/health/liveliness", env=env
    )


def _portkey(work: Path) -> Tree:
    port = _free_port()
    script = PEERS / "portkey" / "node_modules" / "@portkey-ai" / "gateway" / "build"
    argv = ["node", str(script / "start-server.js"), f"--port={port}", "--headless"]
    env = dict(os.environ, NODE_ENV="production")
    return _spawn_http("portkey", argv, work, port, "/", env=env)


def _nginx(upstream: str, work: Path) -> Tree:
    port = _free_port()
    conf = work / "nginx.conf"
    conf.write_text(f"""
worker_processes 1;
daemon off;
pid {work}/nginx.pid;
error_log {work}/nginx-error.log error;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  client_body_temp_path {work}/nginx-body;
  proxy_temp_path {work}/nginx-proxy;
  upstream up {{ server {upstream}; keepalive 64; }}
  server {{
    listen 127.0.0.1:{port};
    location = /ready {{ return 200 "ok"; }}
    location / {{
      proxy_pass http://up;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_set_header Authorization "Bearer {bench_run.SECRET}";
    }}
  }}
}}
""")
    return _spawn_http(
        "nginx", ["nginx", "-c", str(conf), "-e", str(work / "nginx-e.log")], work, port, "/ready"
    )


def _check(label: str, url: str, body: Path, headers: dict[str, str]) -> None:
    """One call must come back 200 with the upstream's completion (not an error body)."""
    data = body.read_text().replace("@ID@", "peers-check").encode()
    headers = {"Content-Type": "application/json", **headers}
    req = urllib.request.Request(url, data=data, method="POST", headers=headers)  # noqa: S310
    with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310
        answer = resp.read().decode()
    if resp.status != 200 or "The capital of France is Paris." not in answer:
        raise BenchError(f"{label}: unexpected answer {resp.status} {answer[:300]}")


def _measure(
    label: str,
    url: str,
    body: Path,
    watch: list[Child],
    duration: float,
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    _check(label, url, body, headers or {})
    os.environ["WRK_HEADERS"] = "\n".join(f"{k}: {v}" for k, v in (headers or {}).items())
    try:
        wrk(
            f"warmup-{label}",
            url,
            body,
            prefix="w",
            concurrency=16,
            duration_s=max(duration / 3, 1),
            watch=watch,
        )
        out: dict[str, Any] = {"label": label}
        for conc in (1, 16):
            res = wrk(
                label,
                url,
                body,
                prefix=f"{label}-{conc}",
                concurrency=conc,
                duration_s=duration,
                watch=watch,
            )
            out[f"c{conc}"] = res.as_json()
            errors = sum(res.errors.values())
            cpu = res.cpu_us_per_call(watch[0].name)
            p50 = res.latency_us["p50"] / 1000
            print(
                f"  {label:22s} c={conc:<3d} {res.rps:8.0f} req/s  p50 {p50:7.3f} ms  "
                f"CPU/call {cpu or 0:7.0f} us  errors {errors}",
                flush=True,
            )
        return out
    finally:
        os.environ.pop("WRK_HEADERS", None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per measured run")
    parser.add_argument("--install-only", action="store_true")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        print("wrk is not installed (Debian: apt-get install -y wrk)", file=sys.stderr)
        return 2
    skipped = {peer: why for peer in ("nginx", "portkey", "litellm") if (why := install(peer))}
    if args.install_only:
        print(json.dumps({"skipped": skipped}))
        return 0
    work = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    body = work / "parameters.json"
    body.write_text(json.dumps(bench_run.PARAMETERS, separators=(",", ":")))
    envelope = work / "envelope.json"
    envelope.write_text(bench_run.envelope_template())
    secret = work / "openai-key"
    secret.write_text(bench_run.SECRET + "\n")
    d = args.duration
    rows: list[dict[str, Any]] = []
    upstream = start("upstream", [PY, str(BENCH_DIR / "upstream.py")], work, ready="listening")
    up = upstream.address
    try:
        rows.append(_measure("direct", f"http://{up}/v1/chat/completions", body, [upstream], d))
        own = [
            (
                "passthrough",
                [
                    PY,
                    str(BENCH_DIR / "passthrough.py"),
                    "--upstream",
                    f"http://{up}/v1/chat/completions",
                ],
                "listening",
                "/v1/calls",
                body,
            ),
            ("sidecar-proxy", None, "calls", "/proxy/openai/v1/chat/completions", body),
            ("sidecar-envelope", None, "calls", "/v1/calls", envelope),
        ]
        for label, argv, ready, path, template in own:
            if argv is None:
                policy = bench_run.policy_for(up, secret, work / f"{label}-audit.jsonl", "full")
                (work / f"{label}.yaml").write_text(json.dumps(policy))
                argv = [
                    PY,
                    "-m",
                    "gateway",
                    "serve",
                    "--policy",
                    str(work / f"{label}.yaml"),
                    "--port",
                    "0",
                    "--ops-port",
                    "0",
                ]
            child = start(label, argv, work, ready=ready)
            try:
                url = f"http://{child.address}{path}"
                rows.append(_measure(label, url, template, [child, upstream], d))
            finally:
                child.stop()
        peers = [
            ("nginx", lambda: _nginx(up, work), "/v1/chat/completions", None),
            (
                "portkey",
                lambda: _portkey(work),
                "/v1/chat/completions",
                {
                    "x-portkey-provider": "openai",
                    "x-portkey-custom-host": f"http://{up}/v1",
                    "Authorization": f"Bearer {bench_run.SECRET}",
                },
            ),
            (
                "litellm",
                lambda: _litellm(up, work),
                "/chat/completions",
                {"Authorization": f"Bearer {LITELLM_KEY}"},
            ),
        ]
        for name, launch, path, headers in peers:
            if name in skipped:
                print(f"  {name}: skipped ({skipped[name]})", flush=True)
                continue
            try:
                peer = launch()
            except BenchError as exc:
                skipped[name] = str(exc)
                print(f"  {name}: skipped ({exc})", flush=True)
                continue
            try:
                url = f"http://{peer.address}{path}"
                rows.append(_measure(name, url, body, [peer, upstream], d, headers))
                if name == "litellm":
                    url = f"http://{peer.address}/bench/chat/completions"
                    rows.append(
                        _measure("litellm-passthrough", url, body, [peer, upstream], d, headers)
                    )
            except BenchError as exc:
                skipped[name] = str(exc)
                print(f"  {name}: failed ({exc})", flush=True)
            finally:
                peer.stop()
    finally:
        upstream.stop()
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"peers-{stamp}.json"
    result = {
        "versions": {"litellm": LITELLM, "portkey": PORTKEY},
        "rows": rows,
        "skipped": skipped,
        "duration_s": d,
    }
    out.write_text(json.dumps(result, indent=1))
    print(table(rows), f"\nresults: {out}", sep="\n")
    return 0


def table(rows: list[dict[str, Any]]) -> str:
    """req/s at c16, CPU per call at c16 and added p50 at c1, each against the pass-through."""
    by = {r["label"]: r for r in rows}
    direct_p50 = by["direct"]["c1"]["latency_us"]["p50"] if "direct" in by else 0.0
    base = by.get("passthrough", {}).get("c16", {}).get("rps")
    lines = [f"{'hop':22s}{'req/s c16':>10s}{'vs pass':>9s}{'CPU/call':>10s}{'+p50 c1':>10s}"]
    for r in rows:
        c16, c1 = r["c16"], r["c1"]
        cpu = next(iter(c16["cpu_us_per_call"].values()), None)
        ratio = f"{c16['rps'] / base:8.2f}x" if base else f"{'-':>9s}"
        added = (c1["latency_us"]["p50"] - direct_p50) / 1000
        lines.append(
            f"{r['label']:22s}{c16['rps']:10.0f}{ratio}"
            f"{cpu if cpu is not None else 0:8.0f}us{added:8.3f}ms"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
