"""Compact JSON, written and read by orjson when it is installed (the optional ``fast``
extra). This module owns orjson; everything else goes through it.

:func:`compact` gives the UTF-8 bytes of ``json.dumps(value, ensure_ascii=False,
separators=(",", ":"))``, several times faster. The only difference orjson makes is the
spelling of some floats (``1e16`` where the stdlib writes ``1e+16``: the same number,
RFC 8259 section 6). What orjson refuses (integers past 64 bits, non-string keys, lone
surrogates, types it does not know) is written by the stdlib, so the two paths accept
the same values. Not for hashes that must not change across installs (idempotency
keys and fingerprints, the audit chain): those use the stdlib's bytes, which
:func:`sorted_compact` gives with orjson's speed where orjson writes exactly the same.

:func:`answer_json` writes an ExternalCallResponse (the envelope answer and what the
idempotency store keeps): equal as JSON to pydantic's ``model_dump_json``, which writes
what orjson refuses.

:func:`log_line` writes one log or audit line (text, any value via ``str``);
:func:`loads` reads JSON back exactly as the stdlib does, :data:`loads_fast` as fast as
possible (orjson reads an integer past 64 bits as a float: ``2**70`` ->
``1.1805916207174113e+21``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Final

from gateway.envelope import ErrorPayload, ExternalCallResponse, ModelNames, ServedBy

try:
    import orjson
except ImportError:  # pragma: no cover - exercised by installs without the extra
    orjson = None  # type: ignore[assignment]

__all__ = [
    "answer_json",
    "compact",
    "dumps_line",
    "loads",
    "loads_fast",
    "log_line",
    "sorted_compact",
    "sorted_text",
    "surely_finite",
]

# Dates and dataclasses as str(), as the stdlib path's default=str writes them.
_LOG_OPTIONS: Final = (
    (orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS) if orjson else 0
)
#: The fastest JSON parser installed; raises ``ValueError`` for what it cannot read (orjson
#: refuses NaN, lone surrogates and numbers past a double's range: :func:`loads` then asks
#: the stdlib). With orjson an integer past 64 bits comes back as a float: for sums, not
#: for values that must read back exactly (:func:`loads`).
loads_fast: Callable[[bytes | str], Any] = orjson.loads if orjson is not None else json.loads

# An integer literal of 19 digits or more may be past 64 bits (-9223372036854775809),
# which orjson would read as a float: a text with such a run of digits (anywhere, strings
# included: a cheap, safe test) is read by the stdlib.
_DIGITS_ONLY: Final = bytes(0x39 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_LONG_DIGITS: Final = b"9" * 19
# Digits to "0", the characters of a float's fraction and exponent to ".": a float orjson
# wrote (always a digit followed by "." or "e") becomes "0.".
_FLOAT_MARKS: Final = bytes(
    0x30 if 0x30 <= b <= 0x39 else 0x2E if b in b".eE" else b for b in range(256)
)


#: orjson writes into a buffer of this many bytes and hands it back whatever the length
#: written (``sys.getsizeof`` says the length; the allocation stays ~4 KiB).
_ORJSON_BUFFER: Final = 4096


def compact(
    value: Any, *, default: Callable[[Any], Any] | None = None, held: bool = False
) -> bytes:
    """``value`` as compact UTF-8 JSON bytes. ``default`` as in :func:`json.dumps`.
    ``held``: the bytes are kept for long (a request body held for its attempts while its
    stream is relayed), so a short result is copied to its length (one copy of at most
    4 KiB) rather than keep orjson's whole starting buffer.

    Raises ``TypeError`` for a value JSON cannot hold (without ``default``),
    ``UnicodeEncodeError`` for a lone surrogate, ``RecursionError`` for a cycle.
    """
    if orjson is not None:
        try:
            out = orjson.dumps(value, default=default)
        except TypeError:
            pass  # the stdlib decides, and raises its own errors
        else:
            if held and len(out) < _ORJSON_BUFFER:
                return memoryview(out).tobytes()
            return out
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=default)
    return text.encode("utf-8")


def _sorts_as_stdlib() -> bool:
    """Whether this orjson writes sorted compact JSON as the stdlib does for everything
    :func:`sorted_compact` lets through (escapes, raw UTF-8, key order, integers): a
    check at import, so another orjson version that writes differently is not used."""
    if orjson is None:
        return False
    sample = {
        "z": [0, -1, 2**63 - 1, -(2**63), True, False, {}, []],
        "é": "".join(map(chr, range(0x20))) + '"\\/\x7f\u2028\u2029\ufeff😀 ☃ Zoë',
        "😀": 1,
        "\uffff": 2,
        "": "",
        "A": {"b": {"a": "x"}},
    }
    stdlib = json.dumps(sample, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return orjson.dumps(sample, option=orjson.OPT_SORT_KEYS) == stdlib.encode("utf-8")


_SORTS_AS_STDLIB: Final = _sorts_as_stdlib()


def sorted_compact(value: Any) -> bytes | None:
    """``value`` as the UTF-8 bytes of ``json.dumps(value, sort_keys=True, ensure_ascii=
    False, separators=(",", ":"), allow_nan=False)``, written by orjson; or None where
    orjson's bytes might differ (the caller then asks the stdlib): orjson absent, a value
    it refuses, any float (orjson spells some differently: ``1e-7`` for ``1e-07``,
    ``0.00001`` for ``1e-05``), a ``null`` (orjson writes NaN and infinities as ``null``
    where the stdlib raises). The test is on the bytes written, strings included, so a
    text such as ``"v1.2"`` or ``"null"`` sends a value to the stdlib too: never a wrong
    answer, only a slower one. Keys sort alike in both: by code point, which is UTF-8
    byte order."""
    if orjson is None or not _SORTS_AS_STDLIB:
        return None
    try:
        out = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # past 64 bits, non-str keys, lone surrogates, too deep, unknown
        return None
    # ``find`` rather than ``in``: bytes.__contains__ first tries its argument as an
    # integer and formats a TypeError it then drops (~2,000 instructions each).
    if out.translate(_FLOAT_MARKS).find(b"0.") >= 0 or out.find(b"null") >= 0:
        return None
    return out


def sorted_text(value: Any) -> bytes | None:
    """``value`` as orjson's compact JSON with keys sorted: a text that names it exactly
    (equal values, whatever their keys' order, give equal bytes; different ones, different
    bytes), for a key this process alone uses; not the stdlib's bytes (floats may be
    spelled otherwise: :func:`sorted_compact` for those). None where orjson is absent,
    refuses the value (integers past 64 bits, non-string keys, lone surrogates, too
    deep) or wrote a ``null``, which may stand for NaN or an infinity as well as
    ``None``: the caller then asks the stdlib. Several thousand instructions fewer than
    :func:`sorted_compact`, which also reads its bytes back for floats."""
    if orjson is None:
        return None
    try:
        out = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        return None
    return None if out.find(b"null") >= 0 else out


def surely_finite(value: Any) -> bool:
    """True when ``value`` (parsed JSON: dicts, lists, str, int, float, bool, None) surely
    holds no NaN or infinite float and no integer past 64 bits: orjson writes it, and
    writes NaN and infinities as ``null``, so output without a ``null`` holds none. False
    when it may (a ``None`` is not told apart from them, an integer past 64 bits or a
    value orjson refuses), and always without orjson: the caller then decides another
    way. About 1,500 instructions for a small chat request's parameters."""
    if orjson is None:
        return False
    try:
        return b"null" not in orjson.dumps(value)
    except TypeError:
        return False


def log_line(value: Any) -> str:
    """One log or audit line as compact JSON text (no newline); values JSON cannot hold are
    written as ``str(value)``. A lone surrogate, which has no UTF-8 form, is written
    escaped (``\\udxxx``) so that the line is still written."""
    if orjson is not None:
        try:
            return orjson.dumps(value, default=str, option=_LOG_OPTIONS).decode()
        except TypeError:
            pass  # non-str keys, integers past 64 bits, lone surrogates: the stdlib's way
    line = json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)
    if not line.isascii():
        try:
            line.encode("utf-8")
        except UnicodeEncodeError:
            line = json.dumps(value, ensure_ascii=True, separators=(",", ":"), default=str)
    return line


def dumps_line(value: Any) -> str:
    """One compact JSON line (no newline); values JSON cannot hold as ``str(value)``."""
    if orjson is not None:
        try:
            return orjson.dumps(value).decode()
        except TypeError:
            pass
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


#: The envelope's models :func:`answer_json` writes itself, with their field counts: one
#: with a key beyond its fields in ``__dict__`` (a ``model_copy`` update naming an unknown
#: field, which pydantic does not write) is left to pydantic.
_ANSWER_MODELS: Final[dict[type, int]] = {
    model: len(model.model_fields)
    for model in (ExternalCallResponse, ErrorPayload, ServedBy, ModelNames)
}
# Dates and dataclasses to ``default`` (which refuses them): pydantic decides how they
# are written, not orjson.
_ANSWER_OPTIONS: Final = (
    (orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS) if orjson else 0
)


def _answer_part(value: Any) -> dict[str, Any]:
    """orjson's ``default`` for :func:`answer_json`: a nested envelope model's fields (its
    ``__dict__``, in the model's order); raises TypeError for anything else."""
    fields = _ANSWER_MODELS.get(type(value))
    if fields is None or len(value.__dict__) != fields:
        raise TypeError(type(value).__name__)
    held: dict[str, Any] = value.__dict__
    return held


def answer_json(response: ExternalCallResponse) -> bytes:
    """``response.model_dump_json()``'s JSON as UTF-8 bytes: equal to it as JSON
    (``json.loads``), written by orjson where it can (a few times faster), else by
    pydantic. Floats may be spelled otherwise (the same numbers); NaN and infinities are
    ``null``, as pydantic writes them (``ser_json_inf_nan="null"``). What orjson refuses
    (integers past 64 bits, non-string keys, lone surrogates, nesting past 255) or leaves
    to pydantic (dates, dataclasses, bytes, sets, other models) is written by pydantic,
    whose errors (``ValueError`` for a lone surrogate) are raised as before."""
    held = response.__dict__
    if orjson is not None and len(held) == _ANSWER_MODELS[ExternalCallResponse]:
        try:
            return orjson.dumps(held, default=_answer_part, option=_ANSWER_OPTIONS)
        except TypeError:
            pass  # pydantic decides, and raises its own errors
    return response.model_dump_json().encode()


#: What :func:`orjson_value` gives when it leaves the text to ``json`` to decide.
UNDECIDED: Final = object()


def orjson_value(raw: bytes) -> Any:
    """``raw`` parsed by orjson where that is exactly ``json.loads``'s value, else
    :data:`UNDECIDED`: orjson refused it (NaN, an infinity such as ``1e400``, a lone
    surrogate, a BOM, UTF-16 or -32, invalid JSON) or it holds an integer of more digits
    than orjson keeps exact. Never raises."""
    if orjson is None or _LONG_DIGITS in raw.translate(_DIGITS_ONLY):
        return UNDECIDED
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return UNDECIDED


def loads(raw: bytes) -> Any:
    """Parse one JSON value exactly as ``json.loads`` does (integers of any size stay
    integers), with orjson's speed where that gives the same value. Raises ``ValueError``
    (``json.JSONDecodeError``, ``UnicodeDecodeError``) if invalid."""
    value = orjson_value(raw)
    if value is not UNDECIDED:
        return value
    # NaN, lone surrogates, or really invalid: json decides and explains. Without the
    # line ending, an error's column is the column on the line.
    return json.loads(raw.rstrip(b"\r\n"))
