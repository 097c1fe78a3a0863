"""The demo's stand-in upstreams: local aiohttp handlers that answer in the providers'
documented shapes (an OpenAI chat completion with ``usage`` and its streamed form, its
model list and model object, an Anthropic message and its streamed form, a Gemini
``generateContent`` and ``streamGenerateContent``, a Slack ``chat.postMessage`` result, a
load balancer's HTML 502 page, a search API too slow for its caller's deadline). Each
checks the credential the sidecar injected, so a success proves the agent's reference was
resolved and attached.

Every dialect streams as its provider documents it, so each SDK's streaming helper works
against the demo: OpenAI chat SSE ending ``data: [DONE]``
(https://platform.openai.com/docs/api-reference/chat-streaming), Anthropic's named
events from ``message_start`` to ``message_stop``
(https://docs.anthropic.com/en/api/messages-streaming), Gemini's
``streamGenerateContent`` as SSE with ``?alt=sse`` and as a JSON array without
(https://ai.google.dev/api/generate-content).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

DEMO_UPSTREAM_PORT = 18090
#: Fake credentials the demo puts in its own environment for the env:// references.
DEMO_SECRETS = {
    "DEMO_OPENAI_KEY": "sk-demo-0001-NOT-A-REAL-KEY",
    "DEMO_ANTHROPIC_KEY": "ak-demo-0002-NOT-A-REAL-KEY",
    "DEMO_SLACK_TOKEN": "xoxb-demo-0003-NOT-A-REAL-TOKEN",
    "DEMO_GEMINI_KEY": "gk-demo-0004-NOT-A-REAL-KEY",
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


_ANTHROPIC_TEXT = ("Two fixes", " and one", " new flag.")
_ANTHROPIC_USAGE = {
    "input_tokens": 25,
    "output_tokens": 9,
    "cache_creation_input_tokens": 0,
    "cache_read_input_tokens": 0,
}


def _anthropic_events(message: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """``message`` as Anthropic streams it: (event name, data) from ``message_start`` to
    ``message_stop``, the text in _ANTHROPIC_TEXT's pieces."""
    start = message | {
        "content": [],
        "stop_reason": None,
        "usage": _ANTHROPIC_USAGE | {"output_tokens": 1},
    }
    events: list[tuple[str, dict[str, Any]]] = [
        ("message_start", {"type": "message_start", "message": start}),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        ),
    ]
    events += [
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": piece},
            },
        )
        for piece in _ANTHROPIC_TEXT
    ]
    events += [
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": _ANTHROPIC_USAGE["output_tokens"]},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    return events


async def _anthropic(request: web.Request) -> web.StreamResponse:
    if request.headers.get("x-api-key") != DEMO_SECRETS["DEMO_ANTHROPIC_KEY"]:
        return _unauthorized("anthropic")
    body = await request.json()
    message = {
        "id": "msg_demo_01",
        "type": "message",
        "role": "assistant",
        "model": body.get("model"),
        "content": [{"type": "text", "text": "".join(_ANTHROPIC_TEXT)}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": _ANTHROPIC_USAGE,
    }
    if not body.get("stream"):
        return web.json_response(message)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    events = _anthropic_events(message)
    for name, data in events:
        await resp.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())
        if name == "content_block_delta":
            await asyncio.sleep(_TOKEN_GAP_S)
    await resp.write_eof()
    return resp


_GEMINI_TEXT = ("Three ", "steps: freeze, ", "test, tag.")


def _gemini_chunk(text: str, last: bool) -> dict[str, Any]:
    candidate: dict[str, Any] = {
        "content": {"role": "model", "parts": [{"text": text}]},
        "index": 0,
    }
    chunk: dict[str, Any] = {"candidates": [candidate], "modelVersion": "gemini-demo"}
    if last:
        candidate["finishReason"] = "STOP"
        chunk["usageMetadata"] = {
            "promptTokenCount": 8,
            "candidatesTokenCount": 10,
            "totalTokenCount": 18,
        }
    return chunk


async def _gemini(request: web.Request) -> web.StreamResponse:
    key = request.headers.get("x-goog-api-key") or request.query.get("key")
    if key != DEMO_SECRETS["DEMO_GEMINI_KEY"]:
        return web.json_response(
            {"error": {"code": 400, "message": "API key not valid.", "status": "INVALID_ARGUMENT"}},
            status=400,
        )
    await request.read()
    method = request.match_info["method"]
    if method == "generateContent":
        return web.json_response(_gemini_chunk("".join(_GEMINI_TEXT), last=True))
    if method != "streamGenerateContent":
        raise web.HTTPNotFound
    sse = request.query.get("alt") == "sse"
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream" if sse else "application/json"}
    )
    await resp.prepare(request)
    for i, piece in enumerate(_GEMINI_TEXT):
        data = json.dumps(_gemini_chunk(piece, last=i == len(_GEMINI_TEXT) - 1))
        if sse:
            await resp.write(f"data: {data}\r\n\r\n".encode())
        else:
            await resp.write(("[" if i == 0 else ",\r\n").encode() + data.encode())
        await asyncio.sleep(_TOKEN_GAP_S)
    if not sse:
        await resp.write(b"]")
    await resp.write_eof()
    return resp


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


#: The models the OpenAI stand-in lists (https://platform.openai.com/docs/api-reference/models).
_OPENAI_MODELS = ("gpt-4o-mini", "gpt-4o")


def _openai_model(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 1686935002, "owned_by": "openai"}


async def _openai_models(request: web.Request) -> web.Response:
    """``GET /v1/models``: the list object; ``GET /v1/models/{model}``: the model, else
    OpenAI's 404 error."""
    if request.headers.get("Authorization") != f"Bearer {DEMO_SECRETS['DEMO_OPENAI_KEY']}":
        return _unauthorized("openai")
    model = request.match_info.get("model")
    if model is None:
        return web.json_response(
            {"object": "list", "data": [_openai_model(m) for m in _OPENAI_MODELS]}
        )
    if model not in _OPENAI_MODELS:
        error = {
            "message": f"The model '{model}' does not exist",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
        return web.json_response({"error": error}, status=404)
    return web.json_response(_openai_model(model))


async def _slow(_: web.Request) -> web.StreamResponse:
    await asyncio.sleep(_SLOW_S)
    return web.json_response({"results": []})


def stand_in_app() -> web.Application:
    app = web.Application()
    app.router.add_post("/openai/v1/chat/completions", _openai)
    app.router.add_get("/openai/v1/models", _openai_models)
    app.router.add_get("/openai/v1/models/{model}", _openai_models)
    app.router.add_post("/anthropic/v1/messages", _anthropic)
    app.router.add_post("/gemini/{version}/models/{model}:{method}", _gemini)
    app.router.add_post("/slack/api/chat.postMessage", _slack)
    app.router.add_get("/flaky/v1/report", _flaky)
    app.router.add_get("/slow/v1/search", _slow)
    return app
