"""Failures after the upstream answered.

An upstream body Python can parse but the answer's JSON writer cannot write back (nested
past pydantic-core's 255 levels, NaN/Infinity, numbers past a double) used to give
aiohttp's plain-text 500 after the upstream had acted, with the idempotency key left in
flight. Now: an envelope whose ``data`` is the body as text (unchanged, nothing lost), an
audit record that says what the agent got, and the key completed with that answer, so a
resend is a replay and the side effect happens once.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from aiohttp import web

from tests.conftest import RULED_OUT_S, SOON_S, compile_policy, envelope, openai_target

_DEEP = "[" * 300 + "]" * 300
_BODIES = {
    "deep-300": _DEEP,
    "deep-5000": "[" * 5000 + "]" * 5000,  # past Python's own recursion limit too
    "nan": '{"id": "ch_1", "amount": NaN}',
    "infinity": '{"id": "ch_1", "amount": -Infinity}',
    "overflow": '{"id": "ch_1", "amount": 1e999}',
    "deep-inside": '{"id": "ch_1", "nested": ' + _DEEP + "}",
}


def _serving(body: str):
    async def handler(_: web.Request) -> web.StreamResponse:
        return web.Response(body=body.encode(), content_type="application/json")

    return handler


async def _sidecar(upstream_factory: Any, sidecar_factory: Any, body: str, **target: Any):
    up = await upstream_factory(_serving(body))
    spec = openai_target(up.url, **target)
    return up, await sidecar_factory(compile_policy({"fake-openai": spec}))


@pytest.mark.parametrize("name", sorted(_BODIES))
async def test_an_unwritable_body_is_answered_as_its_text_and_replayed_by_its_key(
    name: str, upstream_factory: Any, sidecar_factory: Any
) -> None:
    body = _BODIES[name]
    up, sc = await _sidecar(
        upstream_factory, sidecar_factory, body, idempotency={"methods": ["POST"]}
    )
    env = envelope(idempotency_key=f"charge-{name}", timeout=RULED_OUT_S)  # the key's lease
    status, answer = await sc.call(env)
    assert status == 200, answer
    assert answer["success"] is True
    assert answer["status_code"] == 200
    assert answer["data"] == {"content_type": "application/json", "text": body}
    [record] = sc.audit_records()
    assert record["success"] is True
    assert record["error_code"] is None
    started = time.monotonic()
    status, again = await sc.call(env)
    assert status == 200
    assert again["replayed"] is True
    assert again["data"] == answer["data"]
    assert time.monotonic() - started < SOON_S  # a replay, not a wait for a lease to run out
    assert up.hits == 1


@pytest.mark.parametrize("name", ["deep-300", "nan"])
async def test_without_idempotency_the_answer_is_still_an_envelope(
    name: str, upstream_factory: Any, sidecar_factory: Any
) -> None:
    up, sc = await _sidecar(upstream_factory, sidecar_factory, _BODIES[name])
    status, answer = await sc.call(envelope())
    assert status == 200
    assert answer["success"] is True
    assert answer["data"]["text"] == _BODIES[name]
    assert up.hits == 1
    assert [r["success"] for r in sc.audit_records()] == [True]


async def test_json_nested_within_the_limit_stays_parsed(upstream_factory, sidecar_factory):
    from gateway.call.bodies import MAX_DATA_DEPTH

    body = "[" * MAX_DATA_DEPTH + "]" * MAX_DATA_DEPTH
    _, sc = await _sidecar(upstream_factory, sidecar_factory, body)
    status, answer = await sc.call(envelope())
    assert status == 200
    assert answer["data"] == json.loads(body)


async def test_a_deep_stream_event_is_kept_as_its_text(upstream_factory, sidecar_factory):
    deep = "[" * 300 + "]" * 300

    async def handler(_: web.Request) -> web.StreamResponse:
        chunks = [{"choices": [{"delta": {"content": "hi"}}]}]
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks)
        text += f"data: {deep}\n\ndata: [DONE]\n\n"
        return web.Response(body=text.encode(), content_type="text/event-stream")

    up = await upstream_factory(handler)
    sc = await sidecar_factory(compile_policy({"fake-openai": openai_target(up.url)}))
    status, answer = await sc.call(envelope())
    assert status == 200, answer
    assert answer["data"]["content"] == "hi"
    assert answer["data"]["events"][-1] == deep
