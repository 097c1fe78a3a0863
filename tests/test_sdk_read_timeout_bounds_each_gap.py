"""The SDK's read timeout bounds each gap of a relayed stream, not the whole stream: a
stream that lasts longer than the OpenAI SDK's timeout, its events closer together
than it, reaches the SDK whole through the drop-in route.
"""

from __future__ import annotations

import asyncio
import json

import openai
from aiohttp import web

from tests.conftest import openai_stack

AGENT = "sk-agent-placeholder-NOT-A-KEY"


async def test_a_stream_longer_than_the_sdks_read_timeout_is_not_cut(
    upstream_factory, sidecar_factory
):
    def chunk(delta: dict[str, str], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        data = {"id": "c-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
        return b"data: " + json.dumps({**data, "choices": [choice]}).encode() + b"\n\n"

    async def slow(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for n in range(8):  # 8 x 0.25 s: longer than the SDK's 1.5 s read timeout in all
            await resp.write(chunk({"content": str(n)}))
            await asyncio.sleep(0.25)  # the upstream's pace, not a synchronisation
        await resp.write(chunk({}, "stop") + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    _, sc = await openai_stack(upstream_factory, sidecar_factory, slow)
    async with openai.AsyncOpenAI(
        base_url=f"{sc.url}/proxy/openai/v1", api_key=AGENT, timeout=1.5, max_retries=0
    ) as client:
        stream = await client.chat.completions.create(model="m", messages=[], stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert text == "01234567"
    [record] = sc.audit_records()
    assert record["success"] is True
