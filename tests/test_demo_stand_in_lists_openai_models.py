"""The demo's OpenAI stand-in answers the model endpoints (``GET /v1/models`` and
``GET /v1/models/{model}``) as OpenAI documents them
(https://platform.openai.com/docs/api-reference/models), so the OpenAI SDK's
``models.list()`` and ``models.retrieve()`` work against it; ``policies/demo.yaml``
allows the second (the first stays off its allowlist: examples/sdk_openai.py shows its
refusal)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest
from aiohttp.test_utils import TestServer

from gateway.demo.standins import DEMO_SECRETS, stand_in_app
from gateway.policy import load_policy


@pytest.fixture
async def stand_ins() -> AsyncIterator[str]:
    server = TestServer(stand_in_app(), host="127.0.0.1")
    await server.start_server()
    yield f"http://127.0.0.1:{server.port}/openai/v1"
    await server.close()


async def test_the_sdk_lists_and_retrieves_the_stand_ins_models(stand_ins: str) -> None:
    client = openai.AsyncOpenAI(base_url=stand_ins, api_key=DEMO_SECRETS["DEMO_OPENAI_KEY"])
    listed = [model.id async for model in client.models.list()]
    assert listed == ["gpt-4o-mini", "gpt-4o"]
    model = await client.models.retrieve("gpt-4o")
    assert (model.id, model.object, model.owned_by) == ("gpt-4o", "model", "openai")
    with pytest.raises(openai.NotFoundError) as missing:
        await client.models.retrieve("gpt-0")
    assert missing.value.code == "model_not_found"
    await client.close()


async def test_the_model_endpoints_check_the_injected_key(stand_ins: str) -> None:
    client = openai.AsyncOpenAI(base_url=stand_ins, api_key="sk-not-the-demo-key")
    with pytest.raises(openai.AuthenticationError):
        await client.models.retrieve("gpt-4o")
    await client.close()


def test_the_demo_policy_allows_retrieving_a_model_not_listing_them() -> None:
    target = load_policy("policies/demo.yaml").targets["openai"]
    assert target.allows("/v1/models/gpt-4o", "GET") is True
    assert target.allows("/v1/models", "GET") is None
