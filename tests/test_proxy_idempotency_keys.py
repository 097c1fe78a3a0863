"""An SDK's ``Idempotency-Key`` on the drop-in route: it reaches an upstream the sidecar
does not dedupe for (a target without ``idempotency``), unchanged across the SDK's own
retries, and a target's own ``idempotency`` keeps the key in its configured header.
"""

from __future__ import annotations

import openai
from aiohttp import web

from tests.conftest import openai_stack

AGENT = "sk-agent-placeholder-NOT-A-KEY"


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def test_an_idempotency_key_goes_upstream_when_the_target_keeps_none(
    upstream_factory, sidecar_factory
):
    async def busy_once(request: web.Request) -> web.StreamResponse:
        if up.hits == 1:  # the first attempt fails; the SDK sends it again
            busy = {"error": {"message": "busy"}}
            return web.json_response(busy, status=503, headers={"retry-after-ms": "1"})
        return web.json_response({"id": "ch_1", "object": "charge"})

    up, sc = await openai_stack(
        upstream_factory, sidecar_factory, busy_once, retry={"max_retries": 0}
    )
    async with openai.AsyncOpenAI(
        base_url=f"{sc.url}/proxy/openai/v1", api_key=AGENT, max_retries=1
    ) as client:
        answer = await client.post(
            "/chat/completions",
            body=CHAT,
            cast_to=object,
            options={"headers": {"Idempotency-Key": "idem-charge-1"}},
        )
    assert answer == {"id": "ch_1", "object": "charge"}
    # Stripe-like upstreams dedupe on the key the SDK sent: it must arrive, the same twice.
    keys = [{k.lower(): v for k, v in s.headers.items()}.get("idempotency-key") for s in up.seen]
    assert keys == ["idem-charge-1"] * 2


async def test_a_targets_own_idempotency_keeps_the_key_in_its_header(
    upstream_factory, sidecar_factory
):
    up, sc = await openai_stack(
        upstream_factory, sidecar_factory, idempotency={"header": "X-Request-Key"}
    )
    url = f"{sc.url}/proxy/openai/v1/chat/completions"
    for _ in range(2):
        async with sc.session.post(url, json=CHAT, headers={"Idempotency-Key": "k-7"}) as resp:
            assert resp.status == 200
    [seen] = up.seen  # the second was a replay
    assert seen.headers["X-Request-Key"] == "k-7"
    assert "idempotency-key" not in {k.lower() for k in seen.headers}
