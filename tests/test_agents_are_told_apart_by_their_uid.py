"""Several agents in one pod, told apart by the kernel: real client processes under their
own UIDs (``setpriv --reuid``) call a real sidecar process over loopback TCP and over its
Unix socket. Each agent gets its own audit records and budgets, whatever id it claims; a
claim of another agent's id is refused; a UID that is no agent is refused and audited
with that UID; the OpenAI SDK, the Anthropic SDK and the MCP SDK work over the Unix
socket."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.agent_processes import (
    COMPLETION,
    MESSAGE,
    NEEDS_ROOT,
    run_as,
    shared_dir,
)
from tests.agent_processes import calls_by_trace as _calls
from tests.agent_processes import envelope_request as _envelope
from tests.conftest import envelope, openai_target, policy_yaml, wait_for
from tests.mcp_server import McpTestServer, RunningServer
from tests.processes import Process

pytestmark = NEEDS_ROOT

PLANNER, CODER, STRANGER = 64101, 64102, 64103
ANTHROPIC_KEY = "ak-fake-TEST-0002-NOTREAL"


def _budget(agent: str) -> dict[str, Any]:
    return {
        "limit_usd": 100,
        "window": "daily",
        "max_output_tokens": 100,
        "applies_to": {"agent": agent},
    }


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    with shared_dir() as path:
        yield path


@pytest.fixture
async def sidecar(
    upstream_factory: Any, socket_dir: Path, tmp_path: Path, extra_targets: dict[str, Any]
) -> AsyncIterator[tuple[Process, Any, str]]:
    async def completion(request: web.Request) -> web.StreamResponse:
        return web.json_response(MESSAGE if request.path == "/v1/messages" else COMPLETION)

    up = await upstream_factory(completion)
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        policy_yaml(
            {
                "fake-openai": openai_target(up.url),
                "fake-anthropic": {
                    "base_url": up.url,
                    "credential": {
                        "header": "x-api-key",
                        "default_ref": "env://TEST_ANTHROPIC_KEY",
                    },
                    "endpoints": [{"path": "/v1/messages", "methods": ["POST"]}],
                    "usage": "anthropic",
                },
                **extra_targets,
            },
            agents={
                "planner": {"uid": PLANNER, "targets": ["fake-openai"]},
                "coder": {"uid": CODER},
            },
            budgets={"planner-day": _budget("planner"), "coder-day": _budget("coder")},
            prices={
                model: {"input_usd_per_mtok": 1.0, "output_usd_per_mtok": 2.0}
                for model in ("fake-model-1", "claude-test")
            },
            # Stopped at the end with nothing in flight: no quiet period (default 1 s)
            # to wait out; the drain itself is tests/test_shutdown.py's.
            server={"shutdown": {"quiet_s": 0}},
        )
    )
    sock = str(socket_dir / "egress.sock")
    env = {"GATEWAY_UNIX_SOCKET": sock, "TEST_ANTHROPIC_KEY": ANTHROPIC_KEY}
    process = await Process.start(policy, env=env, timeout_s=30)
    assert process.calls_url, process.raw[-5:]
    try:
        yield process, up, sock
    finally:
        await process.stop()


@pytest.fixture(scope="module")
def mcp_server() -> Iterator[McpTestServer]:
    running = RunningServer(stateless=True, json_response=True)
    yield running.start()
    running.stop()


@pytest.fixture
def extra_targets(mcp_server: McpTestServer) -> dict[str, Any]:
    return {"tools": {"base_url": mcp_server.url, "mcp": {"tools": {"allow": ["echo"]}}}}


async def test_two_agents_get_their_own_records_and_budgets(sidecar: Any) -> None:
    process, up, sock = sidecar
    for uid, name in ((PLANNER, "planner"), (CODER, "coder")):
        results = await run_as(
            uid,
            [_envelope(process, sock, via, f"tr-{name}-{via}") for via in ("tcp", "unix")]
            # Claiming to be the policy's agent_id changes nothing: the UID decides.
            + [_envelope(process, sock, "tcp", f"tr-{name}-claims-own", agent_id=name)],
        )
        assert [r["status"] for r in results] == [200, 200, 200], results
    await wait_for(lambda: len(process.events("egress_call")) >= 6, 10)
    seen = {
        trace: (r["agent_id"], r["agent_auth"], r["peer_uid"], r["budgets"], r["success"])
        for trace, r in _calls(process).items()
    }
    assert seen == {
        "tr-planner-tcp": ("planner", "uid", PLANNER, ["planner-day"], True),
        "tr-planner-unix": ("planner", "uid", PLANNER, ["planner-day"], True),
        "tr-planner-claims-own": ("planner", "uid", PLANNER, ["planner-day"], True),
        "tr-coder-tcp": ("coder", "uid", CODER, ["coder-day"], True),
        "tr-coder-unix": ("coder", "uid", CODER, ["coder-day"], True),
        "tr-coder-claims-own": ("coder", "uid", CODER, ["coder-day"], True),
    }
    assert len(up.seen) == 6


async def test_a_claim_of_another_agents_id_is_refused(sidecar: Any) -> None:
    process, up, sock = sidecar
    results = await run_as(
        PLANNER,
        [
            _envelope(process, sock, "tcp", "tr-envelope-claim", agent_id="coder"),
            _envelope(
                process, sock, "unix", "tr-header-claim", headers={"x-egress-agent": "coder"}
            ),
        ],
    )
    for result in results:
        assert result["status"] == 403
        assert result["body"]["error"]["code"] == "PERMISSION_DENIED"
        assert result["body"]["error"]["details"] == {
            "reason": "agent_mismatch", "claimed": "coder", "agent_id": "planner",
            "agent_auth": "uid",
        }  # fmt: skip
    await wait_for(lambda: len(process.events("egress_call")) >= 2, 10)
    records = _calls(process)
    for trace in ("tr-envelope-claim", "tr-header-claim"):
        record = records[trace]
        assert (record["agent_id"], record["agent_claimed"], record["peer_uid"]) == (
            "planner", "coder", PLANNER,
        )  # fmt: skip
        assert record["budgets"] == []  # nothing booked to anyone
    assert up.seen == []


async def test_a_uid_that_is_no_agent_is_refused_with_its_uid(sidecar: Any) -> None:
    process, up, sock = sidecar
    results = await run_as(
        STRANGER,
        [_envelope(process, sock, via, f"tr-stranger-{via}", agent_id="planner")
         for via in ("tcp", "unix")],
    )  # fmt: skip
    for result, via in zip(results, ("tcp", "unix"), strict=True):
        assert result["status"] == 403
        assert result["body"]["error"]["details"] == {
            "reason": "unknown_agent", "peer_uid": STRANGER, "listener": via,
        }  # fmt: skip
    await wait_for(lambda: len(process.events("egress_call")) >= 2, 10)
    for record in _calls(process).values():
        assert (record["agent_id"], record["agent_auth"], record["peer_uid"]) == (
            "_unknown", None, STRANGER,
        )  # fmt: skip
        assert record["error_code"] == "PERMISSION_DENIED"
    assert up.seen == []


async def test_the_openai_sdk_over_the_unix_socket(sidecar: Any) -> None:
    process, up, sock = sidecar
    request = {"kind": "openai", "via": "unix", "socket": sock, "target": "fake-openai"}
    [coder] = await run_as(CODER, [request])
    [stranger] = await run_as(STRANGER, [request])
    assert coder == {"content": "pong"}
    assert stranger["error_status"] == 403
    await wait_for(lambda: len(process.events("egress_call")) >= 2, 10)
    records = process.events("egress_call")
    assert [(r["api"], r["agent_id"], r["agent_auth"], r["peer_uid"]) for r in records] == [
        ("proxy", "coder", "uid", CODER),
        ("proxy", "_unknown", None, STRANGER),
    ]
    assert len(up.seen) == 1
    assert up.seen[0].headers["Authorization"] == "Bearer sk-fake-TEST-0001-NOTREAL"


async def test_the_anthropic_sdk_over_the_unix_socket(sidecar: Any) -> None:
    process, up, sock = sidecar
    request = {"kind": "anthropic", "via": "unix", "socket": sock, "target": "fake-anthropic"}
    [coder] = await run_as(CODER, [request])
    [planner] = await run_as(PLANNER, [request])  # its targets: fake-openai only
    [stranger] = await run_as(STRANGER, [request])
    assert coder == {"content": "pong"}
    assert planner["error_status"] == 403
    assert planner["error"]["error"]["type"] == "permission_error"
    assert "fake-anthropic" in planner["error"]["error"]["message"]
    assert stranger["error_status"] == 403
    await wait_for(lambda: len(process.events("egress_call")) >= 3, 10)
    records = process.events("egress_call")
    assert [(r["api"], r["agent_id"], r["agent_auth"], r["peer_uid"]) for r in records] == [
        ("proxy", "coder", "uid", CODER),
        ("proxy", "planner", "uid", PLANNER),
        ("proxy", "_unknown", None, STRANGER),
    ]
    assert [r["error_code"] for r in records] == [None, "PERMISSION_DENIED", "PERMISSION_DENIED"]
    assert (records[0]["tokens_input"], records[0]["tokens_output"]) == (3, 1)
    [sent] = up.seen  # only the coder's call went out, with the policy's key
    assert sent.path == "/v1/messages"
    assert sent.headers["x-api-key"] == ANTHROPIC_KEY
    assert sent.headers["anthropic-version"]  # the SDK's own header passed


async def test_the_mcp_sdk_over_the_unix_socket(sidecar: Any, mcp_server: McpTestServer) -> None:
    process, _, sock = sidecar
    before = len(mcp_server.posts())
    request = {"kind": "mcp", "via": "unix", "socket": sock, "target": "tools"}
    # The coder may call every target; the planner only fake-openai (its targets).
    [coder] = await run_as(CODER, [request])
    assert coder == {"text": "hello"}
    sent = len(mcp_server.posts())
    assert sent > before
    planner = {"kind": "envelope", "via": "unix", "socket": sock, "headers": {},
               "body": envelope(target_system="tools", endpoint="/mcp", parameters={
                   "jsonrpc": "2.0", "id": 1, "method": "tools/list"})}  # fmt: skip
    [refused] = await run_as(PLANNER, [planner])
    assert refused["status"] == 403
    assert refused["body"]["error"]["details"]["reason"] == "target_not_allowed"
    assert len(mcp_server.posts()) == sent
    await wait_for(lambda: any(r["agent_id"] == "planner" for r in process.events("egress_call")))
    records = process.events("egress_call")
    assert {(r["api"], r["agent_id"], r["agent_auth"]) for r in records} == {
        ("mcp", "coder", "uid"),
        ("envelope", "planner", "uid"),
    }
