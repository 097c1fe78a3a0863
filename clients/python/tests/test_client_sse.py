"""The SSE decoder follows the WHATWG rules, whatever cut of the bytes arrives."""

from __future__ import annotations

import random

import pytest

from egress_client.sse import ServerSentEvent, SSEDecoder


def decode(*chunks: bytes) -> list[ServerSentEvent]:
    decoder = SSEDecoder()
    events = [event for chunk in chunks for event in decoder.feed(chunk)]
    return events + decoder.close()


E = ServerSentEvent


@pytest.mark.parametrize(
    ("stream", "expected"),
    [
        (b"data: a\n\n", [E(data="a")]),
        (b"data:a\n\n", [E(data="a")]),  # the space after the colon is optional
        (b"data:  a\n\n", [E(data=" a")]),  # only one space is removed
        (b"data: a\ndata: b\n\n", [E(data="a\nb")]),
        (b"data\n\n", [E(data="")]),  # a field without a colon has an empty value
        (b"data:\ndata:\n\n", [E(data="\n")]),
        (b"event: ping\ndata: {}\n\n", [E(event="ping", data="{}")]),
        (b"data: a\r\n\r\ndata: b\r\rdata: c\n\n", [E(data="a"), E(data="b"), E(data="c")]),
        (b": keep-alive\n\n: another\ndata: x\n\n", [E(data="x")]),  # comments ignored
        (b"\xef\xbb\xbfdata: bom\n\n", [E(data="bom")]),  # one leading BOM dropped
        (b"event: only\n\n", []),  # no data line: not dispatched
        (b"data: done\n\ndata: cut", [E(data="done")]),  # an unterminated event is dropped
        (b"id: 7\ndata: a\n\ndata: b\n\n", [E(data="a", id="7"), E(data="b", id="7")]),
        (b"id: 1\ndata: a\n\nid\ndata: b\n\n", [E(data="a", id="1"), E(data="b", id="")]),
        (b"id: 1\ndata: a\n\nid: x\x00y\ndata: b\n\n", [E(data="a", id="1"), E(data="b", id="1")]),
        (b"retry: 1500\ndata: a\n\nretry: 1x\ndata: b\n\n", [E(data="a", retry=1500), E(data="b")]),
        (b"foo: bar\ndata: a\n\n", [E(data="a")]),  # unknown fields ignored
        (b"data: caf\xc3\xa9 \xff\n\n", [E(data="caf\u00e9 \ufffd")]),  # UTF-8, bad bytes replaced
    ],
)
def test_whatwg_rules(stream: bytes, expected: list[ServerSentEvent]) -> None:
    assert decode(stream) == expected


STREAM = (
    b'\xef\xbb\xbf: hello\r\n\r\nevent: delta\r\nid: 1\r\ndata: {"t": "h\xc3\xa9"}\r\n\r\n'
    b"data: line one\rdata: line two\r\rretry: 10\ndata: [DONE]\n\n"
    b'event: egress.response\ndata: {"success": true}\n\n'
)


def test_every_cut_of_the_bytes_gives_the_same_events() -> None:
    whole = decode(STREAM)
    assert [e.event for e in whole] == ["delta", "message", "message", "egress.response"]
    assert whole[0].json() == {"t": "h\u00e9"}
    assert whole[1].data == "line one\nline two"
    for cut in range(1, len(STREAM)):
        assert decode(STREAM[:cut], STREAM[cut:]) == whole, cut
    rng = random.Random(16)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(STREAM)), rng.randint(2, 12)))
        chunks = [STREAM[a:b] for a, b in zip([0, *cuts], [*cuts, len(STREAM)], strict=True)]
        assert decode(*chunks) == whole


def test_a_cr_at_a_chunk_end_waits_for_a_possible_lf() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\r") == []
    assert decoder.feed(b"\n") == []  # CRLF is one line end, not two
    assert decoder.feed(b"\r\n") == [E(data="a")]
    assert decoder.feed(b"data: b\n\r") == []
    assert decoder.close() == [E(data="b")]  # the final CR ended the blank line


def test_one_event_is_bounded() -> None:
    decoder = SSEDecoder(max_event_chars=100)
    decoder.feed(b"data: " + b"x" * 60 + b"\n")
    with pytest.raises(ValueError, match="over 100 characters"):
        decoder.feed(b"data: " + b"x" * 60 + b"\n")
    with pytest.raises(ValueError, match="over 100 characters"):
        SSEDecoder(max_event_chars=100).feed(b"data: " + b"x" * 200)  # no line end at all
    # The events complete before the one too large are handed over first.
    decoder = SSEDecoder(max_event_chars=100)
    assert decoder.feed(b"data: a\n\ndata: " + b"x" * 200 + b"\n") == [E(data="a")]
    with pytest.raises(ValueError, match="over 100 characters"):
        decoder.close()
    # Many small events are not one big one.
    many = SSEDecoder(max_event_chars=100)
    assert len(many.feed(b"data: 0123456789\n\n" * 100)) == 100


def test_one_long_line_fed_in_pieces_is_one_event_and_still_bounded() -> None:
    # A growing line is kept in pieces and scanned once it ends (re-joining it at
    # every chunk made one 16 MiB event cost over a second of the agent's CPU).
    decoder = SSEDecoder(max_event_chars=1_000_000)
    line = b"data: " + b"B" * 100_000
    for at in range(0, len(line), 100):
        assert decoder.feed(line[at : at + 100]) == []
    assert decoder.feed(b"\r") == []  # maybe the first half of CRLF
    assert decoder.feed(b"x") == []  # it was not: a line end, then a new line
    [event] = decoder.feed(b"\n\n")
    assert event.data == "B" * 100_000
    bounded = SSEDecoder(max_event_chars=1000)
    assert bounded.feed(b"data: " + b"C" * 600) == []
    with pytest.raises(ValueError, match="over 1000 characters"):
        bounded.feed(b"C" * 600)
