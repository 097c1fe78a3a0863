"""Streams judged by the stream itself: terminal markers, error events inside
200 streams, usage of every streamed shape, the SSE grammar (pure), and the assembled
path through a real sidecar (a loopback upstream that streams)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp import web

from gateway.call.bodies import parse_sse
from gateway.call.sse import EventTooLarge, SseDecoder, decode_all
from gateway.call.stream import StreamJudge, judge_body
from gateway.providers import TokenUsage, extract_usage
from tests.conftest import compile_policy, envelope, openai_target


def sse(*events: Any, end: str = "\n\n") -> bytes:
    """An SSE body: each event a dict (data), a str (raw data) or (event, data)."""
    out = []
    for item in events:
        name, data = item if isinstance(item, tuple) else (None, item)
        text = data if isinstance(data, str) else json.dumps(data)
        out.append((f"event: {name}\n" if name else "") + f"data: {text}")
    return (end.join(out) + end).encode()


def chat(content: str | None = None, finish: str | None = None) -> dict[str, Any]:
    delta = {"content": content} if content is not None else {}
    return {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


CHAT_USAGE = {
    "choices": [],
    "usage": {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17},
}
RESPONSES_DONE = {
    "type": "response.completed",
    "response": {
        "status": "completed",
        "usage": {
            "input_tokens": 10,
            "output_tokens": 30,
            "total_tokens": 40,
            "input_tokens_details": {"cached_tokens": 4},
            "output_tokens_details": {"reasoning_tokens": 20},
        },
    },
}
A_START = {
    "type": "message_start",
    "message": {"usage": {"input_tokens": 12, "output_tokens": 1, "cache_read_input_tokens": 3}},
}
A_DELTA = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}}
A_MSG_DELTA = {"type": "message_delta", "usage": {"output_tokens": 5, "cache_read_input_tokens": 3}}
A_STOP = {"type": "message_stop"}
G_PART = {"candidates": [{"content": {"parts": [{"text": "Hi"}]}}]}
G_END = {
    "candidates": [{"content": {"parts": [{"text": "!"}]}, "finishReason": "STOP"}],
    "usageMetadata": {"promptTokenCount": 4, "candidatesTokenCount": 6, "totalTokenCount": 10},
}

# (name, dialect, body, expected code or None)
VERDICTS = [
    ("chat-done", "openai", sse(chat("Hel"), chat("lo", "stop"), CHAT_USAGE, "[DONE]"), None),
    ("chat-finish-no-done", "openai", sse(chat("Hel"), chat("lo", "stop")), None),
    ("chat-cut", "openai", sse(chat("Hel"), chat("lo")), "STREAM_INTERRUPTED"),
    ("chat-empty-200", "openai", b": ping\n\n", "STREAM_INTERRUPTED"),
    (
        "chat-error-5xx",
        "openai",
        sse(chat("Hel"), {"error": {"type": "server_error", "message": "boom"}}),
        "DEPENDENCY_FAILED",
    ),
    (
        "chat-error-quota",
        "openai",
        sse({"error": {"code": "insufficient_quota", "message": "out"}}),
        "QUOTA_EXHAUSTED",
    ),
    (
        "chat-error-rate",
        "openai",
        sse({"error": {"code": "rate_limit_exceeded", "message": "slow"}}),
        "CAPACITY_EXCEEDED",
    ),
    (
        "responses-done",
        "openai",
        sse(
            ("response.output_text.delta", {"type": "response.output_text.delta", "delta": "x"}),
            ("response.completed", RESPONSES_DONE),
        ),
        None,
    ),
    (
        "responses-incomplete",
        "openai",
        sse(("response.incomplete", {"type": "response.incomplete", "response": {}})),
        None,
    ),
    (
        "responses-failed",
        "openai",
        sse(
            (
                "response.failed",
                {
                    "type": "response.failed",
                    "response": {"error": {"code": "server_error", "message": "x"}},
                },
            )
        ),
        "DEPENDENCY_FAILED",
    ),
    (
        "responses-cut",
        "openai",
        sse(("response.created", {"type": "response.created"})),
        "STREAM_INTERRUPTED",
    ),
    (
        "anthropic-stop",
        "anthropic",
        sse(
            ("message_start", A_START),
            ("content_block_delta", A_DELTA),
            ("message_delta", A_MSG_DELTA),
            ("message_stop", A_STOP),
        ),
        None,
    ),
    (
        "anthropic-cut",
        "anthropic",
        sse(
            ("message_start", A_START),
            ("content_block_delta", A_DELTA),
            ("message_delta", A_MSG_DELTA),
        ),
        "STREAM_INTERRUPTED",
    ),
    (
        "anthropic-overloaded",
        "anthropic",
        sse(
            ("message_start", A_START),
            (
                "error",
                {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}},
            ),
        ),
        "DEPENDENCY_FAILED",
    ),
    (
        "anthropic-rate",
        "anthropic",
        sse(("error", {"type": "error", "error": {"type": "rate_limit_error", "message": "slow"}})),
        "CAPACITY_EXCEEDED",
    ),
    ("gemini-finish", "gemini", sse(G_PART, G_END), None),
    ("gemini-cut", "gemini", sse(G_PART), "STREAM_INTERRUPTED"),
    (
        "gemini-error",
        "gemini",
        sse(G_PART, {"error": {"code": 503, "status": "UNAVAILABLE", "message": "overloaded"}}),
        "DEPENDENCY_FAILED",
    ),
    ("none-cut", "none", sse(chat("Hel")), None),  # usage: none is judged by framing
]


@pytest.mark.parametrize(
    ("dialect", "body", "code"), [v[1:] for v in VERDICTS], ids=[v[0] for v in VERDICTS]
)
def test_a_stream_is_judged_by_its_terminal_marker_and_error_events(
    dialect: str, body: bytes, code: str | None
) -> None:
    error, data = judge_body(dialect, "t", "text/event-stream", body, 200)
    assert (error.code.value if error else None) == code
    if error is not None:
        assert data == parse_sse(body)  # what arrived is kept for the answer
        assert error.status_code == 200


@pytest.mark.parametrize(
    ("dialect", "body", "expected"),
    [
        (
            "openai",
            sse(chat("a"), chat("b", "stop"), CHAT_USAGE, "[DONE]"),
            TokenUsage(12, 5, None, 17),
        ),
        (
            "openai",
            sse(("response.completed", RESPONSES_DONE)),
            TokenUsage(10, 30, 4, 40, reasoning=20),
        ),
        (
            "anthropic",
            sse(
                ("message_start", A_START), ("message_delta", A_MSG_DELTA), ("message_stop", A_STOP)
            ),
            TokenUsage(12, 5, 3, 20),
        ),
        # message_delta with only output_tokens (older API): cache counted once, from start
        (
            "anthropic",
            sse(
                ("message_start", A_START),
                ("message_delta", {"type": "message_delta", "usage": {"output_tokens": 5}}),
            ),
            TokenUsage(12, 5, 3, 20),
        ),
        ("gemini", sse(G_PART, G_END), TokenUsage(4, 6, None, 10)),
        ("openai", sse(chat("a"), chat("b", "stop"), "[DONE]"), None),  # none sent: not 0
    ],
    ids=["chat", "responses", "anthropic", "anthropic-output-only", "gemini", "absent"],
)
def test_usage_of_every_streamed_shape(dialect: str, body: bytes, expected: Any) -> None:
    assert extract_usage(dialect, parse_sse(body)) == expected
    judge = StreamJudge(dialect, "t")
    for event in decode_all(body, 1 << 20):
        judge.observe(event)
    assert judge.usage() == expected


def test_gemini_json_array_stream_usage() -> None:
    assert extract_usage("gemini", [G_PART, G_END]) == TokenUsage(4, 6, None, 10)


def test_keep_alives_and_pings_are_not_content_and_do_not_break_usage() -> None:
    body = (
        b": ping\r\n\r\nevent: ping\r\ndata: {}\r\n\r\nid: 42\r\n\r\n"
        + sse(chat("Hel"), chat("lo", "stop"), CHAT_USAGE).replace(b"\n", b"\r\n")
        + b": keep-alive\r\n\r\ndata: [DONE]\r\n\r\n"
    )
    data = parse_sse(body)
    assert data["content"] == "Hello"
    assert extract_usage("openai", data) == TokenUsage(12, 5, None, 17)
    assert judge_body("openai", "t", "text/event-stream", body, 200)[0] is None


def test_the_decoder_reads_any_cut_of_the_bytes() -> None:
    body = (
        "\ufeff".encode() + b"event: a\r\ndata: x\r\ndata: y\r\n\r\ndata: \xc3\xa9\n\ndata: z\r\r"
    )
    whole = decode_all(body, 1 << 20)
    assert [(e.event, e.data) for e in whole] == [("a", "x\ny"), (None, "é"), (None, "z")]
    for size in (1, 2, 3, 5):
        decoder = SseDecoder(1 << 20)
        got = []
        for i in range(0, len(body), size):
            got += decoder.feed(body[i : i + size])
        assert got + decoder.close() == whole


def test_one_event_is_bounded_but_a_long_stream_is_not() -> None:
    decoder = SseDecoder(1000)
    for _ in range(10_000):  # 10,000 small events: fine
        assert len(decoder.feed(b"data: " + b"x" * 100 + b"\n\n")) == 1
    with pytest.raises(EventTooLarge):
        decoder.feed(b"data: " + b"y" * 600 + b"\ndata: " + b"y" * 600 + b"\n")
    with pytest.raises(EventTooLarge):
        SseDecoder(1000).feed(b"data: " + b"y" * 2000)  # one line without its end


# -- the assembled path, through a real sidecar ---------------------------------------------


def _streaming(*bodies: bytes):
    answers = iter(bodies)

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        body = next(answers)
        for line in body.split(b"\n\n"):
            if line:
                await resp.write(line + b"\n\n")
        await resp.write_eof()
        return resp

    return handler


async def test_a_cut_stream_is_stream_interrupted_not_a_success(upstream_factory, sidecar_factory):
    up = await upstream_factory(_streaming(sse(chat("Hel"), chat("lo"))))
    sc = await sidecar_factory(compile_policy({"fake-openai": openai_target(up.url)}))
    status, answer = await sc.call(envelope(parameters={"model": "m", "stream": True}))
    assert status == 502
    assert answer["success"] is False
    assert answer["error"]["code"] == "STREAM_INTERRUPTED"
    assert answer["error"]["retryable"] is True
    assert answer["status_code"] == 200
    assert answer["data"]["content"] == "Hello"  # the partial answer, labelled as such
    assert up.hits == 1  # a POST without an idempotency key is not sent twice
    [record] = sc.audit_records()
    assert record["error_code"] == "STREAM_INTERRUPTED"


async def test_a_keyed_call_retries_a_cut_stream(upstream_factory, sidecar_factory):
    up = await upstream_factory(
        _streaming(sse(chat("Hel")), sse(chat("Hel"), chat("lo", "stop"), CHAT_USAGE, "[DONE]"))
    )
    target = openai_target(up.url, idempotency={"methods": ["POST"]})
    sc = await sidecar_factory(compile_policy({"fake-openai": target}))
    status, answer = await sc.call(
        envelope(parameters={"model": "m", "stream": True}, max_retries=1)
    )
    assert status == 200, answer
    assert answer["success"] is True
    assert answer["data"]["content"] == "Hello"
    assert answer["tokens_used"] == 17
    assert up.hits == 2
    assert up.seen[0].headers["Idempotency-Key"] == up.seen[1].headers["Idempotency-Key"]


async def test_an_error_event_in_a_200_stream_is_a_failure(upstream_factory, sidecar_factory):
    body = sse(
        ("message_start", A_START),
        (
            "error",
            {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}},
        ),
    )
    up = await upstream_factory(_streaming(body))
    target = openai_target(up.url, usage="anthropic")
    sc = await sidecar_factory(compile_policy({"fake-openai": target}))
    status, answer = await sc.call(envelope(parameters={"model": "m", "stream": True}))
    assert status == 502
    assert answer["error"]["code"] == "DEPENDENCY_FAILED"
    assert answer["error"]["retryable"] is True
    assert answer["error"]["details"]["upstream_reason"] == "overloaded_error"
    assert up.hits == 1


@pytest.mark.parametrize(
    ("items", "code"),
    [
        ([G_PART, G_END], None),
        ([G_PART], "STREAM_INTERRUPTED"),
        ([G_PART, {"error": {"code": 429, "status": "RESOURCE_EXHAUSTED", "message": "x"}}],
         "CAPACITY_EXCEEDED"),
        ([{"name": "models/a"}, {"name": "models/b"}], None),  # not a stream: a list answer
    ],
    ids=["complete", "cut", "error", "not-a-stream"],
)  # fmt: skip
def test_gemini_json_array_streams_are_judged_too(items: list[Any], code: str | None) -> None:
    body = json.dumps(items).encode()
    error, data = judge_body("gemini", "t", "application/json", body, 200)
    assert (error.code.value if error else None) == code
    if error is not None:
        assert data == items


async def test_a_stream_whose_connection_breaks_is_stream_interrupted(
    upstream_factory, sidecar_factory
):
    """A reset mid-stream is an interrupted stream, not DEPENDENCY_FAILED's 'could not be
    reached': the upstream was reached and had started answering."""

    async def reset(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        await resp.write(sse(chat("Hel")))
        assert request.transport is not None
        request.transport.abort()  # no last chunk: the framing breaks
        return resp

    up = await upstream_factory(reset)
    target = openai_target(up.url, endpoints=[{"path": "/v1/**", "methods": ["POST", "PUT"]}])
    sc = await sidecar_factory(compile_policy({"fake-openai": target}))
    status, answer = await sc.call(
        envelope(method="PUT", parameters={"model": "m", "stream": True}, max_retries=0)
    )
    assert status == 502, answer
    assert answer["error"]["code"] == "STREAM_INTERRUPTED"
    assert answer["error"]["details"]["reason"] == "reset"
    assert answer["status_code"] == 200
    assert answer["data"]["content"] == "Hel"
