"""The sidecar's one writer of an ExternalCallResponse's JSON (``fastjson.answer_json``,
orjson with pydantic as the fallback) writes what pydantic's ``model_dump_json`` writes,
equal as JSON, for any answer. Through a sidecar, a drop-in resend with the same
``Idempotency-Key`` replays the first answer's value, as compact JSON, as it always did,
and the store keeps it compact whatever the upstream's spacing and escapes.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway import fastjson
from gateway.envelope import ErrorCode, ErrorPayload, ExternalCallResponse, ModelNames, ServedBy
from tests.conftest import compile_policy, openai_target

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)  # past 64 bits: orjson refuses
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text()
)
_keys = st.text() | st.integers(min_value=-5, max_value=5)  # int keys: orjson refuses
_data = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_keys, inner, max_size=4),
    max_leaves=12,
)
_errors = st.builds(
    ErrorPayload,
    code=st.sampled_from(ErrorCode),
    message=st.text(),
    details=st.dictionaries(st.text(), _data, max_size=3),
    retryable=st.booleans(),
    suggested_retry_after=st.none() | st.floats(allow_nan=True, allow_infinity=True),
    failed_agent=st.none() | st.text(),
)
_responses = st.builds(
    ExternalCallResponse,
    success=st.booleans(),
    status_code=st.none() | st.integers(min_value=100, max_value=599),
    data=_data,
    error=st.none() | _errors,
    latency_ms=st.floats(min_value=0, max_value=1e9),
    tokens_used=st.none() | st.integers(min_value=0, max_value=2**40),
    trace_id=st.none() | st.text(),
    correlation_id=st.none() | st.text(),
    replayed=st.booleans(),
    served_by=st.none() | st.builds(ServedBy, target=st.text(), model=st.none() | st.text()),
    model=st.none() | st.builds(ModelNames, requested=st.text(), sent=st.text()),
)


def _pydantic(response: ExternalCallResponse) -> Any:
    """pydantic's JSON of ``response``, read back; a ``ValueError`` (a lone surrogate)."""
    return json.loads(response.model_dump_json())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_responses)
def test_the_writer_writes_what_pydantic_writes(response: ExternalCallResponse) -> None:
    try:
        expected = _pydantic(response)
    except ValueError:  # text with a lone surrogate: no UTF-8, refused by both
        with pytest.raises(ValueError, match="surrogates not allowed"):
            fastjson.answer_json(response)
        return
    assert json.loads(fastjson.answer_json(response)) == expected


def test_nan_and_infinities_are_null_as_pydantic_writes_them() -> None:
    answer = ExternalCallResponse(
        success=True, data=[math.nan, math.inf, -math.inf, 2**64 - 1], latency_ms=math.nan
    )
    written = json.loads(fastjson.answer_json(answer))
    assert written == _pydantic(answer)
    assert written["data"] == [None, None, None, 2**64 - 1]
    assert written["latency_ms"] is None


def test_a_key_pydantic_does_not_write_is_not_written() -> None:
    """A ``model_copy`` update naming a key that is no field of the model."""
    answer = ExternalCallResponse(success=True, latency_ms=1.0, data={"a": 1})
    odd = answer.model_copy(update={"not_a_field": 1})
    assert "not_a_field" not in json.loads(fastjson.answer_json(odd))
    assert json.loads(fastjson.answer_json(odd)) == _pydantic(odd)


UPSTREAM = (
    b'{ "id": "chatcmpl-1",\n  "object": "chat.completion",\n'
    b'  "choices": [ {"index": 0, "message": {"role": "assistant",'
    b' "content": "caf\\u00e9 \xe2\x98\x83 \\ud83d\\ude00 \\"q\\" \\/"}} ],\n'
    b'  "n": 1E-7, "big": 9007199254740993, "usage": {"total_tokens": 3} }\n'
)


async def test_a_drop_in_replay_is_the_first_answers_value(
    upstream_factory: Any, sidecar_factory: Any
) -> None:
    async def handler(_: web.Request) -> web.StreamResponse:
        return web.Response(body=UPSTREAM, content_type="application/json")

    up = await upstream_factory(handler)
    target = openai_target(up.url, idempotency={"methods": ["POST"]})
    sc = await sidecar_factory(compile_policy({"fake-openai": target}))
    url = sc.url + "/proxy/fake-openai/v1/chat/completions"
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    answers = []
    for _ in range(2):
        async with sc.session.post(url, json=chat, headers={"Idempotency-Key": "k-1"}) as resp:
            answers.append((resp.status, resp.headers.get("x-egress-replayed"), await resp.read()))
    assert up.hits == 1
    (status, replayed, first), (again, replayed_again, second) = answers
    assert (status, replayed, first) == (200, None, UPSTREAM)  # the upstream's own bytes
    # The replay: the stored value, written compactly, as before (answers.replayed_body).
    assert (again, replayed_again) == (200, "true")
    assert second == fastjson.compact(json.loads(UPSTREAM))
    # What the store keeps: the value written compactly, not the upstream's spaced and
    # escaped bytes (which may be several times longer: an answer past the store's bound
    # would go unstored, and a resend would reach the upstream again).
    store = sc.gateway.pipeline.idempotency.local
    [entry] = store._entries.values()
    assert UPSTREAM not in entry.answer
    assert fastjson.compact(json.loads(UPSTREAM)) in entry.answer
    assert json.loads(entry.answer)["response"]["data"] == json.loads(UPSTREAM)
