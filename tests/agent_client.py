"""A client run as another UID by the identity tests (``setpriv --reuid``): reads a list
of requests (JSON) from argv[1], sends each, prints one JSON list of results.

Each request: ``{"kind": "envelope" | "openai" | "anthropic" | "mcp", "via": "tcp" |
"unix", ...}``. ``envelope``: POST /v1/calls with ``body`` and ``headers`` -> ``{status,
body}``; ``openai``: the OpenAI SDK's chat completion on /proxy/{target}/v1, and
``anthropic`` the Anthropic SDK's message on /proxy/{target} -> ``{content}`` or
``{error_status, error, retry_after}``; ``mcp``: the MCP SDK's ``echo`` tool on
/mcp/{target}.
Imports nothing of the sidecar: it stands for an agent's container.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import httpx


def _client(request: dict[str, Any]) -> tuple[httpx.Client, str]:
    if request["via"] == "unix":
        transport = httpx.HTTPTransport(uds=request["socket"])
        return httpx.Client(transport=transport, timeout=10), "http://sidecar"
    return httpx.Client(timeout=10), request["url"]


def envelope(request: dict[str, Any]) -> dict[str, Any]:
    client, base = _client(request)
    with client:
        resp = client.post(base + "/v1/calls", json=request["body"], headers=request["headers"])
        return {"status": resp.status_code, "body": resp.json()}


def openai_call(request: dict[str, Any]) -> dict[str, Any]:
    import openai

    client, base = _client(request)
    sdk = openai.OpenAI(
        base_url=f"{base}/proxy/{request['target']}/v1",
        api_key="sk-agent-own-NOTREAL",
        http_client=client,
        max_retries=0,
    )
    try:
        answer = sdk.chat.completions.create(
            model="fake-model-1", messages=[{"role": "user", "content": "ping"}], max_tokens=5
        )
    except openai.APIStatusError as exc:
        return _refused(exc.status_code, exc.body, exc.response)
    return {"content": answer.choices[0].message.content}


def anthropic_call(request: dict[str, Any]) -> dict[str, Any]:
    import anthropic
    import httpx2  # the Anthropic SDK's HTTP client: it refuses an httpx one

    assert request["via"] == "unix"
    transport = httpx2.HTTPTransport(uds=request["socket"])
    sdk = anthropic.Anthropic(
        base_url=f"http://sidecar/proxy/{request['target']}",
        api_key="ak-agent-own-NOTREAL",
        http_client=httpx2.Client(transport=transport, timeout=10),
        max_retries=0,
    )
    try:
        answer = sdk.messages.create(
            model="claude-test", max_tokens=5, messages=[{"role": "user", "content": "ping"}]
        )
    except anthropic.APIStatusError as exc:
        return _refused(exc.status_code, exc.body, exc.response)
    return {"content": answer.content[0].text}  # type: ignore[union-attr]


def _refused(status: int, body: object, response: Any) -> dict[str, Any]:
    return {
        "error_status": status,
        "error": body,
        "retry_after": response.headers.get("retry-after"),
    }


async def _mcp(request: dict[str, Any]) -> dict[str, Any]:
    import httpx2
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    transport = httpx2.AsyncHTTPTransport(uds=request["socket"])
    url = f"http://sidecar/mcp/{request['target']}"
    async with (
        httpx2.AsyncClient(transport=transport, timeout=10) as http,
        streamable_http_client(url, http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        result = await session.call_tool("echo", {"text": "hello"})
        return {"text": result.content[0].text}  # type: ignore[union-attr]


KINDS = {
    "envelope": envelope,
    "openai": openai_call,
    "anthropic": anthropic_call,
    "mcp": lambda r: asyncio.run(_mcp(r)),
}

if __name__ == "__main__":
    results = [KINDS[r["kind"]](r) for r in json.loads(sys.argv[1])]
    print(json.dumps(results))
