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


def _layer(data: bytes) -> _Layer | None:
    """``data`` with its escapes decoded, or None when it holds none."""
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
    if not spans:
        return None
    if kept < len(data):
        pieces.append(data[kept:])
        starts.append(size)
        spans.append((kept, len(data), True))
    return _Layer(b"".join(pieces), starts, spans)


#: An escape that may hide a character of a value written otherwise: a text whose only
#: escapes are ``\\n``-like ones holds a value only as JSON writes it, a form the scrub
#: lists already, so it is not decoded (JSON answers are full of ``\\n``).
_HIDING: Final = re.compile(rb'\\[u"\\/]|%[0-9a-fA-F]{2}')


class View(NamedTuple):
    """One decoded view of a text (:func:`views`) and the layers beneath it."""

    data: bytes
    layers: tuple[_Layer, ...]

    def origin(self, start: int, stop: int) -> tuple[int, int]:
        """The span of the original text behind ``data[start:stop]`` (not empty)."""
        for layer in reversed(self.layers):
            start, stop = layer.origin(start, stop)
        return start, stop


def views(data: bytes) -> list[View]:
    """``data`` with its JSON escapes and percent-encoded bytes decoded, once, then the
    result again, up to :data:`MAX_LAYERS` times (empty when it holds no escape)."""
    found: list[View] = []
    if _HIDING.search(data) is None:
        return found
    layers: tuple[_Layer, ...] = ()
    while len(layers) < MAX_LAYERS:
        layer = _layer(data)
        if layer is None:
            break
        layers = (*layers, layer)
        data = layer.data
        found.append(View(data, layers))
    return found
