"""The demo's stand-ins stream in every dialect they imitate, so that each provider's SDK
streaming helper works against the demo: the real SDKs (openai, anthropic, google-genai)
on the sidecar's drop-in routes, with the starter policy of ``egress-gateway init`` whose
``base_url`` points at the stand-ins instead of the real APIs."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import anthropic
import httpx2
import openai
import pytest
from aiohttp.test_utils import TestServer
from google import genai
from google.genai import types as genai_types

from gateway.demo.standins import DEMO_SECRETS, stand_in_app
from gateway.policy import PolicySet, parse_policy
from gateway.policy.starters import starter_policy
from tests.conftest import Sidecar

REAL = {
    "openai": "https://api.openai.com",
    "anthropic": "https://api.anthropic.com",
    "gemini": "https://generativelanguage.googleapis.com",
}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def demo(
    sidecar_factory: Callable[..., Awaitable[Sidecar]], monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Sidecar]:
    """A sidecar with the starter policy for all three providers, each base_url the stand-in."""
    stand_ins = TestServer(stand_in_app(), host="127.0.0.1")
    await stand_ins.start_server()
    text = starter_policy(list(REAL))
    for name, url in REAL.items():
        text = text.replace(
            f"base_url: {url}", f"base_url: http://127.0.0.1:{stand_ins.port}/{name}"
        )
    text = text.replace("\ntargets:", "\negress: {allow_cidrs: ['127.0.0.0/8']}\ntargets:")
    monkeypatch.setenv("OPENAI_API_KEY", DEMO_SECRETS["DEMO_OPENAI_KEY"])
    monkeypatch.setenv("ANTHROPIC_API_KEY", DEMO_SECRETS["DEMO_ANTHROPIC_KEY"])
    monkeypatch.setenv("GEMINI_API_KEY", DEMO_SECRETS["DEMO_GEMINI_KEY"])
    yield await sidecar_factory(PolicySet.compile(parse_policy(text)))
    await stand_ins.close()


def streamed_record(sc: Sidecar) -> dict[str, object]:
    [record] = sc.audit_records()
    assert record["api"] == "proxy"
    assert record["success"] is True
    assert record["stream"] is True
    return record


async def test_anthropic_messages_stream_works_against_the_demo(demo: Sidecar) -> None:
    async with (
        anthropic.AsyncAnthropic(
            base_url=f"{demo.url}/proxy/anthropic", api_key="unused", max_retries=0
        ) as client,
        client.messages.stream(model="claude-demo", max_tokens=64, messages=MESSAGES) as stream,
    ):
        text = "".join([piece async for piece in stream.text_stream])
        final = await stream.get_final_message()
    assert text == "Two fixes and one new flag."
    assert final.stop_reason == "end_turn"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (25, 9)
    assert streamed_record(demo)["tokens_used"] == 34


async def test_anthropic_without_stream_is_one_message(demo: Sidecar) -> None:
    async with anthropic.AsyncAnthropic(
        base_url=f"{demo.url}/proxy/anthropic", api_key="unused", max_retries=0
    ) as client:
        message = await client.messages.create(
            model="claude-demo", max_tokens=64, messages=MESSAGES
        )
    assert message.content[0].text == "Two fixes and one new flag."  # type: ignore[union-attr]


async def test_openai_chat_stream_works_against_the_demo(demo: Sidecar) -> None:
    async with openai.AsyncOpenAI(
        base_url=f"{demo.url}/proxy/openai/v1", api_key="unused", max_retries=0
    ) as client:
        stream = await client.chat.completions.create(
            model="gpt-4o-mini",
            messages=MESSAGES,  # type: ignore[arg-type]
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello!"
    assert streamed_record(demo)["tokens_used"] == 22


@contextlib.asynccontextmanager
async def gemini_client(sc: Sidecar) -> AsyncIterator[genai.Client]:
    transport = httpx2.AsyncClient()  # the SDK's own option (see tests/test_proxy_sdk.py)
    client = genai.Client(
        api_key="unused",
        http_options=genai_types.HttpOptions(
            base_url=f"{sc.url}/proxy/gemini", httpx_async_client=transport
        ),
    )
    try:
        yield client
    finally:
        await client.aio.aclose()
        await transport.aclose()


async def test_gemini_stream_generate_content_works_against_the_demo(demo: Sidecar) -> None:
    async with gemini_client(demo) as client:
        stream = await client.aio.models.generate_content_stream(model="gemini-demo", contents="hi")
        text = "".join([chunk.text or "" async for chunk in stream])
    assert text == "Three steps: freeze, test, tag."
    assert streamed_record(demo)["tokens_used"] == 18


async def test_gemini_generate_content_and_the_json_array_stream(demo: Sidecar) -> None:
    async with gemini_client(demo) as client:
        answer = await client.aio.models.generate_content(model="gemini-demo", contents="hi")
    assert answer.text == "Three steps: freeze, test, tag."
    # Without alt=sse Gemini streams one JSON array, written piece by piece.
    async with demo.session.post(
        f"{demo.url}/proxy/gemini/v1beta/models/gemini-demo:streamGenerateContent",
        json={"contents": [{"parts": [{"text": "hi"}]}]},
    ) as resp:
        assert resp.status == 200, await resp.text()
        chunks = json.loads(await resp.read())
    assert [c["candidates"][0]["content"]["parts"][0]["text"] for c in chunks] == [
        "Three ",
        "steps: freeze, ",
        "test, tag.",
    ]
    assert chunks[-1]["usageMetadata"]["totalTokenCount"] == 18
    records = demo.audit_records()
    assert [r["tokens_used"] for r in records] == [18, 18]
