"""``egress-gateway approvals ...`` and ``dead-letters ...`` against a real sidecar's ops
listener: list, show, decide, replay and discard, and the refusals (no token, wrong
token, unknown id, twice)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from gateway.console import cli as desk_cli
from tests.conftest import FakeUpstream, Sidecar, compile_policy, envelope, openai_target
from tests.desk_helpers import TOKEN, Ops, ops_factory

__all__ = ["ops_factory"]  # a fixture, imported for pytest

Factory = Callable[..., Awaitable[Any]]
OPERATORS = {"alice": {"token_ref": "env://ALICE_TOKEN"}}


@pytest.fixture(autouse=True)
def _operator_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALICE_TOKEN", TOKEN)
    monkeypatch.delenv(desk_cli.TOKEN_ENV, raising=False)


async def cli(ops: Ops, *argv: str, token_file: Path | None = None) -> tuple[int, str, str]:
    """Run the command in a thread (it blocks on urllib); ``(exit code, stdout, stderr)``."""
    url = f"http://127.0.0.1:{ops.server.port}"
    extra = ["--ops-url", url] + (["--token-file", str(token_file)] if token_file else [])
    out, err = io.StringIO(), io.StringIO()

    def run() -> int:
        from gateway.cli import main

        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            return main([*argv, *extra])

    code = await asyncio.to_thread(run)
    return code, out.getvalue(), err.getvalue()


async def test_approvals_and_dead_letters_from_the_command_line(
    upstream_factory: Factory, sidecar_factory: Factory, ops_factory: Factory, tmp_path: Path
) -> None:
    down = True

    async def handler(_: web.Request) -> web.StreamResponse:
        return web.json_response({"ok": not down}, status=503 if down else 200)

    upstream: FakeUpstream = await upstream_factory(handler)
    held = openai_target(
        upstream.url, approval={"endpoints": [{"path": "/v1/chat/*", "methods": ["POST"]}]}
    )
    letters = openai_target(upstream.url, dead_letter=True, retry={"max_retries": 0})
    policy = compile_policy({"held": held, "letters": letters}, operators=OPERATORS)
    sc: Sidecar = await sidecar_factory(policy)
    ops: Ops = await ops_factory(sc)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")

    _, answer = await sc.call(envelope(target_system="held", timeout=0.05))
    approval_id = answer["error"]["details"]["approval_id"]
    code, out, err = await cli(ops, "approvals", "list")
    assert code == 1
    assert "operator token is required" in err
    bad = tmp_path / "bad"
    bad.write_text("wrong")
    assert (await cli(ops, "approvals", "list", token_file=bad))[0] == 1
    code, out, _ = await cli(ops, "approvals", "list", token_file=token_file)
    assert code == 0
    assert approval_id in out
    assert "pending" in out
    code, out, _ = await cli(ops, "approvals", "show", approval_id, token_file=token_file)
    assert json.loads(out)["arguments"]["parameters"]["messages"][0]["content"] == "ping"
    code, out, _ = await cli(ops, "approvals", "deny", approval_id, token_file=token_file)
    assert (code, json.loads(out)["state"]) == (0, "denied")
    code, _, err = await cli(ops, "approvals", "approve", approval_id, token_file=token_file)
    assert code == 1
    assert "already_decided" in err
    code, _, err = await cli(ops, "approvals", "approve", "apr_nope", token_file=token_file)
    assert code == 1
    assert "unknown_approval" in err
    assert (await cli(ops, "approvals", "approve"))[0] == 2  # no id

    await sc.call(envelope(target_system="letters", max_retries=0))
    code, out, _ = await cli(ops, "dead-letters", "list", token_file=token_file)
    [line] = out.splitlines()
    letter_id = line.split()[0]
    assert "DEPENDENCY_FAILED" in line
    down = False
    hits = upstream.hits
    code, out, _ = await cli(ops, "dead-letters", "replay", letter_id, token_file=token_file)
    assert (code, json.loads(out)["response"]["success"]) == (0, True)
    assert upstream.hits == hits + 1
    code, _, err = await cli(ops, "dead-letters", "discard", letter_id, token_file=token_file)
    assert code == 1
    assert "unknown_dead_letter" in err


async def test_what_an_agent_wrote_cannot_drive_the_operators_terminal(
    upstream_factory: Factory, sidecar_factory: Factory, ops_factory: Factory, tmp_path: Path
) -> None:
    """An endpoint (or MCP tool name, or argument) is the agent's text: a C1 control
    (U+009B is CSI to a terminal) or an ESC in it is printed as an escape, never raw."""

    async def handler(_: web.Request) -> web.StreamResponse:
        return web.json_response({"ok": False}, status=503)

    upstream: FakeUpstream = await upstream_factory(handler)
    endpoints = [{"path": "/v1/*", "methods": ["POST"]}]
    held = openai_target(
        upstream.url,
        endpoints=endpoints,
        approval={"endpoints": [{"path": "/v1/*", "methods": ["POST"]}]},
    )
    letters = openai_target(
        upstream.url, endpoints=endpoints, dead_letter=True, retry={"max_retries": 0}
    )
    sc: Sidecar = await sidecar_factory(
        compile_policy({"held": held, "letters": letters}, operators=OPERATORS)
    )
    ops: Ops = await ops_factory(sc)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    evil = "/v1/x\u009b2J\u009b31mOK"
    arguments = {"note": "\u009b2J\u001b]52;c;cHduZWQ=\u0007"}
    await sc.call(envelope(target_system="held", endpoint=evil, parameters=arguments, timeout=0.05))
    await sc.call(envelope(target_system="letters", endpoint=evil, max_retries=0))
    outputs = []
    for argv in (("approvals", "list"), ("dead-letters", "list")):
        code, out, _ = await cli(ops, *argv, token_file=token_file)
        assert code == 0
        outputs.append(out)
    [approval] = await sc.gateway.pipeline.approvals.store.recent(1)
    code, out, _ = await cli(ops, "approvals", "show", approval["id"], token_file=token_file)
    assert json.loads(out)["arguments"]["parameters"] == arguments  # still the same JSON
    outputs.append(out)
    for out in outputs:
        assert not any(0x80 <= ord(c) <= 0x9F or c in "\x1b\x07" for c in out), repr(out)
