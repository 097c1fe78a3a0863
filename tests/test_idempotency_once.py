"""Idempotency's per-call work: the answer stored for a key is the answer the
agent gets, written as JSON once; a replay, a call without a key, a streamed answer and
a secret in the answer are each still answered as before."""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp
from aiohttp import web

from gateway.call import idempotent
from gateway.envelope import ExternalCallResponse
from gateway.idempotency import Replay, derive_key, fingerprint, store_key
from tests.conftest import Sidecar, compile_policy, envelope, openai_target

KEY = "sk-fake-TEST-0001-NOTREAL"  # conftest's TEST_OPENAI_KEY


async def _raw_call(sc: Sidecar, env: dict[str, Any]) -> tuple[int, bytes]:
    async with sc.session.post(sc.url + "/v1/calls", json=env) as resp:
        assert resp.content_type == "application/json"
        return resp.status, await resp.read()


async def _stored(sc: Sidecar, env: dict[str, Any]) -> bytes:
    """What the local store keeps for ``env`` (a completed key answers begin with it)."""
    store = sc.gateway.pipeline.idempotency.local  # type: ignore[union-attr]
    key = store_key(
        env["target_system"],
        derive_key(
            env["trace_id"],
            env["correlation_id"],
            env["target_system"],
            env["method"],
            env["endpoint"],
        ),
    )
    fp = fingerprint(env["target_system"], env["method"], env["endpoint"], env["parameters"])
    outcome = await store.begin(key, fp, lease_s=5)
    assert isinstance(outcome, Replay), outcome
    return outcome.answer


async def test_the_wire_carries_the_bytes_stored_for_the_key(
    upstream_factory: Any, sidecar_factory: Any
) -> None:
    answer = {"id": "c-1", "text": 'é \u2028 "quoted"', "n": 1e-07, "usage": {"total_tokens": 3}}

    async def handler(_: web.Request) -> web.StreamResponse:
        return web.json_response(answer)

    up = await upstream_factory(handler)
    target = openai_target(up.url, idempotency={"methods": ["POST"]})
    sc = await sidecar_factory(compile_policy({"fake-openai": target}))
    env = envelope()
    status, wire = await _raw_call(sc, env)
    assert status == 200
    assert json.loads(wire)["data"] == answer
    assert json.loads(wire)["replayed"] is False
    # One serialisation: the envelope the agent got is the stored one, byte for byte.
    assert await _stored(sc, env) == b'{"status":200,"response":' + wire + b"}"
    assert sc.gateway.pipeline is not None
    assert sc.gateway.pipeline.rendered.empty  # taken by the answer it was written for

    # The replay (rebuilt from the store, written by the server) is the same answer.
    status, again = await _raw_call(sc, env)
    assert status == 200
    replayed = json.loads(again)
    assert replayed["replayed"] is True
    assert replayed["data"] == answer
    assert up.hits == 1


async def test_a_secret_in_the_answer_is_scrubbed_on_both_paths(
    upstream_factory: Any, sidecar_factory: Any
) -> None:
    async def echo_key(request: web.Request) -> web.StreamResponse:
        return web.json_response({"echo": request.headers["Authorization"]})

    up = await upstream_factory(echo_key)
    policy = compile_policy(
        {
            "fake-openai": openai_target(up.url, idempotency={"methods": ["POST"]}),
            "plain": openai_target(up.url),  # no idempotency: the server writes the answer
        }
    )
    sc = await sidecar_factory(policy)
    for env in (envelope(), envelope(target_system="plain"), envelope()):  # last: a replay
        status, wire = await _raw_call(sc, env)
        assert status == 200, wire
        assert KEY.encode() not in wire
        assert json.loads(wire)["data"]["echo"].startswith("Bearer ")
    assert up.hits == 2


def _answer(**overrides: Any) -> ExternalCallResponse:
    fields: dict[str, Any] = {
        "success": True,
        "status_code": 200,
        "data": {"a": 1},
        "latency_ms": 1.0,
        "trace_id": "t",
        "correlation_id": "c",
    }
    fields.update(overrides)
    return ExternalCallResponse(**fields)


def test_rendered_bytes_are_given_once_and_only_for_their_answer() -> None:
    stored, twin = _answer(), _answer()
    assert stored == twin  # equal, but not the answer the bytes were written for
    rendered = idempotent.Rendered()
    assert rendered.take(stored) is None
    rendered.last = (idempotent.weakref.ref(stored), stored.model_dump_json().encode())
    assert rendered.take(twin) is None
    assert rendered.take(stored) == stored.model_dump_json().encode()
    assert rendered.take(stored) is None  # taken


async def test_the_stream_case_stores_its_events_beside_the_same_envelope(
    upstream_factory: Any, sidecar_factory: Any
) -> None:
    events = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\ndata: [DONE]\n\n'

    async def stream(_: web.Request) -> web.StreamResponse:
        return web.Response(body=events, content_type="text/event-stream")

    up = await upstream_factory(stream)
    target = openai_target(up.url, idempotency={"methods": ["POST"]})
    sc = await sidecar_factory(compile_policy({"fake-openai": target}))
    env = envelope()
    status, wire = await _raw_call(sc, env)  # no Accept: the stream assembled as data
    assert status == 200, wire
    stored = json.loads(await _stored(sc, env))
    assert stored["response"] == json.loads(wire)
    assert stored["stream"]
    async with (
        aiohttp.ClientSession() as agent,
        agent.post(sc.url + "/v1/calls", json=env, headers={"Accept": "text/event-stream"}) as resp,
    ):
        assert resp.content_type == "text/event-stream"
        assert (await resp.read()).startswith(events)
    assert up.hits == 1


async def test_an_answer_json_cannot_hold_is_stored_and_sent_with_its_note() -> None:
    """The fallback of the one serialisation: data the JSON writer refuses (a lone
    surrogate) is replaced by a note, stored, and the server's bytes are the note's."""
    from gateway.call.record import CallContext
    from gateway.envelope import ExternalCallRequest
    from gateway.idempotency import MemoryIdempotencyStore

    store = MemoryIdempotencyStore()
    request = ExternalCallRequest.model_validate(envelope(parameters={"p": 1}))
    ctx = CallContext(started=time.monotonic(), agent_id="a", request=request)
    ctx.idempotency_key = "k-note"
    rendered = idempotent.Rendered()
    learned = idempotent.Learned()
    sent = 0

    async def forward() -> ExternalCallResponse:
        nonlocal sent
        sent += 1
        return _answer(data={"text": "\ud800"})

    def failure(exc: Exception) -> ExternalCallResponse:
        raise AssertionError(exc)

    async def once() -> tuple[int, ExternalCallResponse]:
        return await idempotent.once_per_key(
            store,
            request,
            "fake-openai",
            ctx,
            deadline=time.monotonic() + 5,
            ttl_s=60,
            forward=forward,
            failure=failure,
            rendered=rendered,
            learned=learned,
        )

    status, response = await once()
    assert status == 200
    assert response.data == {"content_type": None, "text": learned.warnings[0]}
    assert "could not be written as JSON" in learned.warnings[0]
    wire = rendered.take(response)
    assert wire == response.model_dump_json().encode()
    status, replayed = await once()  # the resend: the note, from the store
    assert (status, replayed.replayed, replayed.data, sent) == (200, True, response.data, 1)
    assert rendered.take(replayed) is None  # a replay is written by the server
