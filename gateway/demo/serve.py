"""``python -m gateway.demo.serve``: the demo's stand-ins and sidecar, left running.

``make demo`` sends the example envelopes and stops. This starts the same setup (the
stand-in APIs on 127.0.0.1:18090, a local OpenBao dev server when ``bao`` is installed,
the sidecar with ``policies/demo.yaml`` on its ``server.port``, 127.0.0.1:18080) and
keeps it up until Ctrl-C or SIGTERM, so that an agent of your own can call it: the
"Python client" example of docs/api/envelope.md does. Audit records go to
``demo-serve-audit.jsonl`` (not ``make demo``'s ``demo-audit.jsonl``, which would be
overwritten), or ``--audit``.
``--port 0`` / ``--upstream-port 0`` take free ports (the tests do).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Final

from aiohttp import web
from rich.console import Console

from gateway.demo.run import _repoint, _with_vault
from gateway.demo.standins import DEMO_SECRETS, DEMO_UPSTREAM_PORT, stand_in_app
from gateway.policy import PolicyError, load_policy
from gateway.server import create_app
from gateway.server.runtime import Gateway

#: The audit file of a demo left running: apart from ``make demo``'s (demo-audit.jsonl).
SERVE_AUDIT: Final = "demo-serve-audit.jsonl"


async def serve_demo(
    *, policy_path: str, port: int | None, upstream_port: int, audit_path: str
) -> int:
    """Run until SIGINT or SIGTERM; 0 on a clean stop, 1 when something cannot start."""
    console = Console(highlight=False, soft_wrap=True)
    try:
        policy = load_policy(policy_path)
    except PolicyError as exc:
        console.print(f"[red]{exc}[/red]")
        return 1
    os.environ.update(DEMO_SECRETS)
    vault = None
    runners: list[web.AppRunner] = []
    audit = Path(audit_path).open("w", encoding="utf-8")  # noqa: SIM115 - closed below
    try:
        if policy.policy.secrets.vault is not None:
            policy, vault = await _with_vault(policy, console)
        stand_ins = web.AppRunner(stand_in_app(), access_log=None, shutdown_timeout=0.5)
        await stand_ins.setup()
        runners.append(stand_ins)
        await web.TCPSite(stand_ins, "127.0.0.1", upstream_port).start()
        bound_upstream = stand_ins.addresses[0][1]
        if bound_upstream != DEMO_UPSTREAM_PORT:
            policy = _repoint(policy, bound_upstream)
        sidecar = web.AppRunner(
            create_app(Gateway(policy, log_stream=audit)), access_log=None, shutdown_timeout=0.5
        )
        await sidecar.setup()
        runners.append(sidecar)
        listen = policy.policy.server.port if port is None else port
        await web.TCPSite(sidecar, "127.0.0.1", listen).start()
        url = "http://{}:{}".format(*sidecar.addresses[0][:2])
        console.print(
            f"sidecar on {url} with policy {policy_path}; stand-in APIs on "
            f"127.0.0.1:{bound_upstream}; audit records in {audit_path}. Ctrl-C stops."
        )
        sys.stdout.flush()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        return 0
    except OSError as exc:
        console.print(f"[red]cannot start the demo: {exc.strerror or exc}[/red]")
        return 1
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
        if vault is not None:
            await vault.stop()
        audit.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.demo.serve", description=__doc__)
    parser.add_argument("--policy", default="policies/demo.yaml")
    parser.add_argument("--port", type=int, default=None, help="default: the policy's port")
    parser.add_argument("--upstream-port", type=int, default=DEMO_UPSTREAM_PORT)
    parser.add_argument("--audit", default=SERVE_AUDIT, help=f"audit file (default {SERVE_AUDIT})")
    args = parser.parse_args(argv)
    return asyncio.run(
        serve_demo(
            policy_path=args.policy,
            port=args.port,
            upstream_port=args.upstream_port,
            audit_path=args.audit,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
