"""Whether a text holds any of a set of literal strings, in one pass (pure, no I/O).

The secret scrub (:mod:`gateway.redaction`) asks this of every answer, header block,
audit record and log line, for the needles of every registered secret: searched one by
one with ``str.__contains__`` each needle costs a pass over the text (~1.5 instructions a
byte), so a sidecar holding an agent token and a chain key besides its provider key paid
twelve passes. :class:`AnyOf` makes one: pydantic-core's string ``pattern`` is Rust's
``regex`` crate, which searches an alternation of literals with Aho-Corasick (SIMD's
Teddy for a few dozen), unanchored, without building a match object; a miss (the usual
answer) comes back as the schema's default, not as a raised error.

Only whether some needle is present is answered, exactly (no false hit, no miss): which
needles, and where, the caller finds with its own searches, which it only makes on a hit.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Final

from pydantic_core import SchemaError, SchemaValidator, core_schema

#: Characters written as themselves in the pattern; every other one as ``\\x{HEX}``, which
#: the regex crate reads as that code point whatever it is (no escaping rules to get right).
_PLAIN: Final = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")
#: More needles than this are searched one by one: the pattern is compiled again whenever
#: the set changes (~1.4 ms for 64 needles of 30 characters, ~13 ms for 256).
MAX_NEEDLES: Final = 64


def _escaped(needle: str) -> str:
    return "".join(c if c in _PLAIN else f"\\x{{{ord(c):x}}}" for c in needle)


def _encodable(text: str) -> bool:
    """Whether ``text`` has a UTF-8 form (no lone surrogate): the Rust side reads it so."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class AnyOf:
    """Whether a text holds one of ``needles`` (:meth:`found`), or bytes one of ``needles``
    as UTF-8 (:meth:`found_bytes`: the bytes read as Latin-1, one character a byte, so
    that a byte string holds a needle's bytes exactly when the one text holds the other).
    Immutable; building compiles the needles (~1 ms for a dozen)."""

    __slots__ = ("_apart", "_needles", "_search")

    def __init__(self, needles: Collection[str]) -> None:
        self._needles = tuple(needles)
        #: Searched one by one: needles the Rust side cannot read (a lone surrogate), or
        #: all of them when there are too many or the pattern does not compile.
        self._apart = self._needles
        self._search: Callable[[str], object] | None = None
        if len(self._needles) > MAX_NEEDLES:
            return
        together = [n for n in self._needles if _encodable(n)]
        if together:
            schema = core_schema.str_schema(pattern="|".join(map(_escaped, together)), strict=True)
            try:
                self._search = SchemaValidator(
                    core_schema.with_default_schema(schema, default=None, on_error="default")
                ).validate_python
            except SchemaError:  # a pattern the regex crate refuses (its size limit)
                return
            self._apart = tuple(n for n in self._needles if not _encodable(n))

    @classmethod
    def of_bytes(cls, needles: Collection[bytes]) -> AnyOf:
        """For :meth:`found_bytes`: ``needles`` read as Latin-1, as it reads the bytes."""
        return cls([needle.decode("latin-1") for needle in needles])

    def found(self, text: str) -> bool:
        """Whether ``text`` holds one of the needles."""
        search = self._search
        if search is None:  # too many needles: all of them are apart
            return any(needle in text for needle in self._apart)
        if search(text) is not None:
            return True
        if not text.isascii() and not _encodable(text):
            # Not readable as UTF-8 (a lone surrogate): the pattern could not look.
            return any(needle in text for needle in self._needles)
        return any(needle in text for needle in self._apart)

    def found_bytes(self, data: bytes) -> bool:
        """Whether ``data`` holds the bytes of one of the needles (built by
        :meth:`of_bytes`)."""
        text = data.decode("latin-1")  # always has a UTF-8 form: the pattern can look
        search = self._search
        if search is not None and search(text) is not None:
            return True
        return any(needle in text for needle in self._apart)
