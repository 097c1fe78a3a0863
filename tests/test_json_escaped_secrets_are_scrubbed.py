"""A secret an upstream writes with JSON escapes (RFC 8259, section 7: any character may
be written ``\\uXXXX``, and ``/`` as ``\\/``) is a secret all the same: it never reaches
the agent, on any API, and an answer without a hidden secret keeps its bytes."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from gateway import redaction
from gateway.providers import mcp as rpc
from tests.conftest import FakeUpstream, Sidecar, compile_policy, envelope

Factory = Callable[..., Awaitable[Any]]
SECRET = "escaped-CANARY-7f3c/41aa-NOT-REAL"
CREDENTIAL = {"header": "Authorization", "format": "Bearer {secret}", "default_ref": "env://ESC"}
CALL = {"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": "echo"}}


def _escaped(text: str, every: int = 1, upper: bool = False) -> str:
    """``text`` with every ``every``-th character written as a ``\\u`` escape."""
    form = "\\u{:04X}" if upper else "\\u{:04x}"
    return "".join(form.format(ord(c)) if i % every == 0 else c for i, c in enumerate(text))


SPELLINGS = {
    "every character": _escaped(SECRET),
    "every other character": _escaped(SECRET, every=2),
    "upper-case hex": _escaped(SECRET, upper=True),
    "solidus escaped": SECRET.replace("/", "\\/"),
}


@pytest.fixture
def registered() -> str:
    redaction.register(SECRET)
    return SECRET


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_an_escaped_secret_is_redacted_and_the_json_stays_valid(
    registered: str, spelling: str
) -> None:
    raw = '{"echo": "you sent ' + SPELLINGS[spelling] + '", "n": 1}'
    assert json.loads(raw)["echo"] == f"you sent {registered}"  # the JSON does hide it
    for out in (redaction.scrub_bytes(raw.encode()).decode(), redaction.scrub(raw)):
        value = json.loads(out)
        assert value == {"echo": "you sent [REDACTED]", "n": 1}, out


@pytest.mark.parametrize(
    "raw",
    [
        b'{"text": "caf\\u00e9 \\u0041\\u0042 \\n \\/ \\"q\\""}',  # escapes, no secret
        b'{"text": "\\\\u0041"}',  # an escaped backslash, then the letters u0041
    ],
)
def test_an_answer_without_a_hidden_secret_keeps_its_bytes(registered: str, raw: bytes) -> None:
    assert redaction.scrub_bytes(raw) == raw
    assert redaction.scrub(raw.decode()) == raw.decode()


async def _escaping(request: web.Request) -> web.Response:
    secret = request.headers["Authorization"].removeprefix("Bearer ")
    message = {"jsonrpc": "2.0", "id": 3, "result": {"content": [{"type": "text", "text": "@"}]}}
    before, after = json.dumps(message).split("@")
    return web.Response(
        text=before + "you sent " + _escaped(secret) + after, content_type="application/json"
    )


@pytest.mark.parametrize("api", ["envelope", "proxy", "mcp", "a2a"])
async def test_an_escaped_secret_never_reaches_the_agent(
    api: str, upstream_factory: Factory, sidecar_factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ESC", SECRET)
    upstream: FakeUpstream = await upstream_factory(_escaping)
    targets: dict[str, Any] = {
        "plant": {
            "base_url": upstream.url,
            "endpoints": [{"path": "/v1/*", "methods": ["POST"]}],
            "credential": CREDENTIAL,
        },
        "tools": {
            "base_url": f"{upstream.url}/mcp",
            "mcp": {"tools": {"allow": ["echo"], "deny": []}},
            "credential": CREDENTIAL,
        },
        "agent": {
            "base_url": f"{upstream.url}/a2a",
            "a2a": {"agent_id": "other-agent"},
            "credential": CREDENTIAL,
        },
    }
    sidecar: Sidecar = await sidecar_factory(compile_policy(targets))
    url, headers, body = sidecar.url, {"Content-Type": "application/json"}, CALL
    if api == "envelope":
        url += "/v1/calls"
        body = envelope(target_system="plant", endpoint="/v1/x", parameters=CALL, max_retries=0)
        body.pop("api_key_ref", None)
    elif api == "proxy":
        url += "/proxy/plant/v1/x"
    elif api == "a2a":
        url += "/a2a/agent"
        body = {"jsonrpc": "2.0", "id": 3, "method": "tasks/get", "params": {"id": "task-1"}}
    else:
        url += "/mcp/tools"
        headers["Accept"] = rpc.ACCEPT
    async with sidecar.session.post(url, data=json.dumps(body), headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        got = await resp.read()
    decoded = json.dumps(json.loads(got))  # the agent's JSON parser undoes the escapes
    for i in range(len(SECRET) - 11):
        assert SECRET[i : i + 12] not in decoded, (api, decoded[:400])
    assert "[REDACTED]" in decoded, decoded[:400]
    assert [s.headers["Authorization"] for s in upstream.seen] == [f"Bearer {SECRET}"]
