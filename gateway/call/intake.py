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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal

from pydantic import TypeAdapter, ValidationError

from gateway import fastjson
from gateway.call.fastpath import escapes_utf16, needs_exact_path
from gateway.call.fastpath import has_lone_surrogates as has_lone_surrogates  # bodies.py's
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
#: Unknown top-level fields named (and given a "did you mean") in an answer or a warning:
#: an envelope of a million unknown keys must cost no more than one of twenty
#: (difflib compares each name with every known field).
MAX_REPORTED_UNKNOWN_FIELDS: Final = 20
#: An unknown field's name is echoed up to this many characters.
_MAX_NAME_CHARS: Final = 64
#: Above this size an envelope is read once, by pydantic's JSON parser (about twice the
#: stdlib's speed on dense JSON, and it holds the GIL just the same, so a worker thread
#: would not free the event loop), and validated without walking its free-form objects.
#: Below it, the one-pass fast path and the stdlib parser are quicker.
LARGE_BODY_BYTES: Final = 256 * 1024
#: The envelope's free-form objects: a JSON object's keys are strings and its values
#: anything, so pydantic's dict[str, Any] check could only copy them (a second of the
#: event loop for a million keys).
_FREE_FORM: Final = ("parameters", "metadata")
#: How far a lone surrogate is followed into the envelope to name its field: deeper, or
#: inside a container of more items, the container is named (each level re-encodes
#: what is below it, so the walk is kept to a few passes over the envelope).
_MAX_PATH_DEPTH: Final = 2
_MAX_PATH_FANOUT: Final = 256
#: pydantic's JSON parser (the fast path's), for values of any shape.
_ANY_JSON: Final = TypeAdapter(Any)


@dataclass(frozen=True, slots=True)
class Intake:
    """A validated request and the unknown fields that were dropped (warn mode only):
    the first :data:`MAX_REPORTED_UNKNOWN_FIELDS` names, and how many there were."""

    request: ExternalCallRequest
    unknown_fields: tuple[str, ...] = ()
    unknown_field_count: int = 0


def decode_json(
    body: bytes,
    *,
    check_surrogates: bool = True,
    object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
) -> Any:
    """Parse a UTF-8 JSON document (RFC 8259; a leading BOM is ignored).

    Raises :class:`InvalidPayload` whose ``details.reason`` is ``not_utf8``; ``not_json``
    (with ``line`` and ``column`` for syntax errors); ``not_finite`` for ``NaN``,
    ``Infinity`` and numbers too large for a float (not JSON numbers, and they could not
    be forwarded untouched); ``lone_surrogate`` for a ``\\uD800``-style escape that
    is not half of a pair (no Unicode character: it cannot be re-encoded as UTF-8); or
    ``too_deep`` past the interpreter's recursion limit.

    A body over :data:`LARGE_BODY_BYTES` is parsed by pydantic's parser when it holds
    nothing the two parsers read differently (:mod:`gateway.call.fastpath`: NaN,
    infinities, overflowing numbers; it refuses what the stdlib's refuses) and no
    ``\\uD8xx``-style escape (it refuses a lone surrogate, which must be refused naming
    its field): the same value, once. ``object_pairs_hook`` is :func:`json.loads`' (each
    object's pairs in order, repeated names included); with it the stdlib parser reads
    every body.
    """
    if (
        object_pairs_hook is None
        and len(body) > LARGE_BODY_BYTES
        and not needs_exact_path(body)
        and not escapes_utf16(body)
    ):
        try:
            return _ANY_JSON.validate_json(body)
        except ValidationError:
            pass  # not JSON, too deep for it, a BOM...: the stdlib parser says precisely
    try:
        # Decode first: json.loads(bytes) would also accept UTF-16 and UTF-32 (RFC 8259 8.1).
        value = json.loads(
            body.decode("utf-8-sig"),
            parse_constant=_refuse_constant,
            parse_float=_finite,
            object_pairs_hook=object_pairs_hook,
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
    """Raise :class:`InvalidPayload` (reason ``lone_surrogate``) if ``value``, parsed from
    the JSON text ``raw``, holds one. Cheap unless ``raw`` has a ``\\uD8xx``-``\\uDFxx``
    escape at all; then a few C-speed encodes of the envelope at most."""
    if not escapes_utf16(raw):
        return
    path = _surrogate_path(value)
    if path is not None:
        field = path or "(envelope)"
        raise InvalidPayload(
            f"{field}: the request body contains a \\u escape of a lone UTF-16 surrogate "
            "(\\uD800-\\uDFFF without its pair), which is not a character",
            details={"reason": "lone_surrogate", "field": field[:256]},
        )


def _surrogate_path(value: Any) -> str | None:
    """Where the first lone surrogate in ``value`` is, or None if there is none: the
    dotted path of the key or string holding it; or of the container holding it, past
    :data:`_MAX_PATH_DEPTH` levels or inside a container of more than
    :data:`_MAX_PATH_FANOUT` items (``""``: the envelope itself). Each level checks its
    items with a C-speed encode rather than visiting everything below them."""
    path = ""
    for _ in range(_MAX_PATH_DEPTH):
        if not isinstance(value, dict | list) or len(value) > _MAX_PATH_FANOUT:
            break
        items: Any = value.items() if isinstance(value, dict) else enumerate(value)
        last = len(value) - 1
        for i, (key, item) in enumerate(items):
            here = _escaped(f"{path}.{key}" if path else str(key))
            if isinstance(key, str) and not _encodes(key):
                return here
            # Below the top, ``value`` holds one: if no other item did, the last one does.
            if (path and i == last) or _holds_lone_surrogate(item):
                value, path = item, here
                break
        else:
            return None  # neither its keys nor its items hold one
    # Below the top, ``value`` was entered because it holds one; the top is checked whole.
    return path if path or _holds_lone_surrogate(value) else None


def _holds_lone_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        return not _encodes(value)
    if isinstance(value, dict | list):
        try:
            # orjson (when installed) refuses a lone surrogate at once; else the stdlib's
            # text does not encode.
            fastjson.compact(value)
        except UnicodeEncodeError:
            return True
    return False


def _escaped(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode()


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
        if unknown_fields == "reject":
            raise _unknown_fields_error(unknown)
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
    free = {k: v for k in _FREE_FORM if _is_json_object(v := raw.get(k))}
    checked = {**raw, **{key: {} for key in free}} if free else raw
    headers = raw.get("headers")
    if isinstance(headers, dict):
        wrong = [k for k, v in headers.items() if not isinstance(v, str)]
        if wrong:  # only these get errors: pydantic would list every one
            checked = {**checked, "headers": {k: headers[k] for k in wrong[:_MAX_REPORTED_ERRORS]}}
    try:
        request = ExternalCallRequest.model_validate(checked)
        if free:
            request = request.model_copy(update=free)
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
    return Intake(
        request,
        tuple(str(k)[:_MAX_NAME_CHARS] for k in unknown[:MAX_REPORTED_UNKNOWN_FIELDS]),
        len(unknown),
    )


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


def _unknown_fields_error(unknown: list[str]) -> InvalidPayload:
    """The refusal of an envelope with unknown top-level fields. Only the first
    :data:`MAX_REPORTED_UNKNOWN_FIELDS` are named (each cut to :data:`_MAX_NAME_CHARS`)
    and given a suggestion, so that the answer and the work stay small whatever the
    envelope holds; ``details.unknown_field_count`` is the full count."""
    named = [key[:_MAX_NAME_CHARS] for key in unknown[:MAX_REPORTED_UNKNOWN_FIELDS]]
    known = sorted(REQUEST_FIELDS)
    suggestions = {
        key: close[0] for key in named if (close := difflib.get_close_matches(key, known, n=1))
    }
    described = [
        f"{key!r} (did you mean {suggestions[key]!r}?)" if key in suggestions else repr(key)
        for key in named
    ]
    more = len(unknown) - len(named)
    if more:
        described.append(f"and {more} more")
    details: dict[str, Any] = {
        "reason": "unknown_fields",
        "unknown_fields": named,
        "suggestions": suggestions,
    }
    if more:
        details["unknown_field_count"] = len(unknown)
    return InvalidPayload(
        "unknown envelope field(s): "
        + ", ".join(described)
        + "; put free-form additions in 'metadata'",
        details=details,
    )


def _is_json_object(value: Any) -> bool:
    """A dict with string keys only (as every JSON object is)."""
    return isinstance(value, dict) and set(map(type, value)) <= {str}


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
    if not _flat_and_plain(metadata):
        problem = _shape_problem(metadata)
        if problem is not None:
            return problem
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


#: The types of a JSON scalar, as parsed (exact types: a subclass takes the walks).
_SCALARS: Final = frozenset({str, int, float, bool, type(None)})


def _flat_and_plain(metadata: dict[str, Any]) -> bool:
    """True for what the usual metadata is (a few scalars under plain keys), which
    :func:`_shape_problem` would pass without its walks (~20,000 instructions): one
    level of at most ``MAX_METADATA_BYTES // 2`` items, and no control character in
    any key (searched once, in the keys joined)."""
    return (
        len(metadata) <= MAX_METADATA_BYTES // 2
        and set(map(type, metadata.values())) <= _SCALARS
        # Printable text has no control character (a C test); else the regex decides.
        and ((keys := "".join(metadata)).isprintable() or not CONTROL_CHARACTERS.search(keys))
    )


def _shape_problem(metadata: dict[str, Any]) -> str | None:
    """Why ``metadata``'s shape cannot be audited (too many items, too deep, a key with
    control characters), or None."""
    # Every item takes at least two bytes of compact JSON (the value and a separator):
    # counted first, with an early stop, so that a huge metadata is refused without
    # walking all of it (or writing it out).
    if _more_items_than(metadata, MAX_METADATA_BYTES // 2):
        return (
            f"metadata is more than {MAX_METADATA_BYTES} bytes of JSON; at most "
            f"{MAX_METADATA_BYTES} are kept in the audit record (put payloads in parameters)"
        )
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
    return None


def _more_items_than(value: Any, limit: int) -> bool:
    """True if the dicts and lists in ``value`` hold more than ``limit`` items in all;
    visits at most ``limit`` of them."""
    stack, count = [value], 0
    while stack:
        item = stack.pop()
        if isinstance(item, dict | list):
            count += len(item)
            if count > limit:
                return True
            stack.extend(item.values() if isinstance(item, dict) else item)
    return False


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


#: What ``ExternalCallRequest.model_validate_json`` calls, without its wrapper.
_VALIDATE_ENVELOPE: Final[Callable[[bytes], ExternalCallRequest]] = (
    ExternalCallRequest.__pydantic_validator__.validate_json
)


def parse_envelope_fast(body: bytes) -> ExternalCallRequest | None:
    """The envelope in ``body`` validated in one pass by pydantic's JSON parser, or None
    when the exact path must decide (anything invalid, unknown fields, another
    ``protocol_version``, a BOM, non-finite numbers): that path gives the same request
    for any envelope this one accepts, and the precise error for the others.

    Not for bodies over :data:`LARGE_BODY_BYTES`: pydantic's errors for a million unknown
    keys or header values would cost seconds before the exact path even starts, and that
    path parses a large body with the same parser, once."""
    if len(body) > LARGE_BODY_BYTES:
        return None
    try:
        # Strict, extra fields forbidden; a lone surrogate escape is a JSON error here.
        request = _VALIDATE_ENVELOPE(body)
    except ValidationError:
        return None
    if request.protocol_version not in SUPPORTED_PROTOCOL_VERSIONS:
        return None
    # What the two parsers read differently (NaN, infinities, floats past a double's
    # range: gateway.call.fastpath) can only be in the free-form fields, every other one
    # being typed, its floats bounded: checked there in C (~1,500 instructions), the
    # body's text (~20,000: five scans) only when they may hold one.
    if not fastjson.surely_finite(
        (request.parameters, request.metadata, request.query)
    ) and needs_exact_path(body):
        return None
    if (request.metadata or request.body is not None) and request_problem(request):
        return None
    return request


#: A drop-in call's JSON body as ``parameters``, by pydantic's parser (:func:`parse_built`
#: sets it on the request as it is, not validated and copied again).
_PARAMETERS: Final = TypeAdapter(dict[str, Any])
_VALIDATE_PARAMETERS: Final[Callable[[bytes], dict[str, Any]]] = _PARAMETERS.validator.validate_json
#: What ``ExternalCallRequest.model_validate`` calls, without its wrapper (a check of its
#: keyword defaults).
_VALIDATE_REQUEST: Final[Callable[[dict[str, Any]], ExternalCallRequest]] = (
    ExternalCallRequest.__pydantic_validator__.validate_python
)


def parse_object_fast(body: bytes) -> dict[str, Any] | None:
    """The JSON object in ``body`` read in one pass: the value :func:`decode_json` gives
    (:mod:`gateway.call.fastpath`), or None when that must decide (not an object, not
    JSON, a BOM, NaN, a lone surrogate, deep nesting, over :data:`LARGE_BODY_BYTES`)."""
    if len(body) > LARGE_BODY_BYTES:
        return None
    try:  # the core validator itself: TypeAdapter's wrapper only checks its defaults
        value = _VALIDATE_PARAMETERS(body)
    except ValidationError:
        return None
    # As parse_envelope_fast: what the two parsers read differently is looked for in the
    # parsed value in C (~1,500 instructions), the body's text (five scans, its length)
    # only when the value may hold one.
    if not fastjson.surely_finite(value) and needs_exact_path(body):
        return None
    return value


def parse_built(raw: dict[str, Any], parameters: dict[str, Any] | None = None) -> Intake:
    """:func:`parse_request` of an envelope the sidecar built (a drop-in call's) in one
    validation: the same :class:`Intake`, or (anything invalid) :func:`parse_request`'s
    own answer and error. ``parameters``: the request's body, a JSON object as
    :func:`parse_object_fast` or :func:`decode_json` parsed it (its keys strings, its
    values JSON: what ``parameters`` is validated to be), set on the validated request
    as it is: validating it again would only copy it (each key checked a string again)."""
    try:
        request = _VALIDATE_REQUEST(raw)
    except ValidationError:
        return parse_request(raw if parameters is None else {**raw, "parameters": parameters})
    if parameters is not None:
        # What model_copy(update=...) does, without its copy of the fresh request (no one
        # holds it yet): the field's value, and the field marked as given.
        request.__dict__["parameters"] = parameters
        request.__pydantic_fields_set__.add("parameters")
    # What the model's types cannot say (request_problem) is about a protocol_version,
    # metadata or a body: the sidecar's drop-in requests carry parameters.
    if ("metadata" in raw or "protocol_version" in raw or "body" in raw) and (
        request.protocol_version not in SUPPORTED_PROTOCOL_VERSIONS or request_problem(request)
    ):
        return parse_request(raw if parameters is None else {**raw, "parameters": parameters})
    return Intake(request)
