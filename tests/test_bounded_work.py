"""Bounded work per request.

No envelope may hold the event loop for long: what the sidecar reports about an invalid
envelope is capped (unknown fields, header errors, metadata, lone surrogates) and a large
body is parsed once. The work a real sidecar does for the worst envelopes built at the
policy's ``server.max_request_bytes`` is counted (Python and C function calls in the
loop's thread, whatever the machine's speed): it stays under a budget and grows at most
linearly with the envelope's size. Finding the end of an event in a relayed stream
searches each byte about once. The loop's stalls are timed in ``bench/loop_stall.py``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gateway.call.intake import (
    LARGE_BODY_BYTES,
    MAX_REPORTED_UNKNOWN_FIELDS,
    decode_json,
    parse_envelope_fast,
    parse_request,
    refuse_lone_surrogates,
)
from gateway.call.sse import EventTooLarge, SseDecoder, complete_events
from gateway.envelope import MAX_METADATA_BYTES, ExternalCallRequest, ExternalCallResponse
from gateway.errors import InvalidPayload
from tests.conftest import calls_made, compile_policy, envelope, openai_target

MiB = 1024 * 1024
#: The policy limit of the counted calls (the work grows with the size; the linearity
#: check holds it to any size).
LIMIT = 1 * MiB
#: The most function calls (Python and C, as :func:`sys.setprofile` sees them) that one
#: envelope of LIMIT bytes may cost the loop's thread, from the request's first byte to
#: its answer and audit record: the worst shape today (about 87,000 header values of the
#: wrong type) costs about 82,000, one per item; a plain envelope about 1,600.
MAX_CALLS = 150_000
#: Calls that vary from run to run whatever the envelope: the body arrives in as many
#: reads as the socket gives, and timers of the loop may fire during the call.
CALL_SLACK = 10_000
_FILL = "__FILL__"


def filled(
    item: Callable[[int], str],
    *,
    open_: str,
    close: str,
    size: int = LIMIT,
    template: str | None = None,
    **over: Any,
) -> bytes:
    """An envelope of about ``size`` bytes: ``template`` (default: the test envelope with
    ``over``) whose ``"__FILL__"`` is replaced by ``open_`` + as many ``item(i)`` (all of
    one length) as fit + ``close``."""
    text = template if template is not None else json.dumps(envelope(**over))
    before, after = text.split(json.dumps(_FILL), 1)
    room = size - len(before) - len(after) - len(open_) - len(close) - 16
    count = room // (len(item(0)) + 1)
    body = before + open_ + ",".join(item(i) for i in range(count)) + close + after
    return body.encode()


def _key(prefix: str) -> Callable[[int], str]:
    return lambda i: f'"{prefix}{i:07d}":1'


# -- what is reported stays small --------------------------------------------------------


def test_only_the_first_unknown_fields_are_named_and_suggested() -> None:
    raw = {f"x{i}": 1 for i in range(50_000)} | {"max_retires": 1}
    with pytest.raises(InvalidPayload) as caught:
        parse_request(raw)
    details = caught.value.details
    assert details["unknown_fields"] == [f"x{i}" for i in range(MAX_REPORTED_UNKNOWN_FIELDS)]
    assert details["unknown_field_count"] == 50_001
    assert details["suggestions"] == {}  # only the named ones are compared
    assert caught.value.message.endswith(
        f", and {50_001 - MAX_REPORTED_UNKNOWN_FIELDS} more; put free-form additions in 'metadata'"
    )
    assert len(caught.value.message) < 2000


def test_few_unknown_fields_are_reported_as_before() -> None:
    with pytest.raises(InvalidPayload) as caught:
        parse_request(envelope(max_retires=0))
    assert "unknown_field_count" not in caught.value.details
    assert caught.value.details["suggestions"] == {"max_retires": "max_retries"}


def test_an_unknown_field_name_is_echoed_cut() -> None:
    with pytest.raises(InvalidPayload) as caught:
        parse_request(envelope(**{"k" * 100_000: 1}))
    [name] = caught.value.details["unknown_fields"]
    assert name == "k" * 64
    assert len(caught.value.message) < 300


def test_warn_mode_keeps_the_first_unknown_fields_and_their_count() -> None:
    intake = parse_request(envelope(**{f"x{i}": 1 for i in range(1000)}), unknown_fields="warn")
    assert intake.unknown_fields == tuple(f"x{i}" for i in range(MAX_REPORTED_UNKNOWN_FIELDS))
    assert intake.unknown_field_count == 1000


def test_many_wrong_header_values_give_twenty_errors() -> None:
    with pytest.raises(InvalidPayload) as caught:
        parse_request(envelope(headers={f"h{i}": i for i in range(100_000)}))
    errors = caught.value.details["errors"]
    assert [e["field"] for e in errors] == [f"headers.h{i}" for i in range(20)]
    assert {e["problem"] for e in errors} == {"Input should be a valid string"}


def test_other_field_errors_come_first_as_pydantic_orders_them() -> None:
    with pytest.raises(InvalidPayload) as caught:
        parse_request(envelope(trace_id=5, headers={"a": 1, "b": "ok"}))
    assert [e["field"] for e in caught.value.details["errors"]] == ["trace_id", "headers.a"]


def test_huge_metadata_is_refused_without_walking_it() -> None:
    with pytest.raises(InvalidPayload) as caught:
        parse_request(envelope(metadata={"a": [1] * 2_000_000}))
    [error] = caught.value.details["errors"]
    assert error == {
        "field": "metadata",
        "problem": f"metadata is more than {MAX_METADATA_BYTES} bytes of JSON; at most "
        f"{MAX_METADATA_BYTES} are kept in the audit record (put payloads in parameters)",
    }


def test_metadata_just_under_the_item_bound_is_measured_exactly() -> None:
    with pytest.raises(InvalidPayload) as caught:
        parse_request(envelope(metadata={"a": "x" * MAX_METADATA_BYTES}))
    assert "metadata is 16392 bytes of JSON" in caught.value.details["errors"][0]["problem"]


@pytest.mark.parametrize("where", [0, -1])
def test_a_lone_surrogate_in_a_huge_list_names_the_list(where: int) -> None:
    items = ["1"] * 200_000
    items[where] = '"\\udc00"'
    body = json.dumps(envelope(parameters={"a": _FILL})).replace(
        json.dumps(_FILL), "[" + ",".join(items) + "]"
    )
    raw = body.encode()
    with pytest.raises(InvalidPayload) as caught:
        refuse_lone_surrogates(raw, decode_json(raw, check_surrogates=False))
    assert caught.value.details == {"reason": "lone_surrogate", "field": "parameters.a"}


def test_a_lone_surrogate_among_many_top_level_keys_names_the_envelope() -> None:
    value = {f"x{i}": 1 for i in range(1000)} | {"z": "\udc00"}
    with pytest.raises(InvalidPayload) as caught:
        refuse_lone_surrogates(b"\\udc00", value)
    assert caught.value.details["field"] == "(envelope)"


def test_surrogate_pairs_are_not_refused() -> None:
    refuse_lone_surrogates(b"\\ud83d\\ude00", {"a": ["\U0001f600"] * 1000})


# -- a large body is parsed once, to the same request ------------------------------------


def test_a_large_envelope_takes_one_parse_to_the_same_request() -> None:
    body = filled(_key("k"), open_="{", close="}", size=LARGE_BODY_BYTES * 2, parameters=_FILL)
    assert parse_envelope_fast(body) is None  # not the one-pass path: see below
    request = parse_request(decode_json(body)).request
    assert request == ExternalCallRequest.model_validate_json(body)
    assert len(request.parameters) > 10_000


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"a": NaN, "b": "' + b"x" * LARGE_BODY_BYTES + b'"}', "not_finite"),
        (b'{"a": 1e999, "b": "' + b"x" * LARGE_BODY_BYTES + b'"}', "not_finite"),
        (b'{"b": "' + b"x" * LARGE_BODY_BYTES + b'"', "not_json"),
        (b'{"b": "' + b"\xff" * LARGE_BODY_BYTES + b'"}', "not_utf8"),
    ],
    ids=["nan", "overflow", "truncated", "not-utf8"],
)
def test_a_large_body_gets_the_exact_errors(body: bytes, reason: str) -> None:
    with pytest.raises(InvalidPayload) as caught:
        decode_json(body)
    assert caught.value.details["reason"] == reason


def test_a_large_body_nested_past_the_fast_parsers_limit_still_parses() -> None:
    deep = "[" * 500 + "]" * 500
    body = ('{"a": ' + deep + ', "b": "' + "x" * LARGE_BODY_BYTES + '"}').encode()
    assert decode_json(body)["b"] == "x" * LARGE_BODY_BYTES
    assert decode_json(b"\xef\xbb\xbf" + body)["b"]  # a BOM, too


# -- the event loop keeps running --------------------------------------------------------


@functools.cache
def _worst(size: int = LIMIT) -> dict[str, tuple[bytes, int, str | None]]:
    """Envelopes of ``size`` bytes that make the sidecar work per item, with the answer's
    expected (HTTP status, error code); built once per size (they are read only)."""
    keys, ones = _key("x"), (lambda i: "1")
    top_level = json.dumps(envelope())[:-1] + ", " + json.dumps(_FILL) + "}"
    surrogate = filled(ones, open_="[", close=',"\\udc00"]', size=size, parameters={"a": _FILL})
    return {
        "unknown-fields": (
            filled(keys, open_="{", close="}", template=json.dumps(_FILL), size=size),
            400,
            "INVALID_PAYLOAD",
        ),
        "unknown-fields-warn": (
            filled(keys, open_="", close="", template=top_level, size=size),
            200,
            None,
        ),
        "wrong-header-values": (
            filled(keys, open_="{", close="}", size=size, headers=_FILL),
            400,
            "INVALID_PAYLOAD",
        ),
        "many-headers": (
            filled(lambda i: f'"h{i:07d}":"v"', open_="{", close="}", size=size, headers=_FILL),
            403,
            "PERMISSION_DENIED",
        ),
        "huge-metadata": (
            filled(ones, open_="[", close="]", size=size, metadata={"a": _FILL}),
            400,
            "INVALID_PAYLOAD",
        ),
        "metadata-keys": (
            filled(keys, open_="{", close="}", size=size, metadata=_FILL),
            400,
            "INVALID_PAYLOAD",
        ),
        "lone-surrogate-last": (surrogate, 400, "INVALID_PAYLOAD"),
        "wrong-type-list": (
            filled(ones, open_="[", close="]", size=size, max_retries=_FILL),
            400,
            "INVALID_PAYLOAD",
        ),
        "parameters-keys": (
            filled(keys, open_="{", close="}", size=size, parameters=_FILL),
            200,
            None,
        ),
        "parameters-ints": (
            filled(ones, open_="[", close="]", size=size, parameters={"a": _FILL}),
            200,
            None,
        ),
        "parameters-escapes": (
            filled(lambda i: '"\\u00e9"', open_="[", close="]", size=size, parameters={"a": _FILL}),
            200,
            None,
        ),
    }


WORST = (
    "unknown-fields",
    "unknown-fields-warn",
    "wrong-header-values",
    "many-headers",
    "huge-metadata",
    "metadata-keys",
    "lone-surrogate-last",
    "wrong-type-list",
    "parameters-keys",
    "parameters-ints",
    "parameters-escapes",
)


def test_the_worst_cases_are_all_measured() -> None:
    assert sorted(WORST) == sorted(_worst())


async def _counted(call: Awaitable[tuple[int, Any]]) -> tuple[int, Any, int]:
    with calls_made() as calls:
        status, answer = await call
    return status, answer, len(calls)


@pytest.mark.parametrize("case", WORST)
async def test_the_work_of_one_envelope_is_bounded_and_linear_in_its_size(
    case: str, upstream_factory: Any, sidecar_factory: Any
) -> None:
    body, status, code = _worst()[case]
    half, _, _ = _worst(LIMIT // 2)[case]  # past LARGE_BODY_BYTES too: the same path
    assert LIMIT - 4096 < len(body) <= LIMIT
    up = await upstream_factory()
    policy = compile_policy(
        {"fake-openai": openai_target(up.url)},
        server={"max_request_bytes": LIMIT},
        envelope={"unknown_fields": "warn" if case.endswith("-warn") else "reject"},
    )
    sc = await sidecar_factory(policy)
    await sc.call(envelope())  # warm: first-call imports and connections

    *_, work_half = await _counted(sc.call(half))
    got_status, answer, work = await _counted(sc.call(body))
    response = ExternalCallResponse.model_validate(answer)
    assert got_status == status, answer
    assert (response.error.code if response.error else None) == code
    assert len(sc.audit_records()) == 3
    assert work < MAX_CALLS, f"{case}: {work} calls for one envelope of {len(body)} bytes"
    # Twice the bytes may cost twice the work, not four times (quadratic).
    assert work <= 2 * work_half + CALL_SLACK, f"{case}: {work_half} -> {work} calls"


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"a": "\udc00"}, "a"),
        ({"a": {"b": "ok", "c": "\udc00"}}, "a.c"),
        ({"a": ["ok", "\udc00", "ok"]}, "a.1"),
        ({"a": {"b": {"c": "\udc00"}}}, "a.b"),  # two levels are named, no more
        ({"k\udc00": 1}, "k\\udc00"),
        ({"a": {"k\udc00": 1}}, "a.k\\udc00"),
    ],
)
def test_a_lone_surrogate_is_named_down_to_two_levels(value: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidPayload) as caught:
        refuse_lone_surrogates(b"\\udc00", value)
    assert caught.value.details == {"reason": "lone_surrogate", "field": field}


class _Counted(bytearray):
    """A buffer that counts the bytes each ``rfind`` may look at."""

    looked = 0

    def rfind(self, sub: Any, start: Any = None, end: Any = None) -> int:  # type: ignore[override]
        _Counted.looked += len(self) - (start or 0)
        return super().rfind(sub, start, end)


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
def test_finding_whole_events_searches_each_byte_about_once(newline: bytes) -> None:
    big = b"data: " + b"A" * 200_000 + newline + newline
    stream = big + b"data: x" + newline + newline + big
    chunk = 1000
    held, cuts, sent = _Counted(), [], 0
    _Counted.looked = 0
    for at in range(0, len(stream), chunk):
        searched = len(held)
        held += stream[at : at + chunk]
        cut = complete_events(held, searched)
        assert cut == complete_events(bytes(held))  # the same answer as a full search
        if cut:
            cuts.append(sent + cut)
            sent += cut
            held = _Counted(held[cut:])
    assert cuts == [len(big) + len(newline) * 2 + 7, len(stream)]
    # 5 end marks, each searching the new bytes plus a few before: linear, not quadratic.
    assert _Counted.looked < 5 * (len(stream) + 4 * len(stream) // chunk)


def test_decoding_one_long_line_joins_it_once() -> None:
    decoder = SseDecoder(10_000_000)
    line = b"data: " + b"B" * 100_000
    for at in range(0, len(line), 100):
        assert decoder.feed(line[at : at + 100]) == []
    [event] = decoder.feed(b"\n\n")
    assert event.data == "B" * 100_000
    bounded = SseDecoder(1000)
    assert bounded.feed(b"data: " + b"C" * 600) == []
    with pytest.raises(EventTooLarge):  # a line growing in pieces is still bounded
        bounded.feed(b"C" * 600)
