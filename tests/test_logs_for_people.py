"""Logs a person can read: with ``serve --log-format console`` (the default when stdout is
a terminal; GATEWAY_LOG_FORMAT too) the sidecar writes a start-up summary (the policy, its
digest, the targets, what is listening) and one readable line per call, through
structlog's ConsoleRenderer, scrubbed like JSON; JSON lines otherwise. An audit file stays
JSON. A second Ctrl-C during the drain exits at once."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import pty
import select
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway import redaction
from gateway.audit import AuditLog, set_log_format
from gateway.policy import AuditSpec
from tests.conftest import FakeUpstream, openai_target, policy_yaml

ROOT = Path(__file__).resolve().parent.parent
CALL: dict[str, Any] = {
    "trace_id": "tr-7",
    "target_system": "openai",
    "method": "POST",
    "endpoint": "/v1/chat/completions",
    "decision": "allowed",
    "success": True,
    "status_code": 200,
    "error_code": None,
    "attempts": 1,
    "latency_ms": 4.25,
    "tokens_used": 22,
    "cost_usd": 0.0001,
    "replayed": False,
}


@pytest.fixture
def console() -> Iterator[None]:
    set_log_format("console")
    try:
        yield
    finally:
        set_log_format("json")


@pytest.mark.usefixtures("console")
def test_a_call_is_one_readable_line_on_the_console() -> None:
    out = io.StringIO()
    log = AuditLog(AuditSpec(), out, agent_id="a")
    log.call(dict(CALL))
    log.call(dict(CALL, success=False, status_code=None, error_code="PERMISSION_DENIED",
                  decision="denied", attempts=0, tokens_used=None, cost_usd=None))  # fmt: skip
    ok, denied = out.getvalue().splitlines()
    assert "openai POST /v1/chat/completions -> 200 ok" in ok
    assert "latency_ms=4.25 tokens_used=22 cost_usd=0.0001 trace_id=tr-7" in ok
    assert "[info" in ok
    assert "openai POST /v1/chat/completions -> - PERMISSION_DENIED decision=denied" in denied
    assert "[warning" in denied
    for line in (ok, denied):
        assert not line.startswith("{")
        assert "sidecar_id" not in line
        assert "attempts" not in line  # one attempt, or none, says nothing


@pytest.mark.usefixtures("console")
def test_console_lines_are_scrubbed_of_secrets() -> None:
    canary = "sk-canary-CONSOLE-0001-NOTREAL"
    redaction.register(canary)
    out = io.StringIO()
    log = AuditLog(AuditSpec(chain=True), out, agent_id="a")
    log.call(dict(CALL, trace_id=f"t-{canary}"))
    log.event("policy_reload", note=canary)
    text = out.getvalue()
    assert canary not in text
    assert text.count("\n") == 2


@pytest.mark.usefixtures("console")
def test_an_audit_file_stays_json_in_console_mode(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(AuditSpec(sink="file", path=str(path), chain=True), agent_id="a")
    log.call(dict(CALL))
    log.close()
    [record] = [json.loads(line) for line in path.read_text().splitlines()]
    assert (record["event"], record["seq"], record["tokens_used"]) == ("egress_call", 1, 22)


def test_json_is_the_default_and_an_unknown_format_is_refused() -> None:
    out = io.StringIO()
    AuditLog(AuditSpec(), out, agent_id="a").call(dict(CALL))
    assert json.loads(out.getvalue())["trace_id"] == "tr-7"
    with pytest.raises(ValueError, match="json or console"):
        set_log_format("pretty")


def _serve_args(policy: Path) -> list[str]:
    return [sys.executable, "-m", "gateway", "serve", "--policy", str(policy),
            "--port", "0", "--ops-port", "0"]  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    return env | {"PYTHONPATH": str(ROOT)} | extra


def _policy(tmp_path: Path, url: str = "http://127.0.0.1:9", **server: Any) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(policy_yaml({"openai": openai_target(url)}, server=server))
    return path


@pytest.fixture
async def running() -> AsyncIterator[list[asyncio.subprocess.Process]]:
    procs: list[asyncio.subprocess.Process] = []
    yield procs
    for proc in procs:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _start(procs: list[Any], policy: Path, *flags: str, **env: str) -> Any:
    proc = await asyncio.create_subprocess_exec(
        *_serve_args(policy), *flags, cwd=ROOT, env=_env(**env),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    procs.append(proc)
    return proc


async def _line_with(proc: Any, text: str, seen: list[str]) -> str:
    while True:
        raw = await asyncio.wait_for(proc.stdout.readline(), 20)
        assert raw, ("exited", seen, (await proc.stderr.read()).decode())
        seen.append(raw.decode())
        if text in seen[-1]:
            return seen[-1]


async def test_serve_console_shows_the_start_up_summary_and_each_call(
    tmp_path: Path, upstream: FakeUpstream, running: list[Any]
) -> None:
    policy = _policy(tmp_path, upstream.url)
    proc = await _start(running, policy, "--log-format", "console")
    seen: list[str] = []
    started = await _line_with(proc, "sidecar_started", seen)
    digest = hashlib.sha256(policy.read_bytes()).hexdigest()[:16]
    assert f"policy={policy} policy_sha256={digest} targets=['openai']" in started
    listening = await _line_with(proc, "listening", seen)
    calls = listening.split("calls=")[1].split()[0]
    async with aiohttp.ClientSession() as session:
        env = {"trace_id": "tr-9", "correlation_id": "c", "target_system": "openai",
               "endpoint": "/v1/chat/completions", "method": "POST", "parameters": {},
               "api_key_ref": "env://TEST_OPENAI_KEY"}  # fmt: skip
        async with session.post(f"http://{calls}/v1/calls", json=env) as resp:
            assert resp.status == 200
    line = await _line_with(proc, "trace_id=tr-9", seen)
    assert "openai POST /v1/chat/completions -> 200 ok" in line
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(proc.wait(), 30) == 0
    assert not any(line.lstrip().startswith("{") for line in seen)


async def test_gateway_log_format_selects_and_a_wrong_one_is_a_usage_error(
    tmp_path: Path, running: list[Any]
) -> None:
    proc = await _start(running, _policy(tmp_path), GATEWAY_LOG_FORMAT="console")
    assert "listening calls=" in await _line_with(proc, "listening", [])
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(proc.wait(), 30) == 0
    proc = await _start(running, _policy(tmp_path), GATEWAY_LOG_FORMAT="pretty")
    assert await asyncio.wait_for(proc.wait(), 30) == 2
    assert b"log format must be json or console, not 'pretty'" in await proc.stderr.read()


def test_a_terminal_gets_the_console_format_with_colours(tmp_path: Path) -> None:
    policy = _policy(tmp_path)
    main, secondary = pty.openpty()
    proc = subprocess.Popen(
        _serve_args(policy), cwd=ROOT, env=_env(), stdout=secondary, stderr=subprocess.DEVNULL
    )
    os.close(secondary)
    text = ""
    try:
        for _ in range(200):  # bounded: each read waits at most 0.1 s
            if "listening" in text or not select.select([main], [], [], 0.1)[0]:
                if "listening" in text or proc.poll() is not None:
                    break
                continue
            text += os.read(main, 4096).decode(errors="replace")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        os.close(main)
    assert "sidecar_started" in text
    assert "listening" in text
    assert '{"' not in text  # not one JSON line
    assert "\x1b[" in text  # colours on a terminal


async def test_a_second_ctrl_c_exits_at_once_while_a_call_waits(
    tmp_path: Path, upstream_factory: Any, running: list[Any]
) -> None:
    release = asyncio.Event()

    async def hang(_: web.Request) -> web.StreamResponse:
        await release.wait()
        return web.json_response({})

    up = await upstream_factory(hang)
    proc = await _start(running, _policy(tmp_path, up.url, drain_s=600), "--log-format", "json")
    seen: list[str] = []
    calls = json.loads(await _line_with(proc, '"listening"', seen))["calls"]
    async with aiohttp.ClientSession() as session:
        env = {"trace_id": "t", "correlation_id": "c", "target_system": "openai",
               "endpoint": "/v1/chat/completions", "method": "POST", "parameters": {},
               "api_key_ref": "env://TEST_OPENAI_KEY", "timeout": 600}  # fmt: skip
        call = asyncio.create_task(session.post(f"http://{calls}/v1/calls", json=env))
        await asyncio.wait_for(_until_seen(up), 20)
        proc.send_signal(signal.SIGINT)
        draining = json.loads(await _line_with(proc, '"draining"', seen))
        assert draining["waiting_for"] == (
            "1 calls in flight, at most 600 s (a second Ctrl-C exits at once)"
        )
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 20) == 130  # not the 600 s drain
        interrupted = json.loads(await _line_with(proc, '"interrupted"', seen))
        assert interrupted["reason"] == "second SIGINT during the drain"
        release.set()
        with pytest.raises(aiohttp.ClientError):
            await call


async def _until_seen(up: FakeUpstream) -> None:
    while not up.seen:
        await asyncio.sleep(0.01)
