"""What ``egress-gateway`` prints for a person: ``call ... | head`` stops quietly (no
BrokenPipe traceback), a replayed answer says so on stderr, and ``--help`` texts are plain
text (no reST markup, no "(argparse)")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Large enough that ``head`` has gone before ``call`` has printed it all.
BIG_ANSWER = {
    "success": True, "status_code": 200, "error": None, "latency_ms": 1.0, "tokens_used": None,
    "data": {"lines": [f"line {i}" for i in range(200_000)]}, "replayed": False,
}  # fmt: skip


class _Answers(BaseHTTPRequestHandler):
    answer: dict[str, object] = BIG_ANSWER

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps(self.answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def sidecar_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        _Answers.answer = BIG_ANSWER


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")} | {
        "PYTHONPATH": str(ROOT)
    }


def test_call_piped_into_head_stops_without_a_traceback(sidecar_url: str) -> None:
    script = (
        f"set -o pipefail; {sys.executable} -m gateway call --url {sidecar_url} "
        f"{ROOT}/examples/01-openai-chat.json | head -n 3"
    )
    run = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60
    )
    assert run.stdout.splitlines()[0] == "{"
    assert len(run.stdout.splitlines()) == 3
    assert run.stderr == ""  # no "BrokenPipeError", no "Exception ignored"
    assert run.returncode == 141  # 128 + SIGPIPE, as a shell reports cat's


@pytest.mark.parametrize("replayed", [True, False])
def test_a_replayed_answer_says_so(sidecar_url: str, replayed: bool) -> None:
    _Answers.answer = {"success": True, "status_code": 200, "data": {}, "replayed": replayed}
    run = subprocess.run(
        [sys.executable, "-m", "gateway", "call", "--url", sidecar_url,
         str(ROOT / "examples" / "01-openai-chat.json")],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0
    assert json.loads(run.stdout)["replayed"] is replayed
    note = "replayed the stored answer of this idempotency key; the upstream was not called"
    assert (note in run.stderr) is replayed


@pytest.mark.parametrize(
    "command", [[], ["serve"], ["validate"], ["call"], ["init"], ["audit"], ["audit", "show"]]
)
def test_help_texts_are_plain_text(command: list[str]) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "gateway", *command, "--help"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "``" not in run.stdout
    assert ":func:" not in run.stdout
    assert ":mod:" not in run.stdout
    assert "(argparse)" not in run.stdout
