"""A stream whose connection breaks after the provider's terminal marker arrived (no last
chunk, a reset), or whose upstream then falls silent without ending it, is complete:
success is decided by the stream, not by the HTTP framing, whether the stream is relayed
(the envelope route with ``Accept: text/event-stream``, the drop-in route) or assembled.
The agent already has the whole answer; telling it STREAM_INTERRUPTED (retryable) would
have it pay for the answer twice. A break or silence before the marker stays
STREAM_INTERRUPTED on every path.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from aiohttp import web

from tests.conftest import RULED_OUT_S, SOON_S, compile_policy, envelope, openai_target
from tests.test_stream_relay import STREAM_ENV, _final
from tests.test_streams import A_DELTA, A_MSG_DELTA, A_START, A_STOP, CHAT_USAGE, chat, sse


def _anthropic(*events: dict[str, Any]) -> bytes:
    return sse(*((e["type"], e) for e in events))


# dialect: (the whole stream, the stream without its marker, the endpoint)
BODIES = {
    "openai": (
        sse(chat("Hel"), chat("lo", "stop"), CHAT_USAGE, "[DONE]"),
        sse(chat("Hel"), chat("lo"), CHAT_USAGE),
        "/v1/chat/completions",
    ),
    "anthropic": (
        _anthropic(A_START, A_DELTA, A_MSG_DELTA, A_STOP),
        _anthropic(A_START, A_DELTA, A_MSG_DELTA),
        "/v1/messages",
    ),
}


def _breaking(body: bytes) -> Any:
    """Streams ``body`` in one chunk, then aborts the connection: no last chunk."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        await resp.write(body)
        assert request.transport is not None
        request.transport.abort()
        return resp

    return handler


async def _stack(upstream_factory: Any, sidecar_factory: Any, dialect: str, marker: bool) -> Any:
    whole, cut, path = BODIES[dialect]
    body = whole if marker else cut
    up = await upstream_factory(_breaking(body))
    target = openai_target(up.url, usage=dialect, endpoints=[{"path": path, "methods": ["POST"]}])
    return up, await sidecar_factory(compile_policy({"fake-openai": target})), body, path


async def _stalling_sidecar(
    upstream_factory: Any, sidecar_factory: Any, dialect: str, marker: bool, never: Any
) -> tuple[Any, Any]:
    """A sidecar whose target (an idle bound of 0.2 s) streams ``dialect``'s body, whole
    (``marker``) or cut before its marker, then falls silent until ``never`` is set; and
    that upstream."""
    whole, cut, path = BODIES[dialect]
    up = await upstream_factory(_stalling(whole if marker else cut, never))
    target = openai_target(
        up.url,
        usage=dialect,
        endpoints=[{"path": path, "methods": ["POST"]}],
        stream_idle_timeout_s=0.2,
    )
    return up, await sidecar_factory(compile_policy({"fake-openai": target}))


@pytest.mark.parametrize("marker", [True, False], ids=["after-marker", "before-marker"])
@pytest.mark.parametrize("dialect", list(BODIES))
@pytest.mark.parametrize("way", ["relayed", "drop-in", "assembled"])
async def test_a_break_after_the_terminal_marker_is_a_complete_stream(
    upstream_factory: Any, sidecar_factory: Any, way: str, dialect: str, marker: bool
) -> None:
    up, sc, body, path = await _stack(upstream_factory, sidecar_factory, dialect, marker)
    env = envelope(endpoint=path, max_retries=0, parameters=STREAM_ENV["parameters"])
    if way == "assembled":
        status, answer = await sc.call(env)
        assert (status == 200) is marker, answer
        code = None if answer["success"] else answer["error"]["code"]
    elif way == "relayed":
        headers = {"Accept": "text/event-stream"}
        async with sc.session.post(sc.url + "/v1/calls", json=env, headers=headers) as resp:
            raw = await resp.read()
        assert raw.startswith(body)  # every event the upstream sent, unchanged
        final = _final(raw)
        code = None if final["success"] else final["error"]["code"]
    else:
        url = f"{sc.url}/proxy/fake-openai{path}"
        async with sc.session.post(url, json=env["parameters"]) as resp:
            raw = await resp.read()
        code = None if raw == body else "STREAM_INTERRUPTED"
        assert raw.startswith(body)
        if not marker:  # the provider's own error event follows, so its SDK raises
            assert b"STREAM_INTERRUPTED" in raw[len(body) :]
    assert code == (None if marker else "STREAM_INTERRUPTED")
    assert up.hits == 1
    [record] = sc.audit_records()
    assert record["error_code"] == code


def _stalling(body: bytes, never: asyncio.Event) -> Any:
    """Streams ``body`` in one chunk, then holds the connection open, silent."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(body)
        await never.wait()
        return resp

    return handler


@pytest.mark.parametrize("marker", [True, False], ids=["after-marker", "before-marker"])
@pytest.mark.parametrize("dialect", list(BODIES))
@pytest.mark.parametrize("way", ["relayed", "drop-in"])
async def test_a_silence_after_the_terminal_marker_ends_a_complete_stream(
    upstream_factory: Any, sidecar_factory: Any, way: str, dialect: str, marker: bool
) -> None:
    """The upstream sent its marker and then nothing, its response never ended: the
    stream ends complete at the idle bound, not STREAM_INTERRUPTED ``idle_timeout``."""
    whole, cut, path = BODIES[dialect]
    body = whole if marker else cut
    never = asyncio.Event()
    _, sc = await _stalling_sidecar(upstream_factory, sidecar_factory, dialect, marker, never)
    env = envelope(endpoint=path, max_retries=0, timeout=RULED_OUT_S)
    params = {**STREAM_ENV["parameters"]}
    started = time.monotonic()
    if way == "relayed":
        headers = {"Accept": "text/event-stream"}
        env["parameters"] = params
        async with sc.session.post(sc.url + "/v1/calls", json=env, headers=headers) as resp:
            raw = await resp.read()
        final = _final(raw)
        code = None if final["success"] else final["error"]["code"]
    else:
        url = f"{sc.url}/proxy/fake-openai{path}"
        headers = {"x-egress-timeout": str(RULED_OUT_S)}
        async with sc.session.post(url, json=params, headers=headers) as resp:
            raw = await resp.read()
        code = None if raw == body else "STREAM_INTERRUPTED"
    assert time.monotonic() - started < SOON_S  # the idle bound, not the deadline
    assert raw.startswith(body)
    assert code == (None if marker else "STREAM_INTERRUPTED")
    [record] = sc.audit_records()
    assert record["error_code"] == code


@pytest.mark.parametrize("marker", [True, False], ids=["after-marker", "before-marker"])
@pytest.mark.parametrize("dialect", list(BODIES))
async def test_an_assembled_stream_silent_after_its_marker_is_a_success_at_the_idle_bound(
    upstream_factory: Any, sidecar_factory: Any, dialect: str, marker: bool
) -> None:
    """Without ``Accept: text/event-stream`` the stream is assembled; the gaps between
    its chunks are bounded by ``stream_idle_timeout_s`` as a relayed one's are: silence
    after the marker is a success, before it STREAM_INTERRUPTED, both at that bound, not
    OUTCOME_UNKNOWN at the deadline with the answer lost."""
    path = BODIES[dialect][2]
    never = asyncio.Event()
    up, sc = await _stalling_sidecar(upstream_factory, sidecar_factory, dialect, marker, never)
    env = envelope(
        endpoint=path, max_retries=0, timeout=RULED_OUT_S, parameters=STREAM_ENV["parameters"]
    )
    started = time.monotonic()
    status, answer = await sc.call(env)
    assert time.monotonic() - started < SOON_S  # the idle bound, not the deadline
    assert (status == 200) is marker, answer
    if not marker:
        assert answer["error"]["code"] == "STREAM_INTERRUPTED"
        assert answer["error"]["details"]["reason"] == "idle_timeout"
    assert up.hits == 1
    [record] = sc.audit_records()
    assert record["error_code"] == (None if marker else "STREAM_INTERRUPTED")
