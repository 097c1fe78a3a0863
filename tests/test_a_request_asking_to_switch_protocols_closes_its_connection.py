"""A request that asks to switch protocols (``Upgrade: h2c``, as ``curl --http2`` sends on
an http:// URL; any ``Upgrade``) is answered as usual, over HTTP/1.1 (the sidecar
switches to nothing, RFC 9110 section 7.8), and its connection is then closed.

aiohttp's parser stops reading HTTP after such a request: a request pipelined behind it
was neither forwarded nor answered, and its agent waited out the keep-alive timeout
(75 s) for a close. Now the close comes with the answer, so the agent knows at once
that the requests behind it were not answered (none was forwarded: resending is safe).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.conftest import RULED_OUT_S, SOON_S, compile_policy, envelope, openai_target
from tests.rawhttp import exchange, listening, request


@pytest.mark.parametrize("upgrade", ["h2c", "websocket", "tls/1.3"])
@pytest.mark.parametrize("route", ["envelope", "drop-in"])
async def test_the_answer_comes_then_the_close_and_nothing_behind_it_is_forwarded(
    upstream: Any, route: str, upgrade: str
) -> None:
    policy = compile_policy({"fake-openai": openai_target(upstream.url)})
    if route == "envelope":
        path, body = "/v1/calls", json.dumps(envelope(target_system="fake-openai"))
    else:
        path, body = "/proxy/fake-openai/v1/chat/completions", json.dumps(envelope()["parameters"])
    asking = (("Connection", "Upgrade, HTTP2-Settings"), ("Upgrade", upgrade))
    typed = ("Content-Type", "application/json")
    first = request(body.encode(), typed, *asking, path=path)
    behind = request(body.encode(), typed, path=path)
    async with listening(policy, keepalive_timeout_s=RULED_OUT_S) as sidecar:
        got = await exchange(sidecar.port, first + behind, answers=2, timeout_s=SOON_S)
        assert [answer.status for answer in got.answers] == [200]
        assert got.closed  # at once, not after the keep-alive timeout
        assert upstream.hits == 1
        assert len(sidecar.log.records()) == 1
