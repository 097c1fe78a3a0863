"""An upstream that answers a plain request with ``101 Switching Protocols``.

RFC 9110 section 15.2.2: a server switches protocols only when the request asked for it
with ``Upgrade``; the sidecar never asks, so a 101 is an upstream fault. The connection
no longer speaks HTTP after it: the sidecar must not relay it as the call's final answer
(a 101 back to the agent would switch the agent's own connection), must not wait on it
for a body, and must say what happened: 502, UPSTREAM_REJECTED, not retried (the request
did reach the upstream), one audit record.
"""

from __future__ import annotations

import time

from tests.conftest import RULED_OUT_S, SOON_S, compile_policy, envelope, openai_target


async def test_envelope_call_gets_502_at_once(switcher, sidecar_factory):
    sc = await sidecar_factory(
        compile_policy({"fake-openai": openai_target(f"http://127.0.0.1:{switcher.port}")})
    )
    started = time.monotonic()
    status, answer = await sc.call(envelope(timeout=RULED_OUT_S, max_retries=2))
    assert time.monotonic() - started < SOON_S  # not the deadline: nothing was read
    assert status == 502
    assert answer["success"] is False
    assert answer["status_code"] == 101
    assert answer["error"]["code"] == "UPSTREAM_REJECTED"
    assert answer["error"]["retryable"] is False
    assert "101" in answer["error"]["message"]
    assert "Switching Protocols" in answer["error"]["message"]
    assert switcher.requests == 1  # not sent again
    records = sc.audit_records()
    assert len(records) == 1
    assert records[0]["status_code"] == 101
    assert records[0]["error_code"] == "UPSTREAM_REJECTED"
    assert records[0]["attempts"] == 1


async def test_drop_in_route_answers_502_in_the_providers_shape(switcher, sidecar_factory):
    sc = await sidecar_factory(
        compile_policy({"fake-openai": openai_target(f"http://127.0.0.1:{switcher.port}")})
    )
    async with sc.session.post(
        sc.url + "/proxy/fake-openai/v1/chat/completions",
        json={"model": "fake-model-1", "messages": [{"role": "user", "content": "ping"}]},
        headers={"x-egress-timeout": "5"},
    ) as resp:
        assert resp.status == 502
        body = await resp.json()
    assert body["error"]["code"] == "UPSTREAM_REJECTED"
    assert "101" in body["error"]["message"]
    assert switcher.requests == 1
    assert len(sc.audit_records()) == 1


async def test_mcp_route_answers_a_jsonrpc_error(switcher, sidecar_factory):
    mcp = {"base_url": f"http://127.0.0.1:{switcher.port}/mcp", "mcp": {"tools": {"allow": ["*"]}}}
    sc = await sidecar_factory(compile_policy({"tools": mcp}))
    call = {"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": "echo"}}
    async with sc.session.post(
        sc.url + "/mcp/tools",
        json=call,
        headers={"Accept": "application/json, text/event-stream"},
    ) as resp:
        status = resp.status
        body = await resp.json()
    assert status != 101
    assert body["jsonrpc"] == "2.0"
    assert body["id"] == 3
    assert body["error"]["data"]["egress_code"] == "UPSTREAM_REJECTED"
    assert "101" in body["error"]["message"]
    assert switcher.requests == 1  # a tools/call is never sent twice
    assert len(sc.audit_records()) == 1
