"""Envelope intake: raw request bytes -> a validated :class:`ExternalCallRequest`.

Unknown top-level fields are refused by default, each named with the closest known field
(a misspelt ``max_retires`` must never silently become the default of 3 retries on a
payment). With the policy's ``envelope.unknown_fields: warn`` they are dropped and
reported instead, for rolling upgrades of agents. Type errors are INVALID_PAYLOAD; a
``protocol_version`` the sidecar does not speak is SCHEMA_MISMATCH.
"""

from __future__ import annotations

import base64
import binascii
import difflib
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Final, Literal

from pydantic import ValidationError

from gateway import fastjson
from gateway.envelope import (
    BODY_METHODS,
    CONTROL_CHARACTERS,
    MAX_METADATA_BYTES,
    REQUEST_FIELDS,
    SUPPORTED_PROTOCOL_VERSIONS,
    ExternalCallRequest,
)
from gateway.errors import InvalidPayload, SchemaMismatch
from gateway.redaction import MAX_REDACT_DEPTH, nesting_depth

_MAX_REPORTED_ERRORS = 20


@dataclass(frozen=True, slots=True)
class Intake:
    """A validated request and the unknown fields that were dropped (warn mode only)."""

    request: ExternalCallRequest
    unknown_fields: tuple[str, ...] = ()


def decode_json(body: bytes, *, check_surrogates: bool = True) -> Any:
    """Parse a UTF-8 JSON document (RFC 8259; a leading BOM is ignored).

    Raises :class:`InvalidPayload` whose ``details.reason`` is ``not_utf8``; ``not_json``
    (with ``line`` and ``column`` for syntax errors); ``not_finite`` for ``NaN``,
    ``Infinity`` and numbers too large for a float (not JSON numbers, and they could not
    be forwarded untouched); ``lone_surrogate`` for a ``\\uD800``-style escape that
    is not half of a pair (no Unicode character: it cannot be re-encoded as UTF-8); or
    ``too_deep`` past the interpreter's recursion limit.
    """
    try:
        # Decode first: json.loads(bytes) would also accept UTF-16 and UTF-32 (RFC 8259 8.1).
        value = json.loads(
            body.decode("utf-8-sig"), parse_constant=_refuse_constant, parse_float=_finite
        )
        if check_surrogates:
            refuse_lone_surrogates(body, value)
        return value
    except UnicodeDecodeError:
        raise InvalidPayload(
            "the request body is not UTF-8 encoded JSON",
            details={"reason": "not_utf8"},
        ) from None
    except json.JSONDecodeError as exc:
        raise InvalidPayload(
            f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} "
            f"column {exc.colno}",
            details={"reason": "not_json", "line": exc.lineno, "column": exc.colno},
        ) from None
    except _NotFinite as exc:
        raise InvalidPayload(
            f"the request body is not valid JSON: {exc} is not a finite number",
            details={"reason": "not_finite", "value": str(exc)},
        ) from None
    except RecursionError:
        raise InvalidPayload(
            "the request body is nested too deeply to be parsed",
            details={"reason": "too_deep"},
        ) from None
    except ValueError as exc:  # e.g. an integer over Python's 4300-digit conversion limit
        raise InvalidPayload(
            f"the request body cannot be parsed: {str(exc)[:200]}",
            details={"reason": "not_json"},
        ) from None


def refuse_lone_surrogates(raw: bytes, value: Any) -> None:
    """Raise :class:`InvalidPayload` (reason ``lone_surrogate``) if ``value`` holds one."""
    if has_lone_surrogates(raw, value):
        field = _surrogate_path(value) or "(envelope)"
        raise InvalidPayload(
            f"{field}: the request body contains a \\u escape of a lone UTF-16 surrogate "
            "(\\uD800-\\uDFFF without its pair), which is not a character",
            details={"reason": "lone_surrogate", "field": field[:256]},
        )


def _surrogate_path(value: Any, path: str = "") -> str | None:
    """The dotted path of the first key or string holding a lone surrogate, or None."""
    if isinstance(value, str):
        return path if not _encodes(value) else None
    items: Any = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, item in items:
        here = f"{path}.{key}" if path else str(key)
        if isinstance(key, str) and not _encodes(key):
            return here.encode("utf-8", "backslashreplace").decode()
        found = _surrogate_path(item, here)
        if found is not None:
            return found.encode("utf-8", "backslashreplace").decode()
    return None


def printable(text: str) -> str:
    """``text`` with control characters and lone surrogates written as ``\\xNN`` /
    ``\\udNNN`` escapes: how the ids an invalid envelope claimed are echoed in its answer
    and audit record (so that they can still be found, and cannot split a line)."""
    if CONTROL_CHARACTERS.search(text) is None and _encodes(text):
        return text
    text = CONTROL_CHARACTERS.sub(lambda m: f"\\x{ord(m[0]):02x}", text)
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def has_lone_surrogates(raw: bytes, value: Any) -> bool:
    """True if the parsed ``value`` of JSON text ``raw`` holds a lone surrogate. Cheap
    unless ``raw`` contains a ``\\uD8xx``-``\\uDFxx`` escape at all."""
    if b"\\ud" not in raw and b"\\uD" not in raw:
        return False
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


class _NotFinite(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _NotFinite(name)


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _NotFinite(text[:32])
    return value


def parse_request(raw: Any, *, unknown_fields: Literal["reject", "warn"] = "reject") -> Intake:
    """Validate a decoded JSON value as an :class:`ExternalCallRequest`.

    Raises :class:`InvalidPayload` (not an object, unknown fields in reject mode, wrong
    types or values; ``details.errors`` lists each as ``{field, problem}``) or
    :class:`SchemaMismatch` (unsupported ``protocol_version``).
    """
    if not isinstance(raw, dict):
        raise InvalidPayload(
            "the request body must be a JSON object (an ExternalCallRequest envelope)",
            details={"reason": "not_an_object"},
        )
    unknown = [key for key in raw if key not in REQUEST_FIELDS]
    if unknown:
        described = []
        for key in unknown:
            close = difflib.get_close_matches(str(key), sorted(REQUEST_FIELDS), n=1, cutoff=0.6)
            described.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
        if unknown_fields == "reject":
            raise InvalidPayload(
                "unknown envelope field(s): "
                + ", ".join(described)
                + "; put free-form additions in 'metadata'",
                details={
                    "reason": "unknown_fields",
                    "unknown_fields": unknown,
                    "suggestions": {
                        k: c[0]
                        for k in unknown
                        if (c := difflib.get_close_matches(str(k), sorted(REQUEST_FIELDS), n=1))
                    },
                },
            )
        raw = {k: v for k, v in raw.items() if k in REQUEST_FIELDS}
    version = raw.get("protocol_version")
    if (
        isinstance(version, str)
        and version not in SUPPORTED_PROTOCOL_VERSIONS
        and CONTROL_CHARACTERS.search(version) is None  # not a version: INVALID_PAYLOAD
    ):
        raise SchemaMismatch(
            f"protocol_version {version!r} is not spoken by this sidecar "
            f"(supported: {', '.join(sorted(SUPPORTED_PROTOCOL_VERSIONS))})",
            details={
                "reason": "protocol_version",
                "protocol_version": version,
                "supported": sorted(SUPPORTED_PROTOCOL_VERSIONS),
            },
        )
    try:
        request = ExternalCallRequest.model_validate(raw)
    except ValidationError as exc:
        errors = [
            {
                "field": ".".join(str(p) for p in err["loc"]) or "(envelope)",
                "problem": err["msg"],
            }
            for err in exc.errors(include_url=False, include_input=False)
        ][:_MAX_REPORTED_ERRORS]
        raise _invalid_fields(errors) from None
    problem = request_problem(request)
    if problem is not None:
        raise _invalid_fields([problem])
    return Intake(request, tuple(str(k) for k in unknown))


def request_problem(request: ExternalCallRequest) -> dict[str, str] | None:
    """What the model's types cannot say is wrong with ``request`` (``{field, problem}``),
    or None: ``metadata`` past its bounds (:func:`metadata_problem`), a ``body`` on a
    method that sends none or beside ``parameters``, or whose base64 is not base64."""
    problem = metadata_problem(request.metadata)
    if problem is not None:
        return {"field": "metadata", "problem": problem}
    if request.body is not None:
        if request.method not in BODY_METHODS:
            return {"field": "body", "problem": "a body goes with POST, PUT or PATCH only"}
        if request.parameters:
            return {
                "field": "body",
                "problem": "give either body (not JSON) or parameters (a JSON body), not both",
            }
        try:
            base64.b64decode(request.body.base64, validate=True)
        except (binascii.Error, ValueError):
            return {"field": "body.base64", "problem": "not standard base64 (RFC 4648 section 4)"}
    return None


def _invalid_fields(errors: list[dict[str, str]]) -> InvalidPayload:
    summary = "; ".join(f"{e['field']}: {e['problem']}" for e in errors)
    return InvalidPayload(
        f"the envelope is not a valid ExternalCallRequest: {summary}",
        details={"reason": "invalid_fields", "errors": errors},
    )


def metadata_problem(metadata: dict[str, Any]) -> str | None:
    """Why ``metadata`` cannot be copied into the audit record, or None: nested deeper
    than the redaction reaches (:data:`gateway.redaction.MAX_REDACT_DEPTH`), a key with
    control characters, or more than :data:`gateway.envelope.MAX_METADATA_BYTES` UTF-8
    bytes of compact JSON (as the audit line holds it)."""
    if not metadata:
        return None
    if nesting_depth(metadata) > MAX_REDACT_DEPTH:
        return (
            f"metadata is nested more than {MAX_REDACT_DEPTH} levels deep; "
            "the audit record could not be searched for sensitive keys below that"
        )
    key = _control_key(metadata)
    if key is not None:
        return (
            f"metadata key {key[:64]!r} contains control characters "
            "(U+0000-U+001F, U+007F-U+009F); keys are copied into log lines"
        )
    try:
        size = len(fastjson.compact(metadata, default=str))
    except UnicodeEncodeError:  # a lone surrogate: refused at intake, counted here
        text = json.dumps(metadata, ensure_ascii=False, separators=(",", ":"), default=str)
        size = len(text.encode("utf-8", "replace"))
    if size > MAX_METADATA_BYTES:
        return (
            f"metadata is {size} bytes of JSON; at most {MAX_METADATA_BYTES} are kept in "
            "the audit record (put payloads in parameters)"
        )
    return None


def _control_key(value: Any) -> str | None:
    """The first key, at any depth (depth already bounded), with a control character."""
    if isinstance(value, dict):
        for key, item in value.items():
            if CONTROL_CHARACTERS.search(key):
                return str(key)
            found = _control_key(item)
            if found is not None:
                return found
    elif isinstance(value, list):
        for item in value:
            found = _control_key(item)
            if found is not None:
                return found
    return None


#: The fast path leaves to :func:`decode_json` and :func:`parse_request` what pydantic's
#: JSON parser reads differently: ``NaN`` and ``Infinity`` (accepted there) and numbers
#: that overflow a float (read as infinities). An overflow needs at least 309 digits
#: before the point, or an exponent: of three digits, or of two after at least 210
#: digits (10^(209 + 99)). In JSON an exponent always follows a digit (RFC 8259,
#: section 6), so the regex runs only on a body with a digit before an ``e``. A match
#: inside a string is harmless: that envelope just takes the exact path.
_DIGITS_AS_ZERO: Final = bytes.maketrans(b"123456789E", b"000000000e")
_LONG_MANTISSA: Final = b"0" * 309
_LONG_WITH_EXPONENT: Final = b"0" * 200  # fewer than 210, to be safe
_BIG_EXPONENT: Final = re.compile(rb"[0-9][eE][+-]?[0-9]{3}")


def _needs_exact_path(body: bytes) -> bool:
    if b"NaN" in body or b"Infinity" in body:
        return True
    digits = body.translate(_DIGITS_AS_ZERO)
    if b"0e" not in digits:  # no exponent anywhere
        return _LONG_MANTISSA in digits
    return _LONG_WITH_EXPONENT in digits or _BIG_EXPONENT.search(body) is not None


def parse_envelope_fast(body: bytes) -> ExternalCallRequest | None:
    """The envelope in ``body`` validated in one pass by pydantic's JSON parser, or None
    when the exact path must decide (anything invalid, unknown fields, another
    ``protocol_version``, a BOM, non-finite numbers): that path gives the same request
    for any envelope this one accepts, and the precise error for the others."""
    if _needs_exact_path(body):
        return None
    try:
        # Strict, extra fields forbidden; a lone surrogate escape is a JSON error here.
        request = ExternalCallRequest.model_validate_json(body)
    except ValidationError:
        return None
    if request.protocol_version not in SUPPORTED_PROTOCOL_VERSIONS:
        return None
    if (request.metadata or request.body is not None) and request_problem(request):
        return None
    return request
