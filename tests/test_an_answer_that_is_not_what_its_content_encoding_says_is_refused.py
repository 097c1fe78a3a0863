"""An upstream answer whose body is not what its ``Content-Encoding`` says (labelled
gzip or deflate, sent plain; a gzip stream that turns to garbage) is refused as one
whose coding the sidecar cannot undo: DEPENDENCY_FAILED, ``details.reason``
``content_encoding``, not retried (the upstream would label it the same way), on every
route, streamed or not. It is not a connection that broke: no OUTCOME_UNKNOWN, no
STREAM_INTERRUPTED saying the upstream "closed the stream mid-way", no retry of a keyed
call, and one audit record.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import pytest
from aiohttp import web

from tests.conftest import compile_policy, envelope, openai_target
from tests.test_stream_relay import _final
from tests.test_streams import CHAT_USAGE, chat, sse

CHAT = {"choices": [{"message": {"content": "pong"}}]}
STREAM = sse(chat("Hel"), chat("lo", "stop"), CHAT_USAGE, "[DONE]")


def _turning_bad() -> bytes:
    """Valid gzip for the first events (flushed whole), then a block that is not deflate
    data (its type is the reserved one)."""
    coder = zlib.compressobj(wbits=16 + zlib.MAX_WBITS)
    return coder.compress(sse(chat("Hel"))) + coder.flush(zlib.Z_SYNC_FLUSH) + b"\xff" * 64


#: name -> (Content-Encoding, body, is an event stream)
LABELLED = {
    "json-gzip-plain": ("gzip", json.dumps(CHAT).encode(), False),
    "json-deflate-plain": ("deflate", json.dumps(CHAT).encode(), False),
    "stream-gzip-plain": ("gzip", STREAM, True),
    "stream-gzip-turns-bad": ("gzip", _turning_bad(), True),
}


def _mislabelled(coding: str, body: bytes, stream: bool) -> Any:
    async def handler(_: web.Request) -> web.StreamResponse:
        ctype = "text/event-stream" if stream else "application/json"
        return web.Response(body=body, headers={"Content-Type": ctype, "Content-Encoding": coding})

    return handler


@pytest.mark.parametrize("way", ["envelope", "relayed", "drop-in"])
@pytest.mark.parametrize("case", list(LABELLED))
async def test_a_body_that_is_not_what_its_coding_says_is_refused_once(
    upstream_factory: Any, sidecar_factory: Any, case: str, way: str
) -> None:
    coding, body, stream = LABELLED[case]
    up = await upstream_factory(_mislabelled(coding, body, stream))
    keyed = openai_target(up.url, idempotency={"methods": ["POST"]})  # retries allowed
    sc = await sidecar_factory(compile_policy({"fake-openai": keyed}))
    params = {"model": "m", "messages": [], "stream": stream}
    env = envelope(parameters=params, max_retries=2)
    if way == "envelope":
        status, answer = await sc.call(env)
        assert status == 502, answer
        error = answer["error"]
    elif way == "relayed":
        headers = {"Accept": "text/event-stream"}
        async with sc.session.post(sc.url + "/v1/calls", json=env, headers=headers) as resp:
            if resp.content_type == "application/json":
                error = (await resp.json())["error"]
            else:
                error = _final(await resp.read())["error"]
    else:
        url = f"{sc.url}/proxy/fake-openai/v1/chat/completions"
        async with sc.session.post(url, json=params) as resp:
            raw = await resp.read()
        code = resp.headers.get("x-egress-error-code")
        if code is None:  # the stream had begun: its last event is the provider's error
            code = json.loads(raw.rstrip().rpartition(b"data: ")[2])["error"]["code"]
        error = {"code": code, "retryable": False, "details": {"reason": "content_encoding"}}
        assert b"mid-way" not in raw
    assert error["code"] == "DEPENDENCY_FAILED", error
    assert error["retryable"] is False
    assert error["details"]["reason"] == "content_encoding"
    assert up.hits == 1  # not resent: the same label would come back
    [record] = sc.audit_records()
    assert record["error_code"] == "DEPENDENCY_FAILED"
