"""A canary secret, used in every kind of call, appears in no log line, answer or error."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from tests.conftest import compile_policy, envelope

CANARY = "canary-SECRET-9f3b1c7e-NOT-REAL"


def _pieces(secret: str, size: int = 12) -> list[str]:
    return [secret[i : i + size] for i in range(len(secret) - size + 1)]


async def test_canary_never_leaves_the_outgoing_request(
    upstream_factory, sidecar_factory, monkeypatch, unused_tcp_port
):
    monkeypatch.setenv("CANARY_KEY", CANARY)
    never = asyncio.Event()

    async def upstream(request: web.Request) -> web.StreamResponse:
        mode = request.path.rsplit("/", 1)[-1]
        echo = {
            "seen_header": request.headers.get("Authorization"),
            "seen_query": request.query_string,
            "url": str(request.url),
        }
        if mode == "ok":
            return web.json_response(echo)
        if mode == "html":
            return web.Response(status=500, text=f"<pre>{echo}</pre>", content_type="text/html")
        if mode == "denied":
            return web.json_response(echo, status=401)
        if mode == "redirect":
            return web.Response(
                status=307, headers={"Location": f"http://127.0.0.1:1/x?key={CANARY}"}
            )
        if mode == "drop":
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        await never.wait()
        return web.Response()

    up = await upstream_factory(upstream)
    endpoints = [{"path": "/v1/*", "methods": ["GET", "POST"]}]
    targets = {
        "in-header": {
            "base_url": up.url,
            "endpoints": endpoints,
            "credential": {
                "header": "Authorization",
                "format": "Bearer {secret}",
                "default_ref": "env://CANARY_KEY",
            },
        },
        "in-query": {
            "base_url": up.url,
            "endpoints": endpoints,
            "credential": {"query_param": "key", "default_ref": "env://CANARY_KEY"},
        },
        "refused": {
            "base_url": f"http://127.0.0.1:{unused_tcp_port}",
            "endpoints": endpoints,
            "credential": {"query_param": "key", "default_ref": "env://CANARY_KEY"},
        },
    }
    sc = await sidecar_factory(compile_policy(targets))
    answers = []
    for target in ("in-header", "in-query"):
        for mode in ("ok", "html", "denied", "redirect", "drop", "hang"):
            for method in ("GET", "POST"):
                _, answer = await sc.call(
                    envelope(
                        target_system=target,
                        endpoint=f"/v1/{mode}",
                        method=method,
                        api_key_ref=...,
                        timeout=0.3,
                        max_retries=1,
                        parameters={},
                    )
                )
                answers.append(answer)
    _, answer = await sc.call(
        envelope(target_system="refused", endpoint="/v1/ok", api_key_ref=..., max_retries=1)
    )
    answers.append(answer)

    # The canary was really used on the wire, in both placements.
    assert any(s.headers.get("Authorization") == f"Bearer {CANARY}" for s in up.seen)
    assert any(s.query.get("key") == CANARY for s in up.seen)
    emitted = json.dumps(answers) + sc.log.getvalue()
    for piece in _pieces(CANARY):
        assert piece not in emitted, piece
    # And it was scrubbed, not just absent: the echoing upstream's answers were redacted.
    assert "[REDACTED]" in json.dumps(answers)
    codes = {a["error"]["code"] for a in answers if a["error"]}
    assert {
        "DEPENDENCY_FAILED",
        "PERMISSION_DENIED",
        "EGRESS_DENIED",
        "OUTCOME_UNKNOWN",
        "AGENT_TIMEOUT",
    } <= codes
