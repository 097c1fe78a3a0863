"""A replayed answer is the answer the first call got, and each call gets its own.

A target with ``idempotency``: a resend with the same key is answered from the store,
never with the sidecar's own version of what the upstream said (a 101 that would switch
the agent's connection, a bare redirect); under concurrency, with the store's awaits in
between (Redis), every call gets its own answer's bytes and every resend its own replay.
"""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from tests.conftest import compile_policy, envelope, openai_target
from tests.redis_fixtures import SHARED_URL

CHAT = {"model": "fake-model-1", "messages": [{"role": "user", "content": "ping"}]}


async def test_a_replayed_101_is_not_sent_to_the_agent_as_101(switcher, sidecar_factory):
    """An upstream 101 on a target with idempotency: the first answer is the 502 refusal
    and its key is completed; the resend with the same key must get that 502 again, not a
    ``101 Switching Protocols`` of the sidecar's own (which would switch the agent's
    connection)."""
    target = openai_target(f"http://127.0.0.1:{switcher.port}", idempotency={"methods": ["POST"]})
    sc = await sidecar_factory(compile_policy({"fake-openai": target}))
    headers = {"x-egress-timeout": "5", "Idempotency-Key": "key-101"}
    url = sc.url + "/proxy/fake-openai/v1/chat/completions"
    answers = []
    for _ in range(2):
        async with sc.session.post(url, json=CHAT, headers=headers) as resp:
            answers.append(
                (resp.status, resp.headers.get("x-egress-error-code"), await resp.read())
            )
    assert switcher.requests == 1  # the key held: the upstream saw one request
    first, second = answers
    assert first[0] == 502
    assert first[1] == "UPSTREAM_REJECTED"
    assert second[0] == 502, second
    assert second[1] == "UPSTREAM_REJECTED"
    assert len(sc.audit_records()) == 2


async def test_a_replayed_redirect_is_the_refusal_the_first_answer_was(
    upstream_factory, sidecar_factory
):
    """An upstream redirect (not followed) is refused with the provider's 502 error body
    on the drop-in route; its replay must be that same refusal, not a bare 300 of the
    sidecar's own with an empty body (nor a redirect the SDK might follow)."""

    async def redirect(_: object) -> web.StreamResponse:
        return web.Response(status=300, text="choose")  # no Location: not followed

    up = await upstream_factory(redirect)
    target = openai_target(up.url, idempotency={"methods": ["POST"]})
    sc = await sidecar_factory(compile_policy({"fake-openai": target}))
    headers = {"Idempotency-Key": "key-300"}
    url = sc.url + "/proxy/fake-openai/v1/chat/completions"
    answers = []
    for _ in range(2):
        async with sc.session.post(url, json=CHAT, headers=headers, allow_redirects=False) as resp:
            body = await resp.json(content_type=None) if resp.status == 502 else None
            answers.append((resp.status, resp.headers.get("x-egress-error-code"), body))
    assert up.hits == 1
    first, second = answers
    assert first[0] == 502
    assert first[1] == "UPSTREAM_REJECTED"
    assert second == first  # the same status, code and provider-shaped error body


@pytest.mark.parametrize("scope", ["local", "cluster"])
async def test_concurrent_idempotent_answers_are_each_their_own(
    upstream_factory, sidecar_factory, redis_prefix, scope
):
    """The answer serialised once for the store and the wire (call/idempotent.py
    ``Rendered``, one slot on the pipeline): under concurrency, and with the store's
    awaits between the slot's writing and the answer (Redis, ``scope: cluster``), every
    call gets its own answer's bytes, and every resend its own replay."""

    async def echo(request: web.Request) -> web.StreamResponse:
        sent = await request.json()
        return web.json_response({"echo": sent["n"], "text": "x" * (sent["n"] * 97 % 5000)})

    up = await upstream_factory(echo)
    target = openai_target(up.url, idempotency={"methods": ["POST"], "scope": scope})
    # Generous Redis timeouts: sixty calls at once on a loaded box must not be judged by
    # the box's speed (this test is about each call's own answer, not the store's bound).
    redis = {"url": SHARED_URL, "key_prefix": redis_prefix}
    redis |= {"socket_timeout_s": 30, "connect_timeout_s": 30}
    extra = {"redis": redis} if scope == "cluster" else {}
    sc = await sidecar_factory(compile_policy({"fake-openai": target}, **extra))

    def env(n: int) -> dict[str, object]:
        return envelope(correlation_id=f"corr-{n}", parameters={"model": "m", "n": n})

    for _round in range(2):  # the first: all go upstream; the second: all replayed
        answers = await asyncio.gather(*(sc.call(env(n)) for n in range(60)))
        for n, (status, answer) in enumerate(answers):
            assert status == 200, answer.get("error")
            assert answer["correlation_id"] == f"corr-{n}"
            assert answer["data"]["echo"] == n
            assert len(answer["data"]["text"]) == n * 97 % 5000
            assert answer["replayed"] is (_round == 1)
    assert up.hits == 60
