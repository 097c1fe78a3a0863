"""The drop-in route's one-pass intake: for every body, the fast path
(:func:`gateway.call.intake.parse_object_fast`, then :func:`gateway.call.intake.
parse_built`) gives what the exact path (:func:`gateway.call.intake.decode_json`, then
:func:`gateway.call.intake.parse_request`) gives: the same ``parameters`` (types, key
order, a repeated key's last value, float bits), the same request, idempotency
fingerprint and outbound body, or the same error (class, message, details, status)."""

from __future__ import annotations

import base64
import json
import math
import struct
import uuid
from typing import Any

import pytest

from gateway import fastjson, redaction
from gateway.api.writer import scrubbed
from gateway.call.intake import (
    LARGE_BODY_BYTES,
    Intake,
    decode_json,
    parse_built,
    parse_object_fast,
    parse_request,
    printable,
)
from gateway.call.proxy import (
    ProxyRequest,
    _claim,
    _timeout,
    _uuid4_hex_pair,
    proxy_intake,
)
from gateway.call.proxy import (
    request_ids as _ids,
)
from gateway.call.record import CLAIM_LIMIT, CallContext
from gateway.errors import GatewayError, InvalidPayload
from gateway.idempotency.keys import fingerprint
from tests.conftest import compile_policy, openai_target

POLICY = compile_policy({"openai": openai_target("http://127.0.0.1:9")})
CHAT = {
    "model": "gpt-4o-mini",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 64,
    "temperature": 0,
}

#: Bodies both parsers read, to the same value; the fast path must take each of them.
VALID: dict[str, bytes] = {
    "chat": json.dumps(CHAT).encode(),
    "compact chat": json.dumps(CHAT, separators=(",", ":")).encode(),
    "empty object": b"{}",
    "whitespace around and inside": b' \t\r\n{ "a" : 1 ,\n"b"\t:[ ] }\r\n ',
    "repeated key: last value, first place": b'{"a": 1, "b": 2, "a": 3}',
    "repeated key of another type": b'{"a": {"x": 1}, "z": 0, "a": [1, {"a": 2, "a": 3}]}',
    "non-ASCII and a surrogate pair": '{"é": "€ 😀", "p": "\\ud83d\\ude00"}'.encode(),
    "escapes": b'{"a": "\\u0000\\u001f\\"\\\\\\/\\b\\f\\n\\r\\t", "\\u00e9": "\\u20ac"}',
    "DEL and C1 controls in a string": '{"a": "\x7f\u0085"}'.encode(),
    "integers past 64 bits": b'{"a": 12345678901234567890123, "b": -9223372036854775809}',
    "floats": b'{"a": 0.1, "b": -0.0, "c": 5e-99, "d": 1.7976931348623157e+99, "e": 1E5}',
    "exponents of two digits": b'{"a": 2.5e-99, "b": 1e+99, "c": 123.456e10}',
    "minus zero integer": b'{"a": -0, "b": 0}',
    "literals": b'{"t": true, "f": false, "n": null}',
    "stream": b'{"model": "m", "stream": true}',
    "nested 100 deep": b'{"a": ' + b"[" * 100 + b"]" * 100 + b"}",
    # Three-digit exponents and words the text test flags, read to no NaN or infinity:
    # the parsed value says so (fastjson.surely_finite), and the text is not scanned.
    "1e-400, underflowing to 0.0 in both": b'{"a": 1e-400, "b": -1e-400}',
    "the largest and the smallest floats": b'{"a": 1.7976931348623157e308, "b": 5e-324}',
    "a string that names NaN and Infinity": b'{"a": "no NaN here, nor Infinity"}',
}
#: Bodies the fast path leaves to the exact path, with what that path says of them
#: (``None``: a JSON object after all, read by the stdlib's parser).
EXACT: dict[str, tuple[bytes, str | None]] = {
    "not UTF-8": (b'{"a": "\xff"}', "not_utf8"),
    "UTF-8 of a surrogate": (b'{"a": "\xed\xa0\x80"}', "not_utf8"),
    "UTF-16": ('{"a": 1}'.encode("utf-16"), "not_utf8"),
    "not JSON": (b"{nope", "not_json"),
    "trailing data": (b'{"a": 1}{}', "not_json"),
    "trailing fields": (b'{"a": 1}, "timeout": 5, "method": "GET"', "not_json"),
    "trailing comma": (b'{"a": [1,],}', "not_json"),
    "single quotes": (b"{'a': 1}", "not_json"),
    "a raw control character in a string": (b'{"a": "x\x01y"}', "not_json"),
    "form feed as whitespace": (b'\x0c{"a": 1}', "not_json"),
    "NaN": (b'{"a": NaN}', "not_finite"),
    "Infinity": (b'{"a": -Infinity}', "not_finite"),
    "1e400": (b'{"a": 1e400}', "not_finite"),
    "310 digits": (b'{"a": 1' + b"0" * 309 + b".5}", "not_finite"),
    "5000 digits": (b'{"a": 1' + b"0" * 5000 + b"}", "not_json"),
    "lone surrogate": (b'{"a": "\\ud800"}', "lone_surrogate"),
    "lone surrogate in a key": (b'{"\\udc00": 1}', "lone_surrogate"),
    "BOM": (b'\xef\xbb\xbf{"a": 1}', None),
    "JSON array": (b"[1, 2]", None),
    "JSON string": (b'"text"', None),
    "JSON number": (b"5", None),
    "JSON null": (b"null", None),
    "nested 300 deep": (b'{"a": ' + b"[" * 300 + b"]" * 300 + b"}", None),
    "nested 100,000 deep": (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "too_deep"),
    "huge": (b'{"a": "' + b"x" * (LARGE_BODY_BYTES + 1) + b'"}', None),
    "huge with NaN": (b'{"a": NaN, "b": "' + b"x" * LARGE_BODY_BYTES + b'"}', "not_finite"),
}


def same(a: Any, b: Any) -> bool:
    """Equal, of the same types all the way down, keys in the same order, floats
    bit for bit (``-0.0`` is not ``0.0``, ``1`` is not ``1.0`` nor ``True``)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    return bool(a == b)


def exact_value(body: bytes) -> tuple[str, Any]:
    """What the exact path reads: ``("value", the value)`` or ``("refused", reason)``."""
    try:
        return "value", decode_json(body)
    except InvalidPayload as exc:
        return "refused", exc.details["reason"]


@pytest.mark.parametrize("name", VALID)
def test_the_fast_path_reads_each_valid_body_as_the_stdlib_does(name: str) -> None:
    body = VALID[name]
    fast = parse_object_fast(body)
    assert fast is not None, "the fast path must take this body"
    assert same(fast, decode_json(body))


@pytest.mark.parametrize("name", EXACT)
def test_the_fast_path_leaves_each_other_body_to_the_exact_path(name: str) -> None:
    body, reason = EXACT[name]
    assert parse_object_fast(body) is None
    kind, value = exact_value(body)
    assert (kind, value) == ("refused", reason) if reason else kind == "value"


def test_floats_are_read_to_the_same_bits() -> None:
    # Shortest and long spellings, integers as floats, two-digit exponents.
    # (Three-digit exponents take the exact path: the bodies above.)
    numbers = [
        "0.30000000000000004",
        "9007199254740993",
        "9007199254740993.0",
        "0.1000000000000000055511151231257827",
        "123456789012345678901234567890.123456789",
        "1e-99",
        "-1.5E+99",
    ]
    step = 1.0
    for _ in range(150):  # a spread of magnitudes (to 1e85), as repr, %.17g and %.12e
        step *= -3.7
        numbers += [repr(step), f"{1 / step:.17g}", f"{math.pi * step:.12e}"]
    body = ("{" + ",".join(f'"n{i}": {n}' for i, n in enumerate(numbers)) + "}").encode()
    fast = parse_object_fast(body)
    assert fast is not None
    assert same(fast, decode_json(body))


# -- the whole intake: the built envelope ------------------------------------------------

IDS = {"x-egress-trace-id": "trace-1", "x-egress-correlation-id": "corr-1"}


def _http(body: bytes, headers: dict[str, str] | None = None, **kw: Any) -> ProxyRequest:
    given = {"Content-Type": "application/json", **IDS, **(headers or {})}
    return ProxyRequest(
        method=kw.get("method", "POST"),
        target=kw.get("target", "openai"),
        path=kw.get("path", "/v1/chat/completions"),
        query=kw.get("query", ()),
        headers=tuple(given.items()),
        body=body,
    )


def _outcome(run: Any) -> tuple[str, Any]:
    try:
        return "ok", run()
    except GatewayError as exc:
        return "error", (type(exc), exc.message, exc.details, exc.http_status)


def _exact_raw(body: bytes, content_type: str = "application/json") -> dict[str, Any]:
    """The envelope the module docstring of :mod:`gateway.call.proxy` describes for a POST
    of ``body`` with the ids of :data:`IDS`, its body read by the exact path alone."""
    _, value = exact_value(body)
    raw: dict[str, Any] = {
        "trace_id": "trace-1",
        "correlation_id": "corr-1",
        "target_system": "openai",
        "endpoint": "/v1/chat/completions",
        "method": "POST",
        "headers": {},
        "query": {},
    }
    if isinstance(value, dict):
        raw["parameters"] = value
    else:
        raw["body"] = {"content_type": content_type, "base64": base64.b64encode(body).decode()}
    streamed = isinstance(value, dict) and value.get("stream") is True
    raw["timeout"] = 600.0 if streamed else 30.0  # no timeout header: a stream's bound
    return raw


def _same_intake(got: Intake, want: Intake) -> None:
    assert got == want
    a, b = got.request, want.request
    assert same(a.parameters, b.parameters)
    assert a.model_fields_set == b.model_fields_set
    assert same(vars(a), vars(b))
    assert fastjson.compact(a.parameters) == fastjson.compact(b.parameters)  # outbound body
    body = a.body.model_dump() if a.body is not None else None
    want_body = b.body.model_dump() if b.body is not None else None
    assert fingerprint(
        a.target_system, a.method, a.endpoint, a.parameters, query=a.query, body=body
    ) == fingerprint(
        b.target_system, b.method, b.endpoint, b.parameters, query=b.query, body=want_body
    )


@pytest.mark.parametrize("name", [*VALID, *EXACT])
def test_proxy_intake_gives_the_exact_paths_request_for_every_body(name: str) -> None:
    body = VALID[name] if name in VALID else EXACT[name][0]
    ctx = CallContext(started=0.0, agent_id="a")
    got = ctx.arrived(proxy_intake(_http(body), POLICY))
    _same_intake(got, parse_request(_exact_raw(body)))


def test_a_streamed_body_read_by_either_path_gets_the_streams_deadline() -> None:
    sdk = {"x-stainless-timeout": "20"}
    for body in (b'{"stream": true}', b'\xef\xbb\xbf{"stream": true}'):  # fast; exact (BOM)
        ctx = CallContext(started=0.0, agent_id="a")
        assert ctx.arrived(proxy_intake(_http(body, sdk), POLICY)).request.timeout == 600.0
    ctx = CallContext(started=0.0, agent_id="a")
    assert (
        ctx.arrived(proxy_intake(_http(b'{"stream": false}', sdk), POLICY)).request.timeout == 20.0
    )


def _envelope(**fields: Any) -> dict[str, Any]:
    raw = dict(_exact_raw(VALID["chat"]))
    raw.update(fields)
    return {k: v for k, v in raw.items() if v is not _DROP}


_DROP = object()


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"a": value}
    return value


#: Built envelopes, valid and not: :func:`parse_built` must give what
#: :func:`parse_request` gives for each.
BUILT: dict[str, dict[str, Any]] = {
    "valid": _envelope(),
    "with every optional field": _envelope(
        api_key_ref="file://k",
        idempotency_key="idem-1",
        max_retries=0,
        headers={"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"},
        query={"alt": "sse", "v": ["1", "2"]},
    ),
    "a body, not parameters": _envelope(
        parameters=_DROP, body={"content_type": "audio/wav", "base64": "UklGRg=="}
    ),
    "a body and parameters": _envelope(body={"content_type": "a/b", "base64": "AA=="}),
    "a body that is not base64": _envelope(
        parameters=_DROP, body={"content_type": "a/b", "base64": "not base64!"}
    ),
    "a body on a GET": _envelope(
        method="GET", parameters=_DROP, body={"content_type": "a/b", "base64": "AA=="}
    ),
    "a control character in an id": _envelope(trace_id="a\nb"),
    "an empty id": _envelope(correlation_id=""),
    "an id too long": _envelope(trace_id="t" * 257),
    "an endpoint too long": _envelope(endpoint="/" + "e" * 2048),
    "a timeout of zero": _envelope(timeout=0.0),
    "a timeout past the bound": _envelope(timeout=601.0),
    "a timeout that is not a number": _envelope(timeout="5"),
    "a method not spoken": _envelope(method="TRACE"),
    "an idempotency key with a control character": _envelope(idempotency_key="k\r\n"),
    "a header value not a string": _envelope(headers={"a": "1", "b": 2}),
    "a query value not a string": _envelope(query={"a": {"b": 1}}),
    "another protocol_version": _envelope(protocol_version="2"),
    "an unknown field": _envelope(max_retires=1),
    "parameters with a non-string key": _envelope(parameters={1: "x"}),
    "parameters not an object": _envelope(parameters=[1]),
    "parameters of many keys": _envelope(parameters={f"k{i}": i for i in range(5000)}),
    "metadata": _envelope(metadata={"run": "r-1", "tags": ["a"]}),
    "metadata too deep": _envelope(metadata=_nested(20)),
}


@pytest.mark.parametrize("name", BUILT)
def test_a_built_envelope_is_validated_as_parse_request_validates_it(name: str) -> None:
    raw = BUILT[name]
    got, want = _outcome(lambda: parse_built(raw)), _outcome(lambda: parse_request(raw))
    assert got[0] == want[0]
    if got[0] == "ok":
        _same_intake(got[1], want[1])
    else:
        assert got[1] == want[1]


@pytest.mark.parametrize(
    "name",
    [
        n
        for n in BUILT
        if isinstance(BUILT[n].get("parameters"), dict) and n != "parameters with a non-string key"
    ],
)
def test_parameters_handed_apart_are_set_as_parsed_and_validated_as_parse_request_does(
    name: str,
) -> None:
    raw = dict(BUILT[name])
    parameters = raw.pop("parameters")
    got = _outcome(lambda: parse_built(raw, parameters))
    want = _outcome(lambda: parse_request(BUILT[name]))
    assert got[0] == want[0]
    if got[0] == "error":
        assert got[1] == want[1]
        return
    _same_intake(got[1], want[1])
    assert got[1].request.parameters is parameters  # the parsed object, not a copy


@pytest.mark.parametrize(
    ("headers", "kw", "reason"),
    [
        ({"x-egress-timeout": "soon"}, {}, "invalid_header"),
        ({"x-egress-timeout": "0"}, {}, "invalid_fields"),
        ({"x-egress-secret-ref": "a\x01b"}, {}, "invalid_fields"),
        ({"Idempotency-Key": "k" * 256}, {}, "invalid_fields"),
        ({}, {"path": "/" + "p" * 2048}, "invalid_fields"),
        ({}, {"method": "TRACE"}, "method"),
        ({}, {"method": "GET"}, "body_not_allowed"),
    ],
)
def test_a_refused_drop_in_call_keeps_its_reason_and_message(
    headers: dict[str, str], kw: dict[str, Any], reason: str
) -> None:
    ctx = CallContext(started=0.0, agent_id="a")
    with pytest.raises(InvalidPayload) as caught:
        ctx.arrived(proxy_intake(_http(VALID["chat"], headers, **kw), POLICY))
    assert caught.value.details["reason"] == reason
    if reason == "invalid_fields":  # the exact path's own message for the built envelope
        raw = _exact_raw(VALID["chat"])
        raw["timeout"] = float(headers.get("x-egress-timeout", 30.0))
        raw["endpoint"] = kw.get("path", raw["endpoint"])
        for header, field in (
            ("x-egress-secret-ref", "api_key_ref"),
            ("Idempotency-Key", "idempotency_key"),
        ):
            if header in headers:
                raw[field] = headers[header]
        with pytest.raises(InvalidPayload) as exact:
            parse_request(raw)
        assert (caught.value.message, caught.value.details) == (
            exact.value.message,
            exact.value.details,
        )
        assert caught.value.http_status == exact.value.http_status == 400


# -- the header pass -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        *(chr(c) for c in range(128)),  # every ASCII character, controls included
        "/v1/chat/completions",
        "POST",
        "a b~",
        "tab\there",
        "é",
        "\x85",  # a C1 control
        "\u2028",
        "\ud800",  # a lone surrogate (from a percent-decoded target name, say)
        "ok\udcff",
        "",
    ],
)
def test_a_claim_is_escaped_as_printable_escapes_it(text: str) -> None:
    assert _claim(text) == printable(text)


def test_generated_ids_are_distinct_random_uuid4s() -> None:
    seen: set[str] = set()
    for _ in range(500):
        pair = _uuid4_hex_pair()
        for text in pair:
            parsed = uuid.UUID(hex=text)
            assert (parsed.version, parsed.variant, parsed.hex) == (4, uuid.RFC_4122, text)
        seen.update(pair)
    assert len(seen) == 1000
    # Every bit but the six fixed ones varies (all 32 hex digits but the version's).
    assert all(len({text[i] for text in seen}) > 1 for i in range(32) if i != 12)


@pytest.mark.parametrize(
    ("headers", "want"),
    [
        ({}, (None, None)),
        (
            {"x-egress-trace-id": " run-1 ", "x-egress-correlation-id": "step-2"},
            ("run-1", "step-2"),
        ),
        ({"x-egress-trace-id": "run-1"}, ("run-1", None)),
        ({"x-egress-correlation-id": "step-2"}, (None, "step-2")),
        (
            {"traceparent": "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01"},
            ("4bf92f3577b34da6a3ce929d0e0e4736", None),
        ),
        ({"traceparent": "00-" + "0" * 32 + "-00f067aa0ba902b7-01"}, (None, None)),
        ({"traceparent": "00-xyz-00f067aa0ba902b7-01"}, (None, None)),
        (
            {"x-egress-trace-id": "a\nb\x1b", "x-egress-correlation-id": "é\ud800"},
            ("a\\x0ab\\x1b", "é\\ud800"),
        ),
        ({"x-egress-trace-id": "t" * 300}, ("t" * CLAIM_LIMIT, None)),
    ],
)
def test_ids_are_taken_from_the_headers_else_generated(
    headers: dict[str, str], want: tuple[str | None, str | None]
) -> None:
    got = _ids(headers)
    for value, wanted in zip(got, want, strict=True):
        if wanted is None:
            assert uuid.UUID(hex=value).version == 4
        else:
            assert value == wanted
    assert got[0] != got[1]


@pytest.mark.parametrize(
    ("headers", "streamed", "want"),
    [
        ({}, False, 30.0),
        ({}, True, 600.0),  # a plain client's stream: its gaps are bounded, not its length
        ({"x-stainless-timeout": "20"}, False, 20.0),
        ({"x-stainless-timeout": "20"}, True, 600.0),
        ({"x-stainless-read-timeout": "nope"}, True, 600.0),
        ({"x-stainless-timeout": "nope", "x-server-timeout": "7"}, False, 7.0),
        ({"x-stainless-timeout": "inf", "x-server-timeout": "-1"}, False, 30.0),
        ({"x-server-timeout": "900"}, True, 600.0),
        ({"x-egress-timeout": "5", "x-stainless-timeout": "20"}, True, 5.0),
    ],
)
def test_the_deadline_comes_from_the_first_usable_timeout_header(
    headers: dict[str, str], streamed: bool, want: float
) -> None:
    assert _timeout(headers, streamed=streamed) == want


# -- the answer pass -----------------------------------------------------------------------

SECRET = "sk-fastpath-TEST-9f8e7d6c5b4a3210"  # a made-up test value


@pytest.mark.parametrize(
    "values",
    [
        [],
        ["application/json", "1000000", "1ms"],
        ["application/json", f"Bearer {SECRET}", "1ms"],  # one holds it
        [SECRET, SECRET],
        [base64.b64encode(SECRET.encode()).decode(), "x"],  # another of its forms
        [f"k={SECRET.replace('-', '%2D')}"],
        [SECRET[:12], SECRET[12:]],  # split across two values: neither holds it
        [SECRET[:-1], "x"],
    ],
)
def test_answer_headers_are_scrubbed_as_one_by_one(values: list[str]) -> None:
    redaction.register(SECRET)
    headers = [(f"x-h{i}", value) for i, value in enumerate(values)]
    want = [(name, redaction.scrub(value)) for name, value in headers]
    got = scrubbed(list(headers))
    assert got == want
    if want == headers:
        assert all(a is b for (_, a), (_, b) in zip(got, headers, strict=True))
    else:
        assert SECRET not in json.dumps(got)
