"""The agent's own credentials never reach the upstream on the drop-in route, whatever
they are called: a query item named as a credential (``api_key``, ``token``,
``access_token``, ``Key``... in any case) is dropped, and the target's credential is
injected instead. Real sidecar, loopback upstream recording what it got.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import openai_stack

KEY = "sk-fake-TEST-0001-NOTREAL"


AGENT = "sk-agent-placeholder-NOT-A-KEY"


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    "name", ["api_key", "apikey", "API-Key", "token", "access_token", "Key", "x-api-key"]
)
async def test_a_credential_in_the_query_is_never_forwarded(
    upstream_factory, sidecar_factory, name: str
):
    up, sc = await openai_stack(upstream_factory, sidecar_factory)
    url = f"{sc.url}/proxy/openai/v1/chat/completions"
    async with sc.session.post(url, json=CHAT, params={name: AGENT, "v": "1"}) as resp:
        assert resp.status == 200
    [seen] = up.seen
    assert AGENT not in json.dumps(seen.query) + json.dumps(seen.headers)
    assert seen.query == {"v": "1"}
    assert seen.headers["Authorization"] == f"Bearer {KEY}"
