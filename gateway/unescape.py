"""A decoded view of a text's JSON escapes and percent-encoding, with the way back to the
text's own positions (pure, no I/O).

A JSON text may spell any character with ``\\uXXXX`` (either hex case, RFC 8259 section
7), and ``"``, ``\\`` and ``/`` also as ``\\"``, ``\\\\``, ``\\/``; a URL may spell any
byte as ``%XX`` (either case, RFC 3986 section 2.1). So one value has more spellings than
can be listed: the secret scrub (:mod:`gateway.redaction`) lists the usual ones and, for
a text holding an escape, searches this view, in which every spelling of a value is the
value itself, then redacts the text's span behind each hit. The view is never written:
the text keeps its own escapes, so redacting a span of whole escapes leaves it valid.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from typing import Final, NamedTuple

#: A surrogate pair first (one character), then any other ``\\u`` escape, a two-character
#: escape, or a percent-encoded byte. Matched left to right, so the ``\\\\`` of
#: ``\\\\u0041`` is one escape and ``u0041`` plain text (its next layer decodes it).
_TOKEN: Final = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}"
    rb"|\\u[0-9a-fA-F]{4}|\\[\"\\/bfnrt]|%[0-9a-fA-F]{2}"
)
_SHORT: Final = {ord(k): v for k, v in zip('"\\/bfnrt', '"\\/\b\f\n\r\t', strict=True)}
#: Layers decoded at most: a value escaped, then escaped again as the sidecar's writers
#: put an upstream's text into JSON, then percent-encoded inside that.
MAX_LAYERS: Final = 3


class _Layer(NamedTuple):
    """One decoding of a text: its bytes, and for each run of them (starting at
    ``starts[i]``) the span of the text it came from, and whether it is a copy (mapped
    byte for byte) or one escape (every byte of it maps to the whole escape)."""

    data: bytes
    starts: list[int]
    spans: list[tuple[int, int, bool]]

    def origin(self, start: int, stop: int) -> tuple[int, int]:
        """The span of the text behind the view's ``data[start:stop]`` (not empty)."""
        i = bisect_right(self.starts, start) - 1
        here, end, copy = self.spans[i]
        first = here + start - self.starts[i] if copy else here
        j = bisect_right(self.starts, stop - 1) - 1
        here, end, copy = self.spans[j]
        last = here + stop - self.starts[j] if copy else end
        return first, last


def _decoded(token: bytes) -> bytes:
    if token[0] == 0x25:  # "%"
        return bytes((int(token[1:], 16),))
    if token[1] != 0x75:  # "u"
        return _SHORT[token[1]].encode()
    code = int(token[2:6], 16)
    if len(token) == 12:
        code = 0x10000 + ((code - 0xD800) << 10) + (int(token[8:], 16) - 0xDC00)
    return chr(code).encode("utf-8", "surrogatepass")  # a lone one matches no value


def _layer(data: bytes) -> _Layer:
    """``data`` with its escapes decoded, and the map back (made only for a hit)."""
    pieces: list[bytes] = []
    starts: list[int] = []
    spans: list[tuple[int, int, bool]] = []
    kept = size = 0
    for match in _TOKEN.finditer(data):
        here, end = match.span()
        if here > kept:
            pieces.append(data[kept:here])
            starts.append(size)
            spans.append((kept, here, True))
            size += here - kept
        out = _decoded(match.group())
        pieces.append(out)
        starts.append(size)
        spans.append((here, end, False))
        size += len(out)
        kept = end
    if kept < len(data):
        pieces.append(data[kept:])
        starts.append(size)
        spans.append((kept, len(data), True))
    return _Layer(b"".join(pieces), starts, spans)


#: An escape that may hide a character of a value written otherwise: a text whose only
#: escapes are ``\\n``-like ones holds a value only as JSON writes it, a form the scrub
#: lists already, so it is not decoded (JSON answers are full of ``\\n``).
_HIDING: Final = re.compile(rb'\\[u"\\/]|%[0-9a-fA-F]{2}')


#: Decoded escapes, as an answer repeats the same few (``\\u00e9``, ``\\"``): a dict
#: look-up instead of parsing hex; bounded, cleared when full.
_MEMO: dict[bytes, bytes] = {}
_MAX_MEMO: Final = 4096


def _decoded_match(match: re.Match[bytes]) -> bytes:
    token = match.group()
    out = _MEMO.get(token)
    if out is None:
        out = _decoded(token)
        if len(_MEMO) >= _MAX_MEMO:
            _MEMO.clear()
        _MEMO[token] = out
    return out


class View(NamedTuple):
    """One decoded view of a text (:func:`views`), and the texts each of its layers
    decoded, outermost first: the map back is made from them only on a hit (rare)."""

    data: bytes
    sources: tuple[bytes, ...]

    def origin(self, start: int, stop: int) -> tuple[int, int]:
        """The span of the original text behind ``data[start:stop]`` (not empty)."""
        for source in reversed(self.sources):
            start, stop = _layer(source).origin(start, stop)
        return start, stop


def views(data: bytes) -> list[View]:
    """``data`` with its JSON escapes and percent-encoded bytes decoded, once, then the
    result again, up to :data:`MAX_LAYERS` times (empty when it holds no escape that may
    hide a character, :data:`_HIDING`)."""
    found: list[View] = []
    sources: tuple[bytes, ...] = ()
    while len(sources) < MAX_LAYERS and _HIDING.search(data) is not None:
        sources = (*sources, data)
        data = _TOKEN.sub(_decoded_match, data)
        found.append(View(data, sources))
    return found
