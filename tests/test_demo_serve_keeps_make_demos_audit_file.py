"""``python -m gateway.demo.serve`` writes its own audit file (demo-serve-audit.jsonl), so
that it never overwrites the demo-audit.jsonl that ``make demo`` wrote and the audit
walkthrough of docs/audit.md reads."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_demo_serve_leaves_make_demos_audit_file_alone(tmp_path: Path) -> None:
    kept = tmp_path / "demo-audit.jsonl"
    kept.write_text('{"event":"egress_call","note":"written by make demo"}\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "VAULT_"))}
    demo = subprocess.Popen(
        [sys.executable, "-m", "gateway.demo.serve", "--port", "0", "--upstream-port", "0",
         "--policy", str(ROOT / "policies" / "demo.yaml")],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=env | {"PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert demo.stdout is not None
    try:
        started = ""
        for line in demo.stdout:  # bounded by the test's timeout
            if re.search(r"sidecar on http://127\.0\.0\.1:\d+", line):
                started = line
                break
        assert "audit records in demo-serve-audit.jsonl" in started
    finally:
        demo.send_signal(signal.SIGTERM)
        demo.wait(timeout=15)
        demo.stdout.close()
    assert kept.read_text() == '{"event":"egress_call","note":"written by make demo"}\n'
    assert (tmp_path / "demo-serve-audit.jsonl").is_file()
