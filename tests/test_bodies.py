"""Upstream bodies -> ``data``: JSON, text shapes, error pages, server-sent events."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from gateway.call.bodies import ERROR_TEXT_LIMIT, is_json_type, media_type, parse_body, parse_sse


@pytest.mark.parametrize(
    ("content_type", "expected"),
    [
        ("application/json", "application/json"),
        ("Application/JSON; charset=UTF-8", "application/json"),
        ("  text/html ;charset=x", "text/html"),
        ("", ""),
        (None, ""),
    ],
)
def test_media_type(content_type: str | None, expected: str) -> None:
    assert media_type(content_type) == expected


@pytest.mark.parametrize(
    ("mtype", "expected"),
    [
        ("application/json", True),
        ("application/problem+json", True),
        ("application/vnd.api+json", True),
        ("text/json", False),
        ("application/jsonl", False),
        ("text/plain", False),
    ],
)
def test_is_json_type(mtype: str, expected: bool) -> None:
    assert is_json_type(mtype) is expected


@pytest.mark.parametrize(
    ("content_type", "body", "status", "expected"),
    [
        ("application/json", b'{"a": 1}', 200, {"a": 1}),
        ("application/json; charset=utf-8", '{"t": "é世"}'.encode(), 200, {"t": "é世"}),
        ("application/problem+json", b'{"title": "Bad"}', 400, {"title": "Bad"}),
        ("application/vnd.api+json", b"[1, 2]", 200, [1, 2]),
        (None, b'{"ok": true}', 200, {"ok": True}),  # no content type, but a JSON body
        ("", b"[null]", 502, [None]),
        ("application/json", b'"just a string"', 200, "just a string"),
        ("application/json", b"12345678901234567890", 200, 12345678901234567890),
    ],
)
def test_json_bodies_are_parsed(
    content_type: str | None, body: bytes, status: int, expected: Any
) -> None:
    assert parse_body(content_type, body, status) == (expected, True)


@pytest.mark.parametrize("status", [200, 204, 502])
def test_an_empty_body_is_none(status: int) -> None:
    assert parse_body("application/json", b"", status) == (None, False)


HTML_502 = (
    "<html><head><title>502 Bad Gateway</title></head><body>"
    + "<p>nginx</p>" * 300
    + "</body></html>"
).encode()


def test_an_html_error_page_becomes_truncated_text() -> None:
    assert len(HTML_502) > 2000
    data, is_json = parse_body("text/html; charset=utf-8", HTML_502, 502)
    assert is_json is False
    assert data == {"content_type": "text/html", "text": HTML_502.decode()[:ERROR_TEXT_LIMIT]}
    assert ERROR_TEXT_LIMIT == 512
    assert len(data["text"]) == 512


def test_text_is_not_truncated_on_success() -> None:
    data, _ = parse_body("text/html", HTML_502, 200)
    assert data == {"content_type": "text/html", "text": HTML_502.decode()}


def test_the_limit_counts_characters_not_bytes() -> None:
    data, _ = parse_body("text/plain", ("é" * 600).encode(), 500)
    assert data["text"] == "é" * 512


def test_text_at_the_limit_is_kept_whole() -> None:
    data, _ = parse_body("text/plain", b"x" * 512, 503)
    assert data["text"] == "x" * 512


@pytest.mark.parametrize(
    ("content_type", "body", "status", "expected"),
    [
        ("text/plain", b"OK", 200, {"content_type": "text/plain", "text": "OK"}),
        (None, b"plain words", 200, {"content_type": None, "text": "plain words"}),
        # invalid JSON under a JSON type: text, never an exception
        ("application/json", b"{not", 200, {"content_type": "application/json", "text": "{not"}),
        ("application/json", b"<p/>", 500, {"content_type": "application/json", "text": "<p/>"}),
        # a JSON-looking body under a text type stays text: the type wins when given
        ("text/plain", b'{"a": 1}', 200, {"content_type": "text/plain", "text": '{"a": 1}'}),
    ],
)  # fmt: skip
def test_non_json_bodies_become_the_text_shape(
    content_type: str | None, body: bytes, status: int, expected: dict[str, Any]
) -> None:
    assert parse_body(content_type, body, status) == (expected, False)


def test_invalid_json_on_an_error_status_is_truncated_too() -> None:
    data, is_json = parse_body("application/json", b"{" + b"x" * 1000, 500)
    assert is_json is False
    assert data["text"] == "{" + "x" * 511


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("text/plain", b"caf\xe9 \xff\xfe"),
        ("application/json", b'{"a": "\xff"}'),
        (None, b"\x80\x81"),
        ("text/event-stream", b'data: {"a": "\xff"}\n\ndata: \xfe\n\n'),
    ],
)
def test_bytes_that_are_not_utf8_never_raise_and_are_never_decoded_lossily(
    content_type: str | None, body: bytes
) -> None:
    # These bytes used to come back with U+FFFD in them; now they are kept whole.
    data, is_json = parse_body(content_type, body, 200)
    assert is_json is False
    assert "\ufffd" not in json.dumps(data, ensure_ascii=False)
    assert base64.b64decode(data["base64"]) == body
    assert data["bytes"] == len(body)


# --- server-sent events -----------------------------------------------------------------------


def test_sse_with_crlf_line_endings_comments_and_event_names() -> None:
    body = (
        b": keep-alive comment\r\n\r\n"
        b'event: message\r\nid: 1\r\ndata: {"a": 1}\r\n\r\n'
        b"retry: 1000\r\ndata: plain text\r\n\r\n"
    )
    data, is_json = parse_body("text/event-stream; charset=utf-8", body, 200)
    assert is_json is False
    assert data == {
        "content_type": "text/event-stream",
        "events": [{"a": 1}, "plain text"],
        "content": "",
    }


def test_sse_with_bare_cr_line_endings() -> None:
    assert parse_sse(b"data: 1\r\rdata: 2\r\r")["events"] == [1, 2]


def test_sse_multi_line_data_is_joined_with_newlines() -> None:
    body = b'data: {"a":\ndata: [1,\ndata: 2]}\n\ndata: line one\ndata: line two\n\n'
    assert parse_sse(body)["events"] == [{"a": [1, 2]}, "line one\nline two"]


def test_sse_strips_one_space_after_the_colon_only() -> None:
    assert parse_sse(b"data:x\n\ndata:  two\n\n")["events"] == ["x", " two"]


def test_sse_done_marker_is_not_an_event() -> None:
    body = b'data: {"choices": [{"delta": {"content": "Hi"}}]}\n\ndata: [DONE]\n\n'
    assert parse_sse(body) == {
        "content_type": "text/event-stream",
        "events": [{"choices": [{"delta": {"content": "Hi"}}]}],
        "content": "Hi",
    }


def test_sse_last_event_without_a_blank_line_is_kept() -> None:
    # Lenient on purpose: a body cut after its last data line still yields its usage chunk.
    assert parse_sse(b"data: 1\n\ndata: 2\n")["events"] == [1, 2]


def test_sse_assembles_openai_and_anthropic_text() -> None:
    openai = b"".join(
        f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': piece}}]})}\n\n".encode()
        for piece in ["Hel", "lo", " ", "wörld"]
    )
    assert parse_sse(openai)["content"] == "Hello wörld"
    anthropic = b"".join(
        b"event: content_block_delta\ndata: "
        + json.dumps(
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": t}}
        ).encode()
        + b"\n\n"
        for t in ["Bon", "jour"]
    )
    assert parse_sse(anthropic)["content"] == "Bonjour"


def test_sse_ignores_deltas_that_carry_no_text() -> None:
    body = (
        b'data: {"choices": [{"delta": {"role": "assistant"}}]}\n\n'
        b'data: {"choices": [{"delta": {"content": null}}]}\n\n'
        b'data: {"choices": []}\n\n'
        b'data: {"type": "content_block_delta", "delta": {"type": "input_json_delta",'
        b' "partial_json": "{}"}}\n\n'
        b"data: [1, 2]\n\n"
    )
    parsed = parse_sse(body)
    assert parsed["content"] == ""
    assert len(parsed["events"]) == 5


def test_b21_a_300_kib_single_event_is_assembled_exactly() -> None:
    # cases.md B21: one data line far above aiohttp's 128 KiB line limit.
    content = "A" * 307200
    big = {"id": "c1", "choices": [{"index": 0, "delta": {"content": content}}]}
    usage = {"id": "c1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    body = f"data: {json.dumps(big)}\n\ndata: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode()
    assert len(body) > 300 * 1024
    data, _ = parse_body("text/event-stream", body, 200)
    assert len(data["content"]) == 307200
    assert data["content"] == content
    assert data["events"] == [big, usage]


@pytest.mark.parametrize(
    ("body", "is_json"),
    [
        (b'{"id":"chatcmpl-1","choices":[{"message":{"content":"hi"}}],"usage":{"n":3}}', True),
        (b'{"a":1,"a":2}', True),
        (b"[1e-400, -0.0, 1.0, 0.1, 123456789012345678]", True),
        (b"123456789012345678901234567890", True),  # more digits than orjson keeps exact
        (b"\xef\xbb\xbf{}", True),  # a BOM, as json reads bytes
        ('{"é":"名前"}'.encode("utf-16"), True),
        (b'"a\x7fb"', True),
        (b'{"n":1e400}', False),  # an infinity: not JSON the sidecar can write back
        (b'{"n":NaN}', False),
        (b'"\\ud800"', False),  # a lone surrogate escape
        (b'"\xed\xa0\x80"', True),  # a lone surrogate's bytes: json's value, as before
        (b"[" * 200 + b"]" * 200, True),  # at the depth bound
        (b"[" * 201 + b"]" * 201, False),  # deeper than the bound
        (b'{"a":[1,2,}', False),
    ],
)
def test_an_answer_is_parsed_as_the_json_module_parses_it(body: bytes, is_json: bool) -> None:
    # parse_body reads with orjson where that gives json's value, and json decides the
    # rest: the same values, and the same refusals (infinities, NaN, surrogates, depth).
    from gateway import fastjson

    data, parsed = parse_body("application/json", body, 200)
    assert parsed is is_json
    if is_json:
        assert data == json.loads(body)
        assert json.dumps(data) == json.dumps(json.loads(body))  # ints stay ints
    value = fastjson.orjson_value(body)
    if value is not fastjson.UNDECIDED:  # where orjson decided, it gave json's value
        assert json.dumps(value) == json.dumps(json.loads(body))
