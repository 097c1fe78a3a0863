"""Streaming to the agent: ``Accept: text/event-stream`` on ``POST /v1/calls``.

A real sidecar and a loopback upstream that streams with real pauses, synchronised by
events (the upstream waits for the test before sending its rest), never by sleeps.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.call.relay import AgentGone, Relayed, relay_stream
from gateway.call.stream import StreamJudge
from gateway.errors import DeadlineExceeded, StreamInterrupted
from tests.conftest import compile_policy, envelope, openai_target
from tests.test_streams import A_START, CHAT_USAGE, chat, sse

# It asks for the usage its upstreams send (stream_options.include_usage), so the relay
# owes it every byte they send.
STREAM_ENV = envelope(
    parameters={
        "model": "m",
        "stream": True,
        "messages": [],
        "stream_options": {"include_usage": True},
    }
)


class Streamer:
    """An upstream that sends ``head``, waits for ``release``, then sends ``tail`` and
    ends; with ``ping`` it sends keep-alive comments instead, until its peer goes away."""

    def __init__(
        self, head: bytes, tail: bytes = b"", *, status: int = 200, ping: bool = False
    ) -> None:
        self.head, self.tail, self.status, self.ping = head, tail, status, ping
        self.release = asyncio.Event()
        self.head_sent = asyncio.Event()
        self.closed_by_peer = asyncio.Event()

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=self.status, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(self.head)
        self.head_sent.set()
        await self.release.wait()
        try:
            for _ in range(200):  # the sidecar closes the connection when its agent is gone
                if request.transport is None or request.transport.is_closing():
                    self.closed_by_peer.set()
                    return resp
                await resp.write(b": ping\n\n" if self.ping else self.tail)
                if not self.ping:
                    break
                await asyncio.sleep(0.01)
        except (ConnectionResetError, RuntimeError):
            self.closed_by_peer.set()
            return resp
        except asyncio.CancelledError:
            # aiohttp's test server cancels a handler whose client closed the connection
            self.closed_by_peer.set()
            raise
        await resp.write_eof()
        return resp


async def _sidecar(upstream_factory: Any, sidecar_factory: Any, handler: Any, **target: Any):
    up = await upstream_factory(handler)
    sc = await sidecar_factory(compile_policy({"fake-openai": openai_target(up.url, **target)}))
    return up, sc


def _post(sc: Any, env: dict[str, Any]) -> Any:
    return sc.session.post(sc.url + "/v1/calls", json=env, headers={"Accept": "text/event-stream"})


def _final(raw: bytes) -> dict[str, Any]:
    _, sep, last = raw.rpartition(b"event: egress.response\n")
    assert sep, raw[-300:]
    assert last.startswith(b"data: ")
    assert last.endswith(b"\n\n")
    return json.loads(last[6:].strip())


async def test_events_are_relayed_as_they_arrive_then_the_final_response(
    upstream_factory, sidecar_factory
):
    head = sse(chat("Hel"))
    tail = sse(chat("lo", "stop"), CHAT_USAGE, "[DONE]")
    streamer = Streamer(head, tail)
    up, sc = await _sidecar(upstream_factory, sidecar_factory, streamer)
    async with _post(sc, STREAM_ENV) as resp:
        assert resp.status == 200
        assert resp.content_type == "text/event-stream"
        first = await resp.content.readexactly(len(head))
        assert first == head  # arrived while the upstream still holds the rest
        assert not streamer.release.is_set()
        streamer.release.set()
        rest = await resp.content.read()
    assert rest.startswith(tail)  # unchanged, byte for byte
    final = _final(rest)
    assert final["success"] is True
    assert final["data"] is None
    assert final["tokens_used"] == 17
    assert final["error"] is None
    [record] = sc.audit_records()
    assert record["stream"] is True
    assert record["stream_events"] == 4
    assert record["time_to_first_byte_ms"] is not None
    assert record["tokens_used"] == 17
    assert up.hits == 1


async def test_keep_alives_and_crlf_pass_through_as_sent(upstream_factory, sidecar_factory):
    body = (
        b": ping\r\n\r\nevent: ping\r\ndata: {}\r\n\r\n"
        + sse(chat("x", "stop")).replace(b"\n", b"\r\n")
        + b"data: [DONE]\r\n\r\n"
    )
    streamer = Streamer(body, b": bye\n\n")
    streamer.release.set()
    _, sc = await _sidecar(upstream_factory, sidecar_factory, streamer)
    async with _post(sc, STREAM_ENV) as resp:
        raw = await resp.content.read()
    assert raw.startswith(body + b": bye\n\n")
    assert _final(raw)["success"] is True


async def test_a_stream_cut_mid_way_ends_with_stream_interrupted_and_is_not_resent(
    upstream_factory, sidecar_factory
):
    async def cut(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse(chat("Hel")))
        await resp.write_eof()  # a clean close, but no [DONE] and no finish_reason
        return resp

    up, sc = await _sidecar(
        upstream_factory, sidecar_factory, cut, idempotency={"methods": ["POST"]}
    )
    async with _post(sc, {**STREAM_ENV, "max_retries": 2}) as resp:
        assert resp.status == 200
        raw = await resp.content.read()
    final = _final(raw)
    assert final["success"] is False
    assert final["error"]["code"] == "STREAM_INTERRUPTED"
    assert final["error"]["retryable"] is True
    assert up.hits == 1  # no retry once an event has been relayed
    [record] = sc.audit_records()
    assert record["error_code"] == "STREAM_INTERRUPTED"
    assert record["stream"] is True


async def test_an_error_event_inside_the_200_stream_is_the_final_error(
    upstream_factory, sidecar_factory
):
    body = sse(("message_start", A_START), ("error", {"type": "error", "error": {
        "type": "rate_limit_error", "message": "slow down"}}))  # fmt: skip
    streamer = Streamer(body)
    streamer.release.set()
    _, sc = await _sidecar(upstream_factory, sidecar_factory, streamer, usage="anthropic")
    async with _post(sc, STREAM_ENV) as resp:
        raw = await resp.content.read()
    assert raw.startswith(body)
    final = _final(raw)
    assert final["error"]["code"] == "CAPACITY_EXCEEDED"
    assert final["error"]["details"]["upstream_reason"] == "rate_limit_error"


async def test_failures_before_the_stream_are_retried_and_answered_as_json(
    upstream_factory, sidecar_factory
):
    answers = iter([503, 200])
    streamer = Streamer(sse(chat("ok", "stop"), "[DONE]"))
    streamer.release.set()

    async def flaky(request: web.Request) -> web.StreamResponse:
        if next(answers) == 503:
            return web.json_response({"error": {"message": "busy"}}, status=503)
        return await streamer(request)

    up, sc = await _sidecar(upstream_factory, sidecar_factory, flaky)
    async with _post(sc, STREAM_ENV) as resp:
        raw = await resp.content.read()
    assert _final(raw)["success"] is True
    assert up.hits == 2

    async def refused(_: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "bad model"}}, status=400)

    up.handler = refused
    async with _post(sc, STREAM_ENV) as resp:
        assert resp.status == 400
        assert resp.content_type == "application/json"
        answer = await resp.json()
    assert answer["error"]["code"] == "UPSTREAM_REJECTED"


async def test_the_agent_hanging_up_closes_the_upstream_request_at_once(
    upstream_factory, sidecar_factory
):
    streamer = Streamer(sse(chat("Hel")), ping=True)  # pings until its peer goes away
    _, sc = await _sidecar(upstream_factory, sidecar_factory, streamer)
    resp = await _post(sc, STREAM_ENV)
    await resp.content.readexactly(len(streamer.head))
    resp.close()  # the agent goes away
    streamer.release.set()
    await asyncio.wait_for(streamer.closed_by_peer.wait(), 5)

    async def audited() -> dict[str, Any]:
        while not sc.audit_records():
            await asyncio.sleep(0.01)
        return sc.audit_records()[0]

    record = await asyncio.wait_for(audited(), 5)
    assert record["success"] is False
    assert record["error_code"] == "STREAM_INTERRUPTED"
    assert record["stream"] is True


async def test_a_silent_stream_is_cut_by_stream_idle_timeout(upstream_factory, sidecar_factory):
    streamer = Streamer(sse(chat("Hel")), sse(chat("lo", "stop")))  # never released
    _, sc = await _sidecar(upstream_factory, sidecar_factory, streamer, stream_idle_timeout_s=0.3)
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with _post(sc, STREAM_ENV) as resp:
        raw = await resp.content.read()
    elapsed = loop.time() - started
    final = _final(raw)
    assert final["error"]["code"] == "STREAM_INTERRUPTED"
    assert final["error"]["details"]["reason"] == "idle_timeout"
    assert 0.3 <= elapsed < 3.0
    streamer.release.set()


async def test_one_event_of_300_kib_is_relayed_whole(upstream_factory, sidecar_factory):
    big = sse(chat("A" * 307_200), chat("", "stop"), "[DONE]")
    streamer = Streamer(big)
    streamer.release.set()
    _, sc = await _sidecar(upstream_factory, sidecar_factory, streamer)
    async with _post(sc, STREAM_ENV) as resp:
        raw = await resp.content.read()
    assert raw.startswith(big)
    assert _final(raw)["success"] is True


async def test_without_the_accept_header_the_stream_is_assembled(upstream_factory, sidecar_factory):
    streamer = Streamer(sse(chat("Hel"), chat("lo", "stop"), CHAT_USAGE, "[DONE]"))
    streamer.release.set()
    _, sc = await _sidecar(upstream_factory, sidecar_factory, streamer)
    status, answer = await sc.call(STREAM_ENV)
    assert status == 200
    assert answer["data"]["content"] == "Hello"
    assert answer["tokens_used"] == 17
    assert sc.audit_records()[0]["stream"] is False


async def test_refusals_before_the_upstream_are_json_even_when_a_stream_is_asked(
    upstream_factory, sidecar_factory
):
    _, sc = await _sidecar(upstream_factory, sidecar_factory, Streamer(b""))
    async with sc.session.post(
        sc.url + "/v1/calls",
        json={**STREAM_ENV, "endpoint": "/v1/not-allowed"},
        headers={"Accept": "text/event-stream"},
    ) as resp:
        assert resp.status == 403
        assert (await resp.json())["error"]["code"] == "PERMISSION_DENIED"
    assert isinstance(aiohttp.__version__, str)


async def test_a_stored_streamed_answer_is_replayed_as_its_stream(
    upstream_factory, sidecar_factory
):
    body = sse(chat("Hel"), chat("lo", "stop"), CHAT_USAGE, "[DONE]")
    streamer = Streamer(body)
    streamer.release.set()
    up, sc = await _sidecar(
        upstream_factory, sidecar_factory, streamer, idempotency={"methods": ["POST"]}
    )
    env = {**STREAM_ENV, "idempotency_key": "stream-once"}
    async with _post(sc, env) as resp:
        first = await resp.content.read()
    async with _post(sc, env) as resp:  # the same key: a replay, streamed again
        assert resp.content_type == "text/event-stream"
        again = await resp.content.read()
    assert again.startswith(body)
    replayed = _final(again)
    assert replayed["replayed"] is True
    assert replayed["success"] is True
    assert _final(first)["replayed"] is False
    status, assembled = await sc.call(env)  # no Accept header: the assembled form
    assert status == 200
    assert assembled["replayed"] is True
    assert assembled["data"]["content"] == "Hello"
    assert up.hits == 1


async def test_an_assembled_stream_is_replayed_as_a_stream_when_one_is_asked(
    upstream_factory, sidecar_factory
):
    body = sse(chat("Hel"), chat("lo", "stop"), "[DONE]")
    streamer = Streamer(body)
    streamer.release.set()
    up, sc = await _sidecar(
        upstream_factory, sidecar_factory, streamer, idempotency={"methods": ["POST"]}
    )
    env = {**STREAM_ENV, "idempotency_key": "assembled-first"}
    status, answer = await sc.call(env)
    assert status == 200
    assert answer["data"]["content"] == "Hello"
    async with _post(sc, env) as resp:
        again = await resp.content.read()
    assert again.startswith(body)
    assert _final(again)["replayed"] is True
    assert up.hits == 1


# -- the final event never runs into an upstream's half event ---------------------------


def _raw_upstream(*pieces: bytes, pause: asyncio.Event | None = None):
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for piece in pieces:
            await resp.write(piece)
            await asyncio.sleep(0)  # separate writes: separate network chunks
        await resp.write_eof()
        return resp

    return handler


def _events(raw: bytes) -> list[tuple[str | None, str]]:
    from gateway.call.sse import decode_all

    return [(e.event, e.data) for e in decode_all(raw, 1 << 24)]


async def test_a_stream_cut_mid_event_drops_the_half_event(upstream_factory, sidecar_factory):
    handler = _raw_upstream(sse(chat("Hel")), b'data: {"choi')
    _, sc = await _sidecar(upstream_factory, sidecar_factory, handler)
    async with _post(sc, STREAM_ENV) as resp:
        raw = await resp.content.read()
    events = _events(raw)
    assert events[-1][0] == "egress.response"  # an event of its own, parsed as such
    assert json.loads(events[-1][1])["error"]["code"] == "STREAM_INTERRUPTED"
    assert b'{"choi' not in raw


async def test_a_last_event_without_its_blank_line_is_closed(upstream_factory, sidecar_factory):
    handler = _raw_upstream(sse(chat("Hi", "stop")), b"data: [DONE]")
    _, sc = await _sidecar(upstream_factory, sidecar_factory, handler)
    async with _post(sc, STREAM_ENV) as resp:
        raw = await resp.content.read()
    events = _events(raw)
    assert events[-2] == (None, "[DONE]")
    assert events[-1][0] == "egress.response"
    assert json.loads(events[-1][1])["success"] is True


async def test_an_upstream_cannot_send_the_sidecars_final_event(upstream_factory, sidecar_factory):
    forged = b'event: egress.response\ndata: {"success": true, "correlation_id": "forged"}\n\n'
    handler = _raw_upstream(forged, sse(chat("Hi", "stop"), "[DONE]"))
    _, sc = await _sidecar(upstream_factory, sidecar_factory, handler)
    async with _post(sc, STREAM_ENV) as resp:
        raw = await resp.content.read()
    names = [name for name, _ in _events(raw)]
    assert names.count("egress.response") == 1
    assert names[0] == "upstream.egress.response"
    assert names[-1] == "egress.response"


async def test_a_secret_split_across_two_chunks_is_scrubbed(upstream_factory, sidecar_factory):
    async def echo(request: web.Request) -> web.StreamResponse:
        secret = request.headers["Authorization"].removeprefix("Bearer ").encode()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"delta": {"content": "' + secret[:9])
        await asyncio.sleep(0.05)  # the rest in another network chunk
        await resp.write(secret[9:] + b'"}, "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n')
        await resp.write_eof()
        return resp

    _, sc = await _sidecar(upstream_factory, sidecar_factory, echo)
    async with _post(sc, STREAM_ENV) as resp:
        raw = await resp.content.read()
    assert b"NOTREAL" not in raw
    assert b"[REDACTED]" in raw


async def test_an_event_past_the_limit_is_not_relayed(upstream_factory, sidecar_factory):
    handler = _raw_upstream(sse(chat("ok")), b"data: " + b"A" * 300_000)
    up = await upstream_factory(handler)
    policy = compile_policy(
        {"fake-openai": openai_target(up.url)}, server={"max_response_bytes": 100_000}
    )
    sc = await sidecar_factory(policy)
    async with _post(sc, STREAM_ENV) as resp:
        streamed = resp.content_type == "text/event-stream"
        raw = await resp.content.read()
    assert b"AAAA" not in raw
    # Streamed when the first event arrived on its own, else refused before any relaying.
    final = json.loads(_events(raw)[-1][1]) if streamed else json.loads(raw)
    assert final["error"]["code"] == "RESPONSE_TOO_LARGE"


class _Chunks:
    """An upstream stream (the shape :func:`relay_stream` reads) giving these chunks."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks = list(chunks)
        self.closed = False

    async def read(self) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""

    async def aclose(self) -> None:
        self.closed = True


class _Recorder:
    """A relay that notes how many events the judge had read at each send."""

    def __init__(self, judge: StreamJudge, *, gone: bool = False) -> None:
        self.judge, self.gone, self.started = judge, gone, False
        self.judged_at_send: list[int] = []

    async def start(self) -> None:
        self.started = True

    async def send(self, chunk: bytes) -> None:
        self.judged_at_send.append(self.judge.events)
        if self.gone:
            raise AgentGone


async def test_whole_events_are_relayed_before_the_judge_reads_them():
    # A fast upstream's first read often holds the whole stream: the agent's first byte
    # must not wait for every event of it to be parsed (time to first byte).
    body = sse(*[chat("tok")] * 50, chat(finish="stop"), CHAT_USAGE, "[DONE]")
    judge = StreamJudge("openai", "t")
    relay, stream = _Recorder(judge), _Chunks(body)
    done = Relayed(judge)
    now = time.monotonic()
    await relay_stream(
        stream, relay, done, started=now, deadline=now + 30, idle_timeout_s=30, max_bytes=1 << 20
    )
    assert relay.judged_at_send == [0]  # sent first, judged after
    assert judge.events == 53
    assert judge.verdict(status=200) is None
    usage = judge.usage()
    assert usage is not None
    assert usage.total == 17
    assert done.bytes == len(body)
    assert stream.closed


async def test_an_agent_gone_mid_chunk_is_reported_with_the_chunks_events_judged():
    judge = StreamJudge("openai", "t")
    relay = _Recorder(judge, gone=True)
    stream = _Chunks(sse(chat("a"), chat("b")), sse(chat(finish="stop"), "[DONE]"))
    now = time.monotonic()
    with pytest.raises(StreamInterrupted) as caught:
        await relay_stream(
            stream, relay, Relayed(judge), started=now, deadline=now + 30, idle_timeout_s=30,
            max_bytes=1 << 20,
        )  # fmt: skip
    assert caught.value.details["reason"] == "agent_disconnected"
    assert "after 2 events" in str(caught.value)
    assert stream.closed


class _Then:
    """A stream that gives ``chunks``, then never anything more (a silent upstream)."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks = list(chunks)
        self.closed = False

    async def read(self) -> bytes:
        if self.chunks:
            return self.chunks.pop(0)
        await asyncio.Event().wait()  # cancelled by the relay's timer
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        self.closed = True


class _Stuck(_Recorder):
    """A relay whose agent takes no bytes: every send waits until cancelled."""

    async def send(self, chunk: bytes) -> None:
        self.judged_at_send.append(self.judge.events)
        await asyncio.Event().wait()


@pytest.mark.parametrize(
    ("deadline_s", "idle_s", "stuck", "error", "reason"),
    [
        (30, 0.1, False, StreamInterrupted, "idle_timeout"),  # the idle bound, re-armed
        (0.1, 30, False, DeadlineExceeded, "deadline"),  # the deadline nearer than idle
        (0.1, 30, True, DeadlineExceeded, "agent_stalled"),  # a write past the deadline
    ],
)
async def test_one_timer_bounds_the_gaps_and_the_writes(deadline_s, idle_s, stuck, error, reason):
    judge = StreamJudge("openai", "t")
    relay = _Stuck(judge) if stuck else _Recorder(judge)
    stream = _Then(sse(chat("a")), sse(chat("b")))
    now = time.monotonic()
    with pytest.raises(error) as caught:
        await relay_stream(
            stream, relay, Relayed(judge), started=now, deadline=now + deadline_s,
            idle_timeout_s=idle_s, max_bytes=1 << 20,
        )  # fmt: skip
    assert caught.value.details["reason"] == reason
    assert stream.closed
    assert len(relay.judged_at_send) == (1 if stuck else 2)
    assert time.monotonic() - now < 5  # bounded by the timer, not by the test's timeout


class _Slow(_Recorder):
    """A relay whose agent takes each chunk ``s`` seconds after it is sent (a slow
    reader, not a stalled one)."""

    def __init__(self, judge: StreamJudge, s: float) -> None:
        super().__init__(judge)
        self.s = s

    async def send(self, chunk: bytes) -> None:
        self.judged_at_send.append(self.judge.events)
        await asyncio.sleep(self.s)  # the agent's pace, which the idle bound must not cut


async def test_a_write_longer_than_the_idle_gap_is_not_cut_and_the_gap_still_bounds_reads():
    # The timer goes off during the slow write (past the idle gap) and must move on to
    # the deadline; the read after it must be bounded by the idle gap again, not by the
    # deadline it was moved to.
    judge = StreamJudge("openai", "t")
    relay = _Slow(judge, 0.3)
    stream = _Then(sse(chat("a")), sse(chat("b")))
    now = time.monotonic()
    with pytest.raises(StreamInterrupted) as caught:
        await relay_stream(
            stream, relay, Relayed(judge), started=now, deadline=now + 30, idle_timeout_s=0.1,
            max_bytes=1 << 20,
        )  # fmt: skip
    assert caught.value.details["reason"] == "idle_timeout"
    assert relay.judged_at_send == [0, 1]  # both written whole, each slower than the gap
    assert time.monotonic() - now < 5  # the idle bound, not the 30 s deadline


@pytest.mark.parametrize(
    ("first_s", "idle_s", "chunks", "reason"),
    [
        (30, 0.1, 2, "idle_timeout"),  # after the first event the shorter idle gap rules
        (0.1, 30, 0, "first_byte_timeout"),  # no first event: its own bound
    ],
)
async def test_the_first_event_bound_gives_way_to_the_idle_gap(first_s, idle_s, chunks, reason):
    judge = StreamJudge("openai", "t")
    relay = _Recorder(judge)
    stream = _Then(*[sse(chat(str(i))) for i in range(chunks)])
    now = time.monotonic()
    with pytest.raises(StreamInterrupted) as caught:
        await relay_stream(
            stream, relay, Relayed(judge), started=now, deadline=now + 60, idle_timeout_s=idle_s,
            max_bytes=1 << 20, first_event_timeout_s=first_s,
        )  # fmt: skip
    assert caught.value.details["reason"] == reason
    assert len(relay.judged_at_send) == chunks
    assert stream.closed
    assert time.monotonic() - now < 5  # the 0.1 s bound, not the 30 s one


async def test_a_cancellation_from_outside_is_not_taken_for_the_timer():
    # The agent's handler cancelled (it hung up): the relay's task ends cancelled, not
    # with a timeout error, and its upstream stream is closed.
    judge = StreamJudge("openai", "t")
    stream = _Then(sse(chat("a")))
    now = time.monotonic()
    relayed = relay_stream(
        stream, _Recorder(judge), Relayed(judge), started=now, deadline=now + 30,
        idle_timeout_s=30, max_bytes=1 << 20,
    )  # fmt: skip
    task = asyncio.ensure_future(relayed)
    for _ in range(100):  # until the relay took its chunk and waits on the next read
        if not stream.chunks:
            break
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not stream.chunks
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert stream.closed
