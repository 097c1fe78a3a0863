"""The two-agent walkthrough with real processes (docs/api/a2a.md, "Two agents, step
by step"): two sidecars (``egress-gateway serve``), two a2a-sdk agents
(tests/a2a_agents.py); a user asks the planner through its sidecar, the planner's task
asks the executor, which asks the planner back. Prints how many times each agent was
called, what it answered, and each sidecar's audit records: the loop stops at the first
repeat, refused in the executor's sidecar's log, and an executor going around its sidecar
is refused in the planner's.

    PYTHONPATH=. python bench/two_agents_loop.py      (with the dev extra installed)
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from tests.a2a_agents import Agent, ask

KEY = "walkthrough-chain-key-0123456789abcdef"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _policy(me: str, my_url: str, other: str, other_port: int) -> dict[str, Any]:
    return {
        "version": 1,
        "agent_id": me,
        "egress": {"allow_cidrs": ["127.0.0.0/8"]},
        "chain": {
            "max_depth": 4,
            "ttl_s": 300,
            "signing_key_ref": "env://CHAIN_KEY",
            "require_signed_inbound": me == "executor-02",
        },
        "inbound": {"agent_url": my_url},
        "targets": {
            other.split("-")[0]: {
                "base_url": f"http://127.0.0.1:{other_port}/a2a/in",
                "a2a": {"agent_id": other},
            }
        },
    }


def _start(tmp: Path, name: str, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "CHAIN_KEY": KEY, "PYTHONPATH": str(Path(__file__).parents[1])}
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--policy", str(tmp / f"{name}.yaml"),
            "--port", str(port), "--ops-port", str(_free_port())]  # fmt: skip
    with (tmp / f"{name}.log").open("wb") as log:
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)


async def _ready(port: int) -> None:
    async with httpx.AsyncClient() as client:
        for _ in range(600):
            try:
                if (await client.get(f"http://127.0.0.1:{port}/readyz")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError(f"sidecar on {port} not ready")


async def main() -> None:
    with tempfile.TemporaryDirectory(prefix="two-agents-") as name:  # removed at the end
        await _walkthrough(Path(name))


async def _walkthrough(tmp: Path) -> None:
    planner, executor = Agent("planner-01"), Agent("executor-02")
    await planner.start()
    await executor.start()
    pa, pb = _free_port(), _free_port()
    docs = {
        "planner": _policy("planner-01", planner.url, "executor-02", pb),
        "executor": _policy("executor-02", executor.url, "planner-01", pa),
    }
    for name, doc in docs.items():
        (tmp / f"{name}.yaml").write_text(json.dumps(doc))
    procs = [_start(tmp, "planner", pa), _start(tmp, "executor", pb)]
    try:
        await _ready(pa)
        await _ready(pb)
        planner.next_url = f"http://127.0.0.1:{pa}/a2a/executor"
        executor.next_url = f"http://127.0.0.1:{pb}/a2a/planner"
        started = time.monotonic()
        await ask(f"http://127.0.0.1:{pa}/a2a/in/", "plan")  # a user asks the planner
        took = time.monotonic() - started
        print(f"planner called {len(planner.received)}x, executor {len(executor.received)}x,")
        print(f"the whole exchange in {took:.3f} s")
        # The a2a SDK fetches the agent's card before it sends a message, so a refused
        # call surfaces as its AgentCardResolutionError: that is the refusal intended.
        print("executor's answer:", executor.replies[0][:100])
        print("  (its call back to the planner was refused by its sidecar, as intended: the")
        print("  a2a SDK reports the refused card fetch as AgentCardResolutionError; the")
        print("  executor's sidecar's audit records below show CALL_CHAIN_REFUSED)")
        bypass = {"x-egress-call-chain": "planner-01,executor-02"}
        try:  # the executor going around its sidecar, to the planner's inbound route
            await ask(f"http://127.0.0.1:{pa}/a2a/in/", "again", bypass)
        except Exception as exc:  # noqa: BLE001 - the refusal, as the SDK raises it
            status = getattr(exc, "status_code", None)
            print(f"bypass refused by the planner's sidecar, as intended (HTTP {status},")
            print(f"  reported by the a2a SDK as {type(exc).__name__})")
        else:
            print("bypass NOT refused: the planner's sidecar let an unsigned chain in")
        print(f"planner called {len(planner.received)}x after the bypass")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)
        await planner.stop()
        await executor.stop()
    for name in ("planner", "executor"):
        lines = (tmp / f"{name}.log").read_text().splitlines()
        records = [json.loads(line) for line in lines if '"egress_call"' in line]
        print(f"--- {name}'s sidecar: {len(records)} audit records")
        print("   target_system method endpoint a2a_method error_code call_chain")
        for r in records:
            print("  ", r["target_system"], r["method"], r["endpoint"], r["a2a_method"],
                  r["error_code"], r["call_chain"])  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
