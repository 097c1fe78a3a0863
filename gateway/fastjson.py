"""Compact JSON, written by orjson when it is installed (the optional ``fast`` extra).

:func:`compact` gives the UTF-8 bytes of ``json.dumps(value, ensure_ascii=False,
separators=(",", ":"))``, several times faster. The only difference orjson makes is the
spelling of some floats (``1e16`` where the stdlib writes ``1e+16``: the same number,
RFC 8259 section 6). What orjson refuses (integers past 64 bits, non-string keys, lone
surrogates, types it does not know) is written by the stdlib, so the two paths accept
the same values. Not for hashes that must not change across installs (idempotency
keys and fingerprints, the audit chain): those use the stdlib only.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

try:
    import orjson
except ImportError:  # pragma: no cover - exercised by installs without the extra
    orjson = None  # type: ignore[assignment]

__all__ = ["compact"]


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
