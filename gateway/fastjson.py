"""Compact JSON, written and read by orjson when it is installed (the optional ``fast``
extra). This module owns orjson; everything else goes through it.

:func:`compact` gives the UTF-8 bytes of ``json.dumps(value, ensure_ascii=False,
separators=(",", ":"))``, several times faster. The only difference orjson makes is the
spelling of some floats (``1e16`` where the stdlib writes ``1e+16``: the same number,
RFC 8259 section 6). What orjson refuses (integers past 64 bits, non-string keys, lone
surrogates, types it does not know) is written by the stdlib, so the two paths accept
the same values. Not for hashes that must not change across installs (idempotency
keys and fingerprints, the audit chain): those use the stdlib only.

:func:`log_line` writes one log or audit line (text, any value via ``str``);
:func:`loads` and :data:`loads_fast` read JSON back.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Final

try:
    import orjson
except ImportError:  # pragma: no cover - exercised by installs without the extra
    orjson = None  # type: ignore[assignment]

__all__ = ["compact", "dumps_line", "loads", "loads_fast", "log_line"]

# Dates and dataclasses as str(), as the stdlib path's default=str writes them.
_LOG_OPTIONS: Final = (
    (orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS) if orjson else 0
)
#: The fastest JSON parser installed; raises ``ValueError`` for what it cannot read (orjson
#: refuses NaN and integers past 64 bits: :func:`loads` then asks the stdlib).
loads_fast: Callable[[bytes], Any] = orjson.loads if orjson is not None else json.loads


def compact(value: Any, *, default: Callable[[Any], Any] | None = None) -> bytes:
    """``value`` as compact UTF-8 JSON bytes. ``default`` as in :func:`json.dumps`.

    Raises ``TypeError`` for a value JSON cannot hold (without ``default``),
    ``UnicodeEncodeError`` for a lone surrogate, ``RecursionError`` for a cycle.
    """
    if orjson is not None:
        try:
            return orjson.dumps(value, default=default)
        except TypeError:
            pass  # the stdlib decides, and raises its own errors
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=default)
    return text.encode("utf-8")


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


def loads(raw: bytes) -> Any:
    """Parse one JSON value; raises ``ValueError`` (``json.JSONDecodeError``) if invalid."""
    if orjson is not None:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass  # NaN, huge ints, or really invalid: let json decide and explain
    # Without the line ending, an error's column is the column on the line.
    return json.loads(raw.rstrip(b"\r\n"))
