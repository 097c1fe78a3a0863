"""The content codings still on an upstream's body after aiohttp read it, undone here so
that every answer is scrubbed decoded (RFC 9110 section 8.4).

aiohttp's client undoes one coding only: that of a single ``Content-Encoding`` header
naming exactly ``gzip``, ``deflate``, ``br`` or ``zstd``. What it leaves (``x-gzip``, a
list such as ``gzip, gzip`` or ``gzip, br``, ``compress``, a coding in two headers) is
undone here, last applied first (section 8.4: codings are listed in the order applied),
each layer bounded by ``server.max_response_bytes``; a coding the sidecar cannot undo
refuses the answer (:func:`unreadable`), never passes it on coded and so unscrubbed.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Final

from gateway.upstream.answers import too_large, unreadable
from gateway.urls import URL

#: The codings aiohttp's client undoes itself (its ``http_parser``: the one
#: ``Content-Encoding`` header's whole value, ASCII, any case).
AIOHTTP_DECODED: Final = frozenset({"gzip", "deflate", "br", "zstd"})
#: The codings undone here -> zlib's ``wbits`` (``x-gzip`` is ``gzip``, RFC 9110 section
#: 8.4.1.3; ``deflate`` is zlib-wrapped, a raw stream tried when that fails, as aiohttp
#: does).
_WBITS: Final = {
    "gzip": 16 + zlib.MAX_WBITS,
    "x-gzip": 16 + zlib.MAX_WBITS,
    "deflate": zlib.MAX_WBITS,
}
_NO_CODING: Final = frozenset({"", "identity"})


def left_on_body(headers: Mapping[str, str]) -> tuple[str, ...] | None:
    """The codings aiohttp left on the body of an answer with these headers (aiohttp's
    multi-valued mapping), in the order they were applied; ``()`` for none; None when it
    cannot be known which aiohttp undid (several ``Content-Encoding`` headers whose first
    and last differ, either a coding aiohttp undoes: its C parser reads the last, its
    Python parser the first)."""
    if "Content-Encoding" not in headers:
        return ()
    values: list[str] = headers.getall("Content-Encoding")  # type: ignore[attr-defined]
    first, last = values[0], values[-1]
    undone = _undone(last)
    if (undone or _undone(first)) and first.lower() != last.lower():
        return None
    codings = [t.strip().lower() for v in values for t in v.split(",")]
    if undone:  # the outermost layer (the last applied), undone by aiohttp
        codings.pop()
    return tuple(c for c in codings if c not in _NO_CODING)


def _undone(value: str) -> bool:
    """Whether aiohttp undoes a ``Content-Encoding`` header of this value."""
    return value.isascii() and value.lower() in AIOHTTP_DECODED


def decoded(body: bytes, codings: tuple[str, ...], url: URL, limit: int, status: int) -> bytes:
    """``body`` with ``codings`` undone, last applied first, each layer's output at most
    ``limit`` bytes (else RESPONSE_TOO_LARGE). Raises :func:`unreadable` for a coding the
    sidecar does not undo or a body that is not what its codings say."""
    for coding in reversed(codings):
        wbits = _WBITS.get(coding)
        if wbits is None:
            raise unreadable(url, ", ".join(codings), status)
        try:
            body = _inflate(body, wbits, limit, url, status)
        except zlib.error:
            if coding != "deflate":
                raise unreadable(url, ", ".join(codings), status) from None
            try:
                body = _inflate(body, -zlib.MAX_WBITS, limit, url, status)
            except zlib.error:
                raise unreadable(url, ", ".join(codings), status) from None
    return body


def _inflate(body: bytes, wbits: int, limit: int, url: URL, status: int) -> bytes:
    inflater = zlib.decompressobj(wbits)
    out = inflater.decompress(body, limit + 1)
    if len(out) > limit or inflater.unconsumed_tail:
        raise too_large(url, limit, status)
    out += inflater.flush()
    if len(out) > limit:
        raise too_large(url, limit, status)
    if body and (not inflater.eof or inflater.unused_data):
        # Cut short, or followed by more (a second gzip member): not what it says, or
        # not all of it undone, so it is not passed on.
        raise zlib.error("not one whole coded body")
    return out
