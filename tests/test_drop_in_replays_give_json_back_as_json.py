"""A keyed drop-in call whose upstream answered JSON is replayed as that JSON, whatever
its value: a ``null``, or an object shaped like the forms the sidecar gives a body that
is not JSON (``{content_type, text}``, ``{content_type, base64, bytes}``), which a replay
used to write back as that text or those bytes (or refuse, for ``null``). A body that
was not JSON is still replayed as it came."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp import web

from tests.conftest import compile_policy, openai_target

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (b'{"content_type":"text/html","text":"<b>hi</b>"}', "application/json"),
        (b'{"content_type":"image/png","base64":"aGk=","bytes":2}', "application/json"),
        (b"null", "application/json"),
        (b'{"id":"chatcmpl-1","choices":[]}', "application/json"),
        (b"<b>hi</b>", "text/html"),  # not JSON: replayed as the text it was
    ],
)
async def test_a_replay_gives_the_first_answers_body_back(
    upstream_factory: Any, sidecar_factory: Any, body: bytes, content_type: str
) -> None:
    async def handler(_: web.Request) -> web.StreamResponse:
        return web.Response(body=body, content_type=content_type)

    up = await upstream_factory(handler)
    target = openai_target(up.url, idempotency={"methods": ["POST"]})
    sc = await sidecar_factory(compile_policy({"fake-openai": target}))
    url = sc.url + "/proxy/fake-openai/v1/chat/completions"
    answers = []
    for _ in range(2):
        async with sc.session.post(url, json=CHAT, headers={"Idempotency-Key": "k-1"}) as resp:
            answers.append(
                (
                    resp.status,
                    resp.headers.get("x-egress-replayed"),
                    resp.content_type,
                    await resp.read(),
                )
            )
    assert up.hits == 1
    (status, replayed, first_type, first), (again, replayed_again, second_type, second) = answers
    assert (status, replayed, first_type, first) == (200, None, content_type, body)
    assert (again, replayed_again, second_type) == (200, "true", content_type)
    if content_type == "application/json":
        assert json.loads(second) == json.loads(body)  # the same value, written compactly
    else:
        assert second == body
