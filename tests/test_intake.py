"""Envelope intake: strict types, unknown fields, protocol versions, JSON decoding.

Pure tests of ``gateway.call.intake`` and ``gateway.envelope`` (no sockets).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.call.intake import Intake, decode_json, parse_request
from gateway.envelope import (
    DEFAULT_MAX_RETRIES,
    DEFAULT_TIMEOUT_S,
    PROTOCOL_VERSION,
    REQUEST_FIELDS,
    ErrorCode,
    ErrorPayload,
    ExternalCallRequest,
    ExternalCallResponse,
)
from gateway.errors import InvalidPayload, SchemaMismatch

MINIMAL: dict[str, Any] = {
    "trace_id": "tr-1",
    "correlation_id": "corr-1",
    "target_system": "openai",
    "endpoint": "/v1/chat/completions",
    "method": "POST",
}


def raw(**fields: Any) -> dict[str, Any]:
    return {**MINIMAL, **fields}


def invalid_fields(exc: InvalidPayload) -> list[dict[str, str]]:
    assert exc.details["reason"] == "invalid_fields"
    errors: list[dict[str, str]] = exc.details["errors"]
    return errors


# --- defaults and accepted values -------------------------------------------------------


def test_minimal_envelope_takes_the_documented_defaults() -> None:
    intake = parse_request(raw())
    assert isinstance(intake, Intake)
    request = intake.request
    assert intake.unknown_fields == ()
    assert request.timeout == DEFAULT_TIMEOUT_S == 30.0
    assert request.max_retries == DEFAULT_MAX_RETRIES == 3
    assert request.parameters == {}
    assert request.api_key_ref is None
    assert request.rate_limit_group is None
    assert request.idempotency_key is None
    assert request.protocol_version == PROTOCOL_VERSION == "1"
    assert request.agent_id is None
    assert request.headers == {}
    assert request.metadata == {}


def test_every_documented_field_is_known() -> None:
    assert {
        "trace_id",
        "correlation_id",
        "target_system",
        "endpoint",
        "method",
        "parameters",
        "api_key_ref",
        "rate_limit_group",
        "timeout",
        "max_retries",
        "idempotency_key",
        "protocol_version",
        "agent_id",
        "headers",
        "metadata",
        "query",
        "body",
        "call_chain",
    } == REQUEST_FIELDS


@pytest.mark.parametrize("method", ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"])
def test_every_http_method_is_accepted(method: str) -> None:
    assert parse_request(raw(method=method)).request.method == method


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("timeout", 600, 600.0),  # the upper bound is inclusive
        ("timeout", 0.001, 0.001),
        ("timeout", 5, 5.0),  # a JSON integer is a number: strict float accepts it
        ("max_retries", 0, 0),
        ("max_retries", 10, 10),
        ("protocol_version", "1", "1"),
        ("api_key_ref", "env://KEY", "env://KEY"),
        ("headers", {"X-Request-Id": "abc"}, {"X-Request-Id": "abc"}),
    ],
)
def test_accepted_values(field: str, value: Any, expected: Any) -> None:
    request = parse_request(raw(**{field: value})).request
    assert getattr(request, field) == expected


# --- strict types and bounds ------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("timeout", "5", "Input should be a valid number"),
        ("timeout", True, "Input should be a valid number"),
        ("timeout", None, "Input should be a valid number"),
        ("timeout", 0, "Input should be greater than 0"),
        ("timeout", -1.5, "Input should be greater than 0"),
        ("timeout", 600.5, "Input should be less than or equal to 600"),
        ("timeout", float("nan"), "Input should be less than or equal to 600"),
        ("max_retries", "5", "Input should be a valid integer"),
        ("max_retries", True, "Input should be a valid integer"),
        ("max_retries", 2.0, "Input should be a valid integer"),
        ("max_retries", 2.5, "Input should be a valid integer"),
        ("max_retries", -1, "Input should be greater than or equal to 0"),
        ("max_retries", 11, "Input should be less than or equal to 10"),
        (
            "method",
            "get",
            "Input should be 'GET', 'POST', 'PUT', 'PATCH', 'DELETE', 'HEAD' or 'OPTIONS'",
        ),
        (
            "method",
            "TRACE",
            "Input should be 'GET', 'POST', 'PUT', 'PATCH', 'DELETE', 'HEAD' or 'OPTIONS'",
        ),
        (
            "method",
            1,
            "Input should be 'GET', 'POST', 'PUT', 'PATCH', 'DELETE', 'HEAD' or 'OPTIONS'",
        ),
        ("endpoint", "", "String should have at least 1 character"),
        ("endpoint", "/" + "a" * 2048, "String should have at most 2048 characters"),
        ("endpoint", ["/v1"], "Input should be a valid string"),
        ("trace_id", "", "String should have at least 1 character"),
        ("trace_id", 42, "Input should be a valid string"),
        ("correlation_id", "c" * 257, "String should have at most 256 characters"),
        ("target_system", None, "Input should be a valid string"),
        ("parameters", [], "Input should be a valid dictionary"),
        ("parameters", "a=1", "Input should be a valid dictionary"),
        ("metadata", "note", "Input should be a valid dictionary"),
        ("api_key_ref", "", "String should have at least 1 character"),
        ("protocol_version", 1, "Input should be a valid string"),
        ("idempotency_key", "k" * 256, "String should have at most 255 characters"),
    ],
)
def test_wrong_types_and_values_are_invalid_payload(field: str, value: Any, problem: str) -> None:
    with pytest.raises(InvalidPayload) as info:
        parse_request(raw(**{field: value}))
    exc = info.value
    assert exc.code is ErrorCode.INVALID_PAYLOAD
    assert exc.http_status == 400
    assert exc.retryable is False
    assert invalid_fields(exc) == [{"field": field, "problem": problem}]
    assert exc.message == f"the envelope is not a valid ExternalCallRequest: {field}: {problem}"


def test_header_values_must_be_strings_and_name_the_nested_key() -> None:
    with pytest.raises(InvalidPayload) as info:
        parse_request(raw(headers={"X-Count": 1}))
    assert invalid_fields(info.value) == [
        {"field": "headers.X-Count", "problem": "Input should be a valid string"}
    ]


@pytest.mark.parametrize(
    "missing", ["trace_id", "correlation_id", "target_system", "endpoint", "method"]
)
def test_required_fields(missing: str) -> None:
    envelope = raw()
    del envelope[missing]
    with pytest.raises(InvalidPayload) as info:
        parse_request(envelope)
    assert invalid_fields(info.value) == [{"field": missing, "problem": "Field required"}]


def test_every_problem_is_listed_at_once() -> None:
    with pytest.raises(InvalidPayload) as info:
        parse_request({"endpoint": "/x", "method": "GET", "timeout": "5", "max_retries": True})
    assert invalid_fields(info.value) == [
        {"field": "trace_id", "problem": "Field required"},
        {"field": "correlation_id", "problem": "Field required"},
        {"field": "target_system", "problem": "Field required"},
        {"field": "timeout", "problem": "Input should be a valid number"},
        {"field": "max_retries", "problem": "Input should be a valid integer"},
    ]


def test_reported_problems_are_capped() -> None:
    with pytest.raises(InvalidPayload) as info:
        parse_request(raw(headers={f"X-H{i}": i for i in range(50)}))
    errors = invalid_fields(info.value)
    assert len(errors) == 20
    assert errors[0] == {"field": "headers.X-H0", "problem": "Input should be a valid string"}


def test_the_invalid_value_is_not_echoed() -> None:
    # A misplaced credential in a wrong-typed field must not travel back in the answer.
    canary = "sk-canary-not-echoed-123"
    with pytest.raises(InvalidPayload) as info:
        parse_request(raw(timeout=canary, headers={"X-Key": [canary]}))
    assert canary not in info.value.message
    assert canary not in json.dumps(info.value.details)


@pytest.mark.parametrize(
    "value", [[MINIMAL], "envelope", 42, 4.2, None, True], ids=lambda v: type(v).__name__
)
def test_a_body_that_is_not_an_object_is_invalid_payload(value: Any) -> None:
    with pytest.raises(InvalidPayload) as info:
        parse_request(value)
    assert info.value.details == {"reason": "not_an_object"}
    assert info.value.message == (
        "the request body must be a JSON object (an ExternalCallRequest envelope)"
    )


# --- unknown fields ------------------------------------------------------------------------


def test_a_misspelt_field_is_refused_with_a_suggestion() -> None:
    with pytest.raises(InvalidPayload) as info:
        parse_request(raw(max_retires=0))
    exc = info.value
    assert exc.message == (
        "unknown envelope field(s): 'max_retires' (did you mean 'max_retries'?); "
        "put free-form additions in 'metadata'"
    )
    assert exc.details == {
        "reason": "unknown_fields",
        "unknown_fields": ["max_retires"],
        "suggestions": {"max_retires": "max_retries"},
    }


def test_several_unknown_fields_are_each_named_in_order() -> None:
    with pytest.raises(InvalidPayload) as info:
        parse_request(raw(timout=3, max_retires=0, zzqqxx=1, api_key="sk-x"))
    exc = info.value
    assert exc.message == (
        "unknown envelope field(s): 'timout' (did you mean 'timeout'?), "
        "'max_retires' (did you mean 'max_retries'?), 'zzqqxx', "
        "'api_key' (did you mean 'api_key_ref'?); put free-form additions in 'metadata'"
    )
    assert exc.details["unknown_fields"] == ["timout", "max_retires", "zzqqxx", "api_key"]
    assert exc.details["suggestions"] == {
        "timout": "timeout",
        "max_retires": "max_retries",
        "api_key": "api_key_ref",
    }


def test_an_unknown_field_with_no_close_match_gets_no_suggestion() -> None:
    with pytest.raises(InvalidPayload) as info:
        parse_request(raw(favourite_colour="blue"))
    assert info.value.message == (
        "unknown envelope field(s): 'favourite_colour'; put free-form additions in 'metadata'"
    )
    assert info.value.details["suggestions"] == {}


def test_unknown_fields_are_refused_before_types_are_checked() -> None:
    # The misspelling is the root cause: report it, not the consequences.
    with pytest.raises(InvalidPayload) as info:
        parse_request(raw(max_retires=0, timeout="5"))
    assert info.value.details["reason"] == "unknown_fields"


def test_warn_mode_drops_and_reports_unknown_fields() -> None:
    intake = parse_request(raw(max_retires=0, zzqqxx={"a": 1}), unknown_fields="warn")
    assert intake.unknown_fields == ("max_retires", "zzqqxx")
    # Dropped, never guessed: the misspelt value does not become max_retries.
    assert intake.request.max_retries == DEFAULT_MAX_RETRIES
    assert "zzqqxx" not in intake.request.model_dump()


def test_warn_mode_still_checks_types_and_protocol_version() -> None:
    with pytest.raises(InvalidPayload):
        parse_request(raw(extra=1, timeout="5"), unknown_fields="warn")
    with pytest.raises(SchemaMismatch):
        parse_request(raw(extra=1, protocol_version="2"), unknown_fields="warn")


def test_warn_mode_without_unknown_fields_reports_none() -> None:
    assert parse_request(raw(), unknown_fields="warn").unknown_fields == ()


# --- protocol version ------------------------------------------------------------------


@pytest.mark.parametrize("version", ["2", "0", "1.0", ""])
def test_an_unsupported_protocol_version_is_schema_mismatch(version: str) -> None:
    with pytest.raises(SchemaMismatch) as info:
        parse_request(raw(protocol_version=version))
    exc = info.value
    assert exc.code is ErrorCode.SCHEMA_MISMATCH
    assert exc.http_status == 400
    assert exc.retryable is False
    assert exc.details == {
        "reason": "protocol_version",
        "protocol_version": version,
        "supported": ["1"],
    }
    assert exc.message == (
        f"protocol_version {version!r} is not spoken by this sidecar (supported: 1)"
    )


# --- pass-through of parameters and metadata -----------------------------------------------

PAYLOADS: list[Any] = [
    {"model": "gpt-4o", "messages": [{"role": "user", "content": "héllo 世界 🚀"}]},
    {"deep": {"a": [{"b": {"c": [1, 2.5, None, True, "x"]}}]}},
    {"big": 2**70, "neg": -(2**63) - 1, "max_float": 1.7976931348623157e308, "tiny": 5e-324},
    {"types": {"int": 1, "float": 1.0, "str": "1", "bool": False, "null": None}},
    {"max_retires": 9, "timeout": "5", "api_key_ref": "not-a-ref"},  # not envelope fields here
    {"": "empty key", "key with spaces": "\u0000\u2028\r\n"},
]


@pytest.mark.parametrize("payload", PAYLOADS)
def test_parameters_and_metadata_pass_through_untouched(payload: dict[str, Any]) -> None:
    body = json.dumps(raw(parameters=payload, metadata=payload), ensure_ascii=False).encode()
    request = parse_request(decode_json(body)).request
    for value in (request.parameters, request.metadata):
        assert value == payload
        # Same JSON text: an int stays an int, 1.0 stays a float, key order is kept.
        assert json.dumps(value, ensure_ascii=False) == json.dumps(payload, ensure_ascii=False)


# --- frozen models ------------------------------------------------------------------------


def test_request_is_frozen() -> None:
    request = parse_request(raw()).request
    with pytest.raises(ValidationError):
        request.max_retries = 9  # type: ignore[misc]
    assert request.max_retries == 3


def test_response_and_error_payload_are_frozen() -> None:
    error = ErrorPayload(code=ErrorCode.UNKNOWN, message="m", retryable=False)
    response = ExternalCallResponse(success=False, error=error, latency_ms=1.0)
    with pytest.raises(ValidationError):
        error.retryable = True  # type: ignore[misc]
    with pytest.raises(ValidationError):
        response.success = True  # type: ignore[misc]


def test_request_model_alone_also_refuses_unknown_fields_and_lax_types() -> None:
    # The contract holds without intake too (a caller validating the model directly).
    with pytest.raises(ValidationError):
        ExternalCallRequest.model_validate(raw(max_retires=1))
    with pytest.raises(ValidationError):
        ExternalCallRequest.model_validate(raw(max_retries="1"))


# --- JSON decoding ---------------------------------------------------------------------------


def test_decode_json_accepts_utf8_and_a_leading_bom() -> None:
    body = json.dumps({"a": "é世"}, ensure_ascii=False).encode()
    assert decode_json(body) == {"a": "é世"}
    assert decode_json(b"\xef\xbb\xbf" + body) == {"a": "é世"}


@pytest.mark.parametrize(
    "body",
    [
        b'{"a": "\xe9"}',  # Latin-1
        b"\xff\xfe",
        '{"a": 1}'.encode("utf-16"),  # json.loads(bytes) alone would accept this
        '{"a": 1}'.encode("utf-32"),
        b'{"a": "\xed\xa0\x80"}',  # an encoded surrogate is not UTF-8
    ],
    ids=["latin1", "bom-only", "utf16", "utf32", "surrogate"],
)
def test_decode_json_refuses_bytes_that_are_not_utf8(body: bytes) -> None:
    with pytest.raises(InvalidPayload) as info:
        decode_json(body)
    assert info.value.details == {"reason": "not_utf8"}
    assert info.value.message == "the request body is not UTF-8 encoded JSON"


@pytest.mark.parametrize(
    ("body", "message", "line", "column"),
    [
        (b"", "Expecting value", 1, 1),
        (b"   ", "Expecting value", 1, 4),
        (b'{"a": 1,}', "Expecting property name enclosed in double quotes", 1, 9),
        (b'{\n  "a": 1\n  "b": 2\n}', "Expecting ',' delimiter", 3, 3),
        (b"{'a': 1}", "Expecting property name enclosed in double quotes", 1, 2),
        (b'{"a": 1} x', "Extra data", 1, 10),
        (b'{"a": "unterminated', "Unterminated string starting at", 1, 7),
    ],
)
def test_decode_json_syntax_errors_name_line_and_column(
    body: bytes, message: str, line: int, column: int
) -> None:
    with pytest.raises(InvalidPayload) as info:
        decode_json(body)
    exc = info.value
    assert exc.details == {"reason": "not_json", "line": line, "column": column}
    assert exc.message == (
        f"the request body is not valid JSON: {message} at line {line} column {column}"
    )


@pytest.mark.parametrize(
    ("body", "value"),
    [
        (b'{"timeout": NaN}', "NaN"),
        (b'{"parameters": {"x": Infinity}}', "Infinity"),
        (b"[-Infinity]", "-Infinity"),
        (b'{"parameters": {"x": 1e400}}', "1e400"),
    ],
)
def test_decode_json_refuses_non_finite_numbers(body: bytes, value: str) -> None:
    # Not JSON numbers (RFC 8259 section 6): forwarded, they would be invalid JSON.
    with pytest.raises(InvalidPayload) as info:
        decode_json(body)
    assert info.value.details == {"reason": "not_finite", "value": value}


def test_decode_json_keeps_large_integers_exact() -> None:
    assert decode_json(b'{"n": 123456789012345678901234567890}') == {
        "n": 123456789012345678901234567890
    }


def test_decode_json_turns_an_oversized_integer_into_invalid_payload() -> None:
    # Python refuses to convert integers over 4300 digits with a bare ValueError.
    with pytest.raises(InvalidPayload) as info:
        decode_json(b'{"n": ' + b"9" * 5000 + b"}")
    assert info.value.details == {"reason": "not_json"}


def test_decode_json_turns_deep_nesting_into_invalid_payload() -> None:
    with pytest.raises(InvalidPayload) as info:
        decode_json(b"[" * 100_000)
    assert info.value.details == {"reason": "too_deep"}


# --- the fast path (pydantic's JSON parser) agrees with the exact path ----------------------

_BASE = json.dumps(MINIMAL)[:-1]  # '{"trace_id": ..., "method": "POST"' without the brace


def _with(fields: str) -> bytes:
    return (_BASE + (", " + fields if fields else "") + "}").encode()


_FAST_CORPUS: dict[str, bytes] = {
    "minimal": _with(""),
    "full": json.dumps(
        raw(
            parameters={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            api_key_ref="vault://openai-key",
            rate_limit_group="llm",
            timeout=12.5,
            max_retries=0,
            idempotency_key="k-1",
            protocol_version=PROTOCOL_VERSION,
            agent_id="a-1",
            headers={"X-Request-Id": "r"},
            metadata={"task": "t", "n": [1, 2.5, None, True]},
        )
    ).encode(),
    "int-timeout": _with('"timeout": 5'),
    "floats": _with('"parameters": {"a": 1e5, "b": 1.5e-7, "c": 1E+2, "d": -0.0}'),
    "underflow": _with('"parameters": {"a": 1e-400}'),  # 0.0 both ways
    "big-float": _with('"parameters": {"a": 1e308}'),
    "big-int": _with('"parameters": {"a": 123456789012345678901234567890}'),
    "null": _with('"parameters": {"a": null, "b": [null]}'),
    "nan-in-a-string": _with('"parameters": {"a": "NaN, Infinity and 1e400"}'),
    "escapes": _with(r'"parameters": {"a": "\ud83d\ude00 \u00e9 \n \" \\ \/"}'),
    "raw-unicode": _with('"parameters": {"a": "Zoë ☃ 😀"}').decode().encode("utf-8"),
    "whitespace": b"\n\t " + _with("") + b" \r\n",
    "duplicate-key": _with('"max_retries": 1, "max_retries": 2'),
    "openai": json.dumps(
        raw(
            parameters={
                "model": "gpt-4o",
                "messages": [{"role": "user", "content": "Sum 1e3 and 2e-5; year 2024."}],
                "max_tokens": 1024,
                "temperature": 0.7,
                "stream": True,
                "n": 1,
                "logit_bias": {"50256": -100},
                "seed": 123456789,
                "stop": ["\n\n"],
            },
            timeout=120,
            metadata={"attempt": 100, "flags": [True, 1000, False, 2000]},
        )
    ).encode(),
    "nulls": _with('"api_key_ref": null, "rate_limit_group": null, "idempotency_key": null'),
    # Everything below must be refused by both paths, or left to the exact one.
    "nan": _with('"parameters": {"a": NaN}'),
    "infinity": _with('"parameters": {"a": -Infinity}'),
    "nan-beside-null": _with('"parameters": {"a": null, "b": NaN}'),
    "nan-in-query": _with('"query": {"a": NaN}'),
    "big-int-beside-nan": _with('"parameters": {"a": 123456789012345678901234567890, "b": NaN}'),
    "overflow": _with('"parameters": {"a": 1e400}'),
    "overflow-upper": _with('"parameters": {"a": [1, -2.5E+400]}'),
    "long-mantissa": _with('"parameters": {"a": ' + "9" * 400 + ".0}"),
    "long-mantissa-2-digit-exponent": _with('"parameters": {"a": ' + "9" * 300 + "e99}"),
    "long-mantissa-1-digit-exponent": _with('"metadata": {"a": -' + "9" * 305 + ".5E+9}"),
    "lone-surrogate": _with(r'"metadata": {"a": "\udc00"}'),
    "bom": b"\xef\xbb\xbf" + _with(""),
    "utf16": _with("").decode().encode("utf-16"),
    "not-utf8": _with('"metadata": {"a": "X"}').replace(b"X", b"\xff"),
    "raw-control-char": _with('"metadata": {"a": "line\nbreak"}'),
    "trailing-comma": _with('"max_retries": 1,'),
    "unknown-field": _with('"max_retires": 1'),
    "string-timeout": _with('"timeout": "5"'),
    "float-retries": _with('"max_retries": 1.0'),
    "bool-retries": _with('"max_retries": true'),
    "lowercase-method": _BASE.replace('"POST"', '"post"').encode() + b"}",
    "other-version": _with('"protocol_version": "2"'),
    "header-int": _with('"headers": {"X-A": 1}'),
    "big-metadata": _with('"metadata": {"a": "' + "x" * 20_000 + '"}'),
    "not-object": b"[1, 2]",
    "empty": b"",
}
_TAKES_FAST_PATH = {
    "minimal", "full", "int-timeout", "floats", "underflow", "big-float", "big-int", "null",
    "nan-in-a-string", "escapes", "raw-unicode", "whitespace", "duplicate-key", "nulls",
    "openai",
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(_FAST_CORPUS))
def test_fast_path_agrees_with_the_exact_path(name: str) -> None:
    from gateway.call.intake import parse_envelope_fast

    body = _FAST_CORPUS[name]
    fast = parse_envelope_fast(body)
    try:
        exact: ExternalCallRequest | None = parse_request(decode_json(body)).request
    except (InvalidPayload, SchemaMismatch):
        exact = None
    if fast is not None:
        assert exact is not None, "the fast path accepted what the exact path refuses"
        assert fast == exact
        assert json.dumps(fast.parameters) == json.dumps(exact.parameters)  # -0.0, types
    assert (fast is not None) == (name in _TAKES_FAST_PATH)


def test_metadata_is_bounded_by_the_bytes_of_its_compact_json() -> None:
    from gateway.envelope import MAX_METADATA_BYTES

    overhead = len('{"k":""}')
    fits = {"k": "é" * ((MAX_METADATA_BYTES - overhead) // 2)}  # 2 bytes each in UTF-8
    assert len(json.dumps(fits, ensure_ascii=False, separators=(",", ":")).encode()) == (
        MAX_METADATA_BYTES
    )
    assert parse_request(raw(metadata=fits)).request.metadata == fits
    over = {"k": fits["k"] + "x"}
    with pytest.raises(InvalidPayload) as caught:
        parse_request(raw(metadata=over))
    [error] = invalid_fields(caught.value)
    assert error["field"] == "metadata"
    assert f"{MAX_METADATA_BYTES + 1} bytes" in error["problem"]


def test_metadata_nested_past_the_redaction_depth_is_refused() -> None:
    from gateway.redaction import MAX_REDACT_DEPTH

    def nested(levels: int) -> dict[str, Any]:
        value: dict[str, Any] = {"api_key": "sk"}
        for _ in range(levels - 1):
            value = {"l": value}
        return value

    assert parse_request(raw(metadata=nested(MAX_REDACT_DEPTH))).request.metadata
    with pytest.raises(InvalidPayload) as caught:
        parse_request(raw(metadata=nested(MAX_REDACT_DEPTH + 1)))
    [error] = invalid_fields(caught.value)
    assert error["field"] == "metadata"
    assert "nested more than" in error["problem"]
