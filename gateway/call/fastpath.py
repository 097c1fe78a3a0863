"""What pydantic's JSON parser reads differently from the stdlib's (pure, no I/O): the
test that sends a body to the exact path (:func:`gateway.call.intake.decode_json` and
:func:`gateway.call.intake.parse_request`) before the one-pass fast paths of the
envelope route (:func:`gateway.call.intake.parse_envelope_fast`) and of the drop-in
route (:func:`gateway.call.intake.parse_object_fast`) try it.

Both parsers accept the same JSON (RFC 8259) and read it to the same value (each
object's keys in the order of their first occurrence, a repeated key's last value;
integers exact; floats correctly rounded) except for what :func:`needs_exact_path`
finds, and a lone surrogate escape (:func:`escapes_utf16`: the stdlib reads it,
pydantic's parser refuses it). What pydantic's parser refuses (a BOM, a lone surrogate,
nesting past its limit) the fast paths leave to the exact path, which says why.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

#: ``NaN`` and ``Infinity`` (accepted by pydantic's parser) and numbers that overflow a
#: float (read as infinities there). An overflow needs at least 309 digits before the
#: point, or an exponent: of three digits, or of two after at least 210 digits
#: (10^(209 + 99)). In JSON an exponent always follows a digit (RFC 8259, section 6), so
#: the regex runs only on a body with a digit before an ``e``. A match inside a string
#: is harmless: that body just takes the exact path. An integer past the stdlib's
#: 4,300-digit conversion limit has more than 309 digits, so it takes it too.
_DIGITS_AS_ZERO: Final = bytes.maketrans(b"123456789E", b"000000000e")
_LONG_MANTISSA: Final = b"0" * 309
_LONG_WITH_EXPONENT: Final = b"0" * 200  # fewer than 210, to be safe
_BIG_EXPONENT: Final = re.compile(rb"[0-9][eE][+-]?[0-9]{3}")


def needs_exact_path(body: bytes) -> bool:
    """True if the JSON text ``body`` may hold something the two parsers read
    differently (module docstring): ``NaN``, ``Infinity`` or a number that may overflow
    a float, anywhere in it (strings included: a cheap test that errs on the safe side)."""
    if b"NaN" in body or b"Infinity" in body:
        return True
    digits = body.translate(_DIGITS_AS_ZERO)
    if b"0e" not in digits:  # no exponent anywhere
        return _LONG_MANTISSA in digits
    return _LONG_WITH_EXPONENT in digits or _BIG_EXPONENT.search(body) is not None


def escapes_utf16(raw: bytes) -> bool:
    """True if JSON text ``raw`` may hold a ``\\uD800``-``\\uDFFF`` escape: the stdlib
    reads a lone one to a string that cannot be encoded, pydantic's parser refuses it."""
    return b"\\ud" in raw or b"\\uD" in raw


def has_lone_surrogates(raw: bytes, value: Any) -> bool:
    """True if the parsed ``value`` of JSON text ``raw`` holds a lone surrogate. Cheap
    unless ``raw`` contains a ``\\uD8xx``-``\\uDFxx`` escape at all."""
    if not escapes_utf16(raw):
        return False
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
