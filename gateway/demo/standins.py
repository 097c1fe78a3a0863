"""The demo's stand-in upstreams: local aiohttp handlers that answer in the providers'
documented shapes (an OpenAI chat completion with ``usage`` and its streamed form, an
Anthropic message, a Slack ``chat.postMessage`` result, a load balancer's HTML 502 page,
a search API too slow for its caller's deadline). Each checks the credential the sidecar
injected, so a success proves the agent's reference was resolved and attached.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

DEMO_UPSTREAM_PORT = 18090
#: Fake credentials the demo puts in its own environment for the env:// references.
DEMO_SECRETS = {
    "DEMO_OPENAI_KEY": "sk-demo-0001-NOT-A-REAL-KEY",
    "DEMO_ANTHROPIC_KEY": "ak-demo-0002-NOT-A-REAL-KEY",
    "DEMO_SLACK_TOKEN": "xoxb-demo-0003-NOT-A-REAL-TOKEN",
}
_SLOW_S = 3.0
#: Seconds between two streamed tokens of the OpenAI stand-in.
_TOKEN_GAP_S = 0.15


def _unauthorized(provider: str) -> web.Response:
    return web.json_response(
        {"error": {"message": f"{provider}: missing or wrong credential", "type": "auth"}},
        status=401,
    )


async def _openai(request: web.Request) -> web.StreamResponse:
    if request.headers.get("Authorization") != f"Bearer {DEMO_SECRETS['DEMO_OPENAI_KEY']}":
        return _unauthorized("openai")
    body = await request.json()
    words = sum(len(str(m.get("content", "")).split()) for m in body.get("messages", []))
    usage = {
        "prompt_tokens": 9 + words,
        "completion_tokens": 12,
        "total_tokens": 21 + words,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    if body.get("stream"):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for piece in ("Hel", "lo", "!"):
            chunk = {
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": piece}}],
            }
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(_TOKEN_GAP_S)  # a model producing tokens, one at a time
        finish = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        await resp.write(f"data: {json.dumps(finish)}\n\n".encode())
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
    return web.json_response(
        {
            "id": "chatcmpl-demo-1",
            "object": "chat.completion",
            "model": body.get("model"),
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {
                        "role": "assistant",
                        "content": "1. Freeze. 2. Test. 3. Tag and publish.",
                    },
                }
            ],
            "usage": usage,
        }
    )


async def _anthropic(request: web.Request) -> web.StreamResponse:
    if request.headers.get("x-api-key") != DEMO_SECRETS["DEMO_ANTHROPIC_KEY"]:
        return _unauthorized("anthropic")
    body = await request.json()
    return web.json_response(
        {
            "id": "msg_demo_01",
            "type": "message",
            "role": "assistant",
            "model": body.get("model"),
            "content": [{"type": "text", "text": "Two fixes and one new flag."}],
            "stop_reason": "end_turn",
            "usage": {
                "input_tokens": 25,
                "output_tokens": 9,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        }
    )


async def _slack(request: web.Request) -> web.StreamResponse:
    if request.headers.get("Authorization") != f"Bearer {DEMO_SECRETS['DEMO_SLACK_TOKEN']}":
        return web.json_response({"ok": False, "error": "invalid_auth"})
    body = await request.json()
    return web.json_response(
        {
            "ok": True,
            "channel": body.get("channel"),
            "ts": "1764412800.000100",
            "message": {"type": "message", "text": body.get("text")},
        }
    )


async def _flaky(_: web.Request) -> web.StreamResponse:
    page = (
        "<html><head><title>502 Bad Gateway</title></head><body><center>"
        "<h1>502 Bad Gateway</h1></center><hr><center>nginx</center></body></html>"
    )
    return web.Response(status=502, text=page, content_type="text/html")


async def _slow(_: web.Request) -> web.StreamResponse:
    await asyncio.sleep(_SLOW_S)
    return web.json_response({"results": []})


def stand_in_app() -> web.Application:
    app = web.Application()
    app.router.add_post("/openai/v1/chat/completions", _openai)
    app.router.add_post("/anthropic/v1/messages", _anthropic)
    app.router.add_post("/slack/api/chat.postMessage", _slack)
    app.router.add_get("/flaky/v1/report", _flaky)
    app.router.add_get("/slow/v1/search", _slow)
    return app
