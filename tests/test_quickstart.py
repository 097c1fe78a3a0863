"""A platform engineer's first hour: the README's "Calling the sidecar" walkthrough run as
written (no Vault: policies/quickstart.yaml and the demo's stand-in upstream), the
warnings of ``egress-gateway validate`` about env:// variables, the URL variable that
``egress-gateway call`` shares with the Helm chart, and what a trailing slash does to the
endpoint allowlist."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.policy import parse_policy
from tests.conftest import FakeUpstream, Sidecar, compile_policy, envelope, openai_target

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
QUICKSTART = ROOT / "policies" / "quickstart.yaml"
WALKTHROUGH_TIMEOUT_S = 90.0
STANDIN_PORT, SIDECAR_PORT = "18090", "8181"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def walkthrough() -> str:
    """The shell block of the README's "Calling the sidecar" section."""
    text = README.read_text()
    start = text.index("## Calling the sidecar")
    section = text[start : text.index("\n## ", start)]
    found = re.search(r"```sh\n(.*?)```", section, re.DOTALL)
    assert found, "the section has a ```sh block"
    return found.group(1)


def test_the_readme_walkthrough_runs_as_written(tmp_path: Path) -> None:
    venv = Path(sys.prefix)
    if not (venv / "bin" / "activate").is_file():
        pytest.skip("the walkthrough activates a venv: run the tests from one (make test)")
    script = walkthrough()
    assert "policies/quickstart.yaml" in script
    assert "vault" not in script.lower()
    # Run from a copy of the repository's files the walkthrough names, on free ports (other
    # tests may run beside it): the same commands, the same policy, other numbers.
    standin, calls, ops = free_port(), free_port(), free_port()
    (tmp_path / "policies").mkdir()
    (tmp_path / "examples").mkdir()
    policy = QUICKSTART.read_text()
    assert f"127.0.0.1:{STANDIN_PORT}/openai" in policy
    (tmp_path / "policies" / "quickstart.yaml").write_text(
        policy.replace(f":{STANDIN_PORT}", f":{standin}")
    )
    for example in re.findall(r"examples/[\w.-]+\.json", script):
        (tmp_path / example).write_bytes((ROOT / example).read_bytes())
    (tmp_path / ".venv").symlink_to(venv)
    script = script.replace(STANDIN_PORT, str(standin)).replace(SIDECAR_PORT, str(calls))
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("GATEWAY_", "EGRESS_GATEWAY_", "VAULT_", "OPENAI_"))
    }
    env |= {
        "GATEWAY_PORT": str(calls),  # the walkthrough's 8181, the default
        "GATEWAY_OPS_PORT": str(ops),
        "EGRESS_GATEWAY_URL": f"http://127.0.0.1:{calls}",
        "PYTHONPATH": str(ROOT),
    }
    proc = subprocess.Popen(
        ["bash", "-e", "-c", script],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its background jobs are ours to end if it fails
    )
    try:
        out, err = proc.communicate(timeout=WALKTHROUGH_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=10)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # anything the script left behind
    assert proc.returncode == 0, (out, err)
    assert "policies/quickstart.yaml: ok (2 targets, agent_id quickstart-agent)" in out
    assert "warning" not in err  # the walkthrough exports the key the policy names
    # curl's answer ends with a newline (-w '\n'): a line of its own, nothing glued to it.
    answers = [json.loads(line) for line in out.splitlines() if line.startswith('{"success"')]
    assert len(answers) == 1, out  # curl's answer, on one line
    assert answers[0]["success"] is True
    assert answers[0]["data"]["id"] == "chatcmpl-demo-1"  # the stand-in saw the right key
    assert answers[0]["tokens_used"] == 22
    # `egress-gateway call` found the sidecar through EGRESS_GATEWAY_URL and printed it.
    called = json.loads(out[out.index('{\n  "success"') :].split("\n}\n")[0] + "\n}")
    assert called["success"] is True
    assert called["trace_id"] == "tr-demo-0001"
    # `egress-gateway audit show sidecar.log`: one audit record of each call, as a table.
    rows = [line for line in out.splitlines() if "POST /v1/chat/completions" in line]
    assert [row.split()[-1] for row in rows] == ["tr-42", "tr-demo-0001"], out
    assert all(" 200 " in row and " ok " in row for row in rows), rows


def test_the_quickstart_policy_shows_each_credential_key() -> None:
    policy = parse_policy(QUICKSTART.read_text(), str(QUICKSTART))
    openai = policy.targets["openai"].credential
    gemini = policy.targets["gemini"].credential
    assert openai is not None
    assert gemini is not None
    assert (openai.header, openai.format) == ("Authorization", "Bearer {secret}")
    assert openai.default_ref == "env://OPENAI_API_KEY"
    assert openai.allowed_refs == ["file:///var/run/secrets/openai/batch-key"]
    assert gemini.query_param == "key"
    assert policy.secrets.vault is None  # no Vault


# --- validate: env:// variables ---------------------------------------------------------

ENV_POLICY = """\
version: 1
agent_id: a
targets:
  llm:
    base_url: https://llm.example
    credential:
      header: Authorization
      default_ref: env://QS_SET_KEY
      allowed_refs: ["env://QS_UNSET_KEY", "file:///run/k", "env://QS_EMPTY_KEY"]
    endpoints: [{path: /v1/x, methods: [POST]}]
  other:
    base_url: https://other.example
    endpoints: [{path: /y, methods: [GET]}]
"""


def test_validate_warns_about_env_refs_unset_here_and_still_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(ENV_POLICY)
    monkeypatch.setenv("QS_SET_KEY", "sk-1")
    monkeypatch.delenv("QS_UNSET_KEY", raising=False)
    monkeypatch.setenv("QS_EMPTY_KEY", "\n")  # what the sidecar would cut to nothing
    assert main(["validate", str(path)]) == 0
    out, err = capsys.readouterr()
    assert out == f"{path}: ok (2 targets, agent_id a)\n"
    tail = (
        "the sidecar answers SECRET_NOT_FOUND until its environment has it (--no-env-check: skip)"
    )
    assert err.splitlines() == [
        f"{path}:9: targets.llm.credential.allowed_refs.0: warning: env://QS_UNSET_KEY: "
        f"QS_UNSET_KEY is not set in this environment; {tail}",
        f"{path}:9: targets.llm.credential.allowed_refs.2: warning: env://QS_EMPTY_KEY: "
        f"QS_EMPTY_KEY is empty in this environment; {tail}",
    ]

    assert main(["validate", "--no-env-check", str(path)]) == 0
    assert capsys.readouterr() == (f"{path}: ok (2 targets, agent_id a)\n", "")

    monkeypatch.setenv("QS_UNSET_KEY", "sk-2")
    monkeypatch.setenv("QS_EMPTY_KEY", "sk-3")
    assert main(["validate", str(path)]) == 0
    assert capsys.readouterr().err == ""


def test_an_invalid_policy_gets_its_problems_not_env_warnings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(ENV_POLICY.replace("agent_id: a", "agent_id: a\nagnet: b"))
    monkeypatch.delenv("QS_UNSET_KEY", raising=False)
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"{path}:3: agnet: unknown key" in err
    assert "warning" not in err


# --- call: the URL variable -------------------------------------------------------------


class _Named(ThreadingHTTPServer):
    name = ""


class _Answer(BaseHTTPRequestHandler):
    server: _Named

    def do_POST(self) -> None:
        body = json.dumps({"success": True, "server": self.server.name, "path": self.path})
        body = body.encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        """Quiet."""


@pytest.fixture
def fake_sidecars() -> Iterator[tuple[str, str]]:
    """Two loopback servers answering every POST with success and their name: (a, b)."""
    servers = [_Named(("127.0.0.1", 0), _Answer) for _ in range(2)]
    servers[0].name, servers[1].name = "a", "b"
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for thread in threads:
        thread.start()
    try:
        a, b = (f"http://127.0.0.1:{s.server_address[1]}" for s in servers)
        yield a, b
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


@pytest.mark.parametrize(
    ("env", "flag", "expected", "deprecated"),
    [
        ({"EGRESS_GATEWAY_URL": "a"}, None, "a", False),
        ({"GATEWAY_URL": "a"}, None, "a", True),
        ({"EGRESS_GATEWAY_URL": "a", "GATEWAY_URL": "b"}, None, "a", False),
        ({"EGRESS_GATEWAY_URL": "b"}, "a", "a", False),
    ],
)
def test_call_finds_the_sidecar_at_the_charts_variable(
    fake_sidecars: tuple[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    env: dict[str, str],
    flag: str | None,
    expected: str,
    deprecated: bool,
) -> None:
    urls = dict(zip("ab", fake_sidecars, strict=True))
    monkeypatch.delenv("EGRESS_GATEWAY_URL", raising=False)
    monkeypatch.delenv("GATEWAY_URL", raising=False)
    for name, which in env.items():
        monkeypatch.setenv(name, urls[which])
    envelope_file = tmp_path / "e.json"
    envelope_file.write_text("{}")
    args = ["call", str(envelope_file), *(["--url", urls[flag]] if flag else [])]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {"success": True, "server": expected, "path": "/v1/calls"}
    assert ("GATEWAY_URL is deprecated, set EGRESS_GATEWAY_URL" in err) is deprecated


def test_call_defaults_to_the_sidecars_port(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.delenv("EGRESS_GATEWAY_URL", raising=False)
    monkeypatch.delenv("GATEWAY_URL", raising=False)
    envelope_file = tmp_path / "e.json"
    envelope_file.write_text("{}")
    # Nothing listens on a port just freed: the message names the default URL.
    monkeypatch.setattr("gateway.cli.DEFAULT_URL", f"http://127.0.0.1:{free_port()}")
    assert main(["call", str(envelope_file), "--timeout", "5"]) == 1
    assert "cannot reach the sidecar at http://127.0.0.1:" in capsys.readouterr().err


# --- the allowlist and a trailing slash -------------------------------------------------


async def test_a_trailing_slash_is_not_significant_to_the_allowlist(
    upstream: FakeUpstream, sidecar_factory: Callable[..., Awaitable[Sidecar]]
) -> None:
    target = openai_target(
        upstream.url,
        endpoints=[
            {"path": "/v1/chat/completions", "methods": ["POST"]},
            {"path": "/v1/files/", "methods": ["GET"]},  # written with one
        ],
    )
    sidecar = await sidecar_factory(compile_policy({"fake-openai": target}))
    cases = [
        ("POST", "/v1/chat/completions/"),  # rule without, endpoint with
        ("GET", "/v1/files"),  # rule with, endpoint without
        ("GET", "/v1/files/"),
    ]
    for method, endpoint in cases:
        status, body = await sidecar.call(envelope(method=method, endpoint=endpoint))
        assert (status, body["success"]) == (200, True), body
    # Forwarded as the agent wrote it: the slash is the upstream's business.
    assert [(s.method, s.path) for s in upstream.seen] == cases
    # A trailing slash is one thing; an empty segment is not a clean path.
    status, body = await sidecar.call(envelope(endpoint="/v1/chat//completions"))
    assert status == 403
    assert body["error"]["details"]["reason"] == "endpoint_not_a_path"
    assert upstream.hits == len(cases)
