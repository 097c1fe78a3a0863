"""A read that is one whole event is judged from its bytes (``SseDecoder.feed_whole``,
``StreamJudge.observe_raw``), without decoding and splitting its text: the events, the
verdict, the usage, the model and the malformed count must be what decoding every read
with ``SseDecoder.feed`` gives, whatever the reads (pure, table-driven)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.call.relay import _feed
from gateway.call.sse import SseDecoder
from gateway.call.stream import StreamJudge

_CHAT = b'data: {"model":"m-1","choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\n'  # noqa: E501
_STOP = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n'  # noqa: E501
_ERROR = b'data: {"error":{"code":"server_error","message":"boom"}}\n\n'
_DONE = b"data: [DONE]\n\n"
_A_START = b'event: message_start\ndata: {"type":"message_start","message":{"model":"c-1","usage":{"input_tokens":4,"output_tokens":1}}}\n\n'  # noqa: E501
_A_DELTA = b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"hi"}}\n\n'  # noqa: E501
_A_ERROR = (
    b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"busy"}}\n\n'
)
_A_STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
_G_CHUNK = (
    b'data: {"candidates":[{"content":{"parts":[{"text":"x"}]}}],"modelVersion":"g-1"}\r\n\r\n'
)
_G_LAST = b'data: {"candidates":[{"finishReason":"STOP"}],"usageMetadata":{"promptTokenCount":2,"candidatesTokenCount":1,"totalTokenCount":3}}\r\n\r\n'  # noqa: E501

CASES: list[tuple[str, str, list[bytes]]] = [
    ("openai", "plain deltas, usage, end", [_CHAT, _CHAT, _STOP, _DONE]),
    ("openai", "an error event mid-stream", [_CHAT, _ERROR, _CHAT]),
    ("openai", "no space after data:", [_CHAT, b'data:{"choices":[]}\n\n', _DONE]),
    (
        "openai",
        "empty data, data not JSON",
        [_CHAT, b"data:\n\n", b"data: \n\n", b"data: 42\n\n", _DONE],
    ),
    (
        "openai",
        "JSON after two spaces is text",
        [_CHAT, b'data:  {"error":{"code":"x"}}\n\n', _DONE],
    ),
    ("openai", "malformed JSON", [_CHAT, b'data: {"choices":}\n\n', _DONE]),
    ("openai", "a CR inside the line", [_CHAT, b'data: {"a":\r1}\n\n', _DONE]),
    ("openai", "a CR line end at the end", [_CHAT, b'data: {"a":1}\r\n\n', _DONE]),
    ("openai", "two data lines", [_CHAT, b'data: {"a":\ndata: 1}\n\n', _DONE]),
    ("openai", "not UTF-8 in the data", [_CHAT, b'data: {"a":"\xff"}\n\n', _DONE]),
    ("openai", "not UTF-8, not JSON", [_CHAT, b'data: {"a":"\xff"\n\n', _DONE]),
    ("openai", "a BOM first", [b"\xef\xbb\xbf" + _CHAT, _CHAT, _DONE]),
    (
        "openai",
        "a character cut between reads",
        [_CHAT, b'data: {"a":"\xc3', b'\xa9"}\n\n', _CHAT, _DONE],
    ),
    ("openai", "a CRLF cut between reads", [_CHAT, b'data: {"a":1}\r\n\r', b"\n" + _CHAT, _DONE]),
    (
        "openai",
        "an id line and a comment",
        [_CHAT, b"id: 7\ndata: {}\n\n", b": ping\n\n", _CHAT, _DONE],
    ),
    ("openai", "two events in one read", [_CHAT, _CHAT + _ERROR, _DONE]),
    ("openai", "an event cut across reads", [_CHAT, _STOP[:40], _STOP[40:], _DONE]),
    ("openai", "no terminal marker", [_CHAT, _CHAT]),
    ("anthropic", "a whole stream", [_A_START, _A_DELTA, _A_DELTA, _A_STOP]),
    ("anthropic", "an error event", [_A_START, _A_DELTA, _A_ERROR]),
    (
        "anthropic",
        "an event type read before its data",
        [_A_START, b"event: error\n", b'data: {"error":{"type":"x"}}\n\n'],
    ),
    (
        "anthropic",
        "event: without a space, empty",
        [_A_START, b"event:error\ndata: {}\n\n", b"event:\ndata: {}\n\n", _A_STOP],
    ),
    (
        "anthropic",
        "not UTF-8 in the event type",
        [_A_START, b"event: err\xffor\ndata: {}\n\n", _A_STOP],
    ),
    (
        "anthropic",
        "an event line and two data lines",
        [_A_START, b"event: error\ndata: {\ndata: }\n\n"],
    ),
    ("anthropic", "an event line with CRLF", [_A_START, b"event: error\r\ndata: {}\r\n\r\n"]),
    ("gemini", "CRLF chunks", [_G_CHUNK, _G_CHUNK, _G_LAST]),
    ("gemini", "a CR alone inside", [_G_CHUNK, b'data: {"a":\r1}\r\n\r\n', _G_LAST]),
    (
        "gemini",
        "an error chunk",
        [
            _G_CHUNK,
            b'data: {"error":{"code":429,"status":"RESOURCE_EXHAUSTED","message":"m"}}\r\n\r\n',
        ],
    ),
    ("none", "no dialect", [_CHAT, _CHAT]),
]


def _judged(provider: str, reads: list[bytes], *, fast: bool) -> dict[str, Any]:
    judge = StreamJudge(provider, "t")
    judge.watch_model = True
    decoder = SseDecoder(1 << 20)
    for read in reads:
        if fast:
            _feed(decoder, judge, read, 1 << 20)
        else:
            for event in decoder.feed(read):
                judge.observe(event)
    for event in decoder.close():
        judge.observe(event)
    error = judge.verdict(status=200)
    return {
        "events": judge.events,
        "decoded": decoder.events,
        "complete": judge.complete,
        "failure": judge.failure,
        "malformed": judge.malformed,
        "usage": judge.usage(),
        "model": judge.model,
        "response_model": judge.response_model(),
        "error": None if error is None else (error.code, str(error), error.details),
    }


@pytest.mark.parametrize(("provider", "case", "reads"), CASES, ids=[c[1] for c in CASES])
def test_a_stream_is_judged_alike_read_whole_or_decoded(
    provider: str, case: str, reads: list[bytes]
) -> None:
    del case
    assert _judged(provider, reads, fast=True) == _judged(provider, reads, fast=False)


@pytest.mark.parametrize("read", [c for _, _, reads in CASES for c in reads])
def test_a_whole_event_is_read_as_feed_reads_it(read: bytes) -> None:
    warm = b"data: {}\n\n"  # past the start: the decoder holds nothing
    whole, decoded = SseDecoder(1 << 20), SseDecoder(1 << 20)
    whole.feed(warm), decoded.feed(warm)
    got = whole.feed_whole(read)
    events = decoded.feed(read)
    if got is None:  # nothing consumed: feed reads it as it would have
        assert whole.feed(read) == events
        return
    name, data = got
    assert [(e.event, e.data) for e in events] == [(name, data.decode("utf-8", "replace"))]
    assert whole.events == decoded.events == 2


def test_a_read_before_the_first_or_after_a_cut_is_not_read_whole() -> None:
    decoder = SseDecoder(1 << 20)
    assert decoder.feed_whole(_CHAT) is None  # the BOM rule: the first read is decoded
    decoder.feed(_CHAT)
    assert decoder.feed_whole(_CHAT) is not None
    decoder.feed(b"event: error\n")
    assert decoder.feed_whole(_CHAT) is None  # an event type is pending
    decoder.feed(b"data: 1")
    assert decoder.feed_whole(_CHAT) is None  # a line is pending
    decoder.feed(b"\n\n")
    assert decoder.feed_whole(_CHAT) is not None


def test_an_event_past_the_bound_is_left_to_feed() -> None:
    decoder = SseDecoder(20)
    decoder.feed(b"data: {}\n\n")
    assert decoder.feed_whole(b'data: {"a":"' + b"x" * 30 + b'"}\n\n') is None
