"""The drop-in route answers in its target's shape, and only the sidecar speaks
``x-egress-*``: a refusal before the egress decision (a bad ``x-egress-timeout``, a
secret reference the target does not allow, a body over the limit) is the provider's
error body, and an upstream's own ``x-egress-*`` headers never reach the agent.
"""

from __future__ import annotations

import pytest
from aiohttp import web

from tests.conftest import compile_policy, openai_stack

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("headers", "body", "status"),
    [
        ({"x-egress-timeout": "soon"}, b"{}", 400),
        ({"x-egress-timeout": "0"}, b"{}", 400),
        ({"x-egress-secret-ref": "env://HOME"}, b"{}", 403),
        ({}, b"x" * 8192, 413),
    ],
)
async def test_a_refusal_before_the_decision_has_the_targets_error_shape(
    upstream_factory, sidecar_factory, headers: dict[str, str], body: bytes, status: int
):
    up = await upstream_factory()
    spec = {
        "base_url": up.url,
        "credential": {"header": "x-api-key", "default_ref": "env://TEST_OPENAI_KEY"},
        "endpoints": [{"path": "/v1/messages", "methods": ["POST"]}],
        "usage": "anthropic",
    }
    sc = await sidecar_factory(compile_policy({"claude": spec}, server={"max_request_bytes": 4096}))
    url = f"{sc.url}/proxy/claude/v1/messages"  # no anthropic-version: curl, not the SDK
    headers = {"Content-Type": "application/json", **headers}
    async with sc.session.post(url, data=body, headers=headers) as resp:
        assert resp.status == status
        answer = await resp.json()
    assert answer["type"] == "error"  # Anthropic's shape, not OpenAI's
    assert answer["error"]["details"]["error_code"] == resp.headers["x-egress-error-code"]
    assert up.hits == 0


@pytest.mark.parametrize("status", [200, 503])
async def test_an_upstream_cannot_send_the_sidecars_own_headers(
    upstream_factory, sidecar_factory, status: int
):
    spoofed = {
        "x-egress-error-code": "SPOOFED",
        "X-Egress-Retryable": "true",
        "x-egress-trace-id": "not-this-call",
        "x-egress-replayed": "true",
    }

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "busy"}}, status=status, headers=spoofed)

    _, sc = await openai_stack(upstream_factory, sidecar_factory, handler, retry={"max_retries": 0})
    url = f"{sc.url}/proxy/openai/v1/chat/completions"
    async with sc.session.post(url, json=CHAT) as resp:
        assert resp.status == status
        headers = resp.headers
    [record] = sc.audit_records()
    assert headers.getall("x-egress-trace-id") == [record["trace_id"]]
    assert "x-egress-replayed" not in headers
    assert headers.get("x-upstream-egress-replayed") == "true"  # kept, under its own name
    if status == 200:
        assert "x-egress-error-code" not in headers
        assert "x-egress-retryable" not in headers
    else:
        assert headers.getall("x-egress-error-code") == ["DEPENDENCY_FAILED"]
        assert headers.getall("x-egress-retryable") == ["true"]
