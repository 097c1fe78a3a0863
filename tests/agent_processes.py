"""Agents as real processes under their own UIDs, for the identity tests: a directory the
agents' UIDs may enter (for the sidecar's Unix socket), tests/agent_client.py run as a
UID (``setpriv --reuid``), the envelope requests it sends, and the upstream's answers."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import envelope
from tests.processes import Process

#: Skip a module whose agents run as other UIDs where that cannot be done.
NEEDS_ROOT = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="runs clients as other UIDs: needs root and setpriv",
)
CLIENT = Path(__file__).with_name("agent_client.py")
COMPLETION = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 0,
    "model": "fake-model-1",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "pong"}, "finish_reason": "stop"}
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}
MESSAGE = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "model": "claude-test",
    "content": [{"type": "text", "text": "pong"}],
    "stop_reason": "end_turn",
    "stop_sequence": None,
    "usage": {"input_tokens": 3, "output_tokens": 1},
}


@contextmanager
def shared_dir() -> Iterator[Path]:
    """A fresh directory every UID may enter (not under pytest's tmp_path: its parents
    are 0700, closed to the agents' UIDs); removed after."""
    path = Path(tempfile.mkdtemp(prefix="egress-agents-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def run_as(uid: int, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run tests/agent_client.py as ``uid`` (its own group, no other groups)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/tmp"}
    proc = await asyncio.create_subprocess_exec(
        "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
        sys.executable, str(CLIENT), json.dumps(requests),
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()[-3000:]
    results: list[dict[str, Any]] = json.loads(out)
    return results


def envelope_request(
    process: Process, sock: str, via: str, trace: str, **kw: Any
) -> dict[str, Any]:
    """An agent_client ``envelope`` request to ``process`` over ``via`` (tcp or unix):
    the base envelope with ``trace_id`` ``trace``, ``max_tokens`` 5 and ``kw``'s fields
    (``headers``: the request's headers)."""
    headers = kw.pop("headers", {})
    body = envelope(trace_id=trace, parameters={**envelope()["parameters"], "max_tokens": 5})
    return {
        "kind": "envelope", "via": via, "url": process.calls_url, "socket": sock,
        "body": {**body, **kw}, "headers": headers,
    }  # fmt: skip


def calls_by_trace(process: Process) -> dict[str, dict[str, Any]]:
    """The process's ``egress_call`` audit records by ``trace_id``."""
    return {r["trace_id"]: r for r in process.events("egress_call")}
