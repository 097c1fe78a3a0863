"""Scrubbing of secret values from any text the sidecar writes (pure, no I/O).

Every :class:`gateway.secrets.Secret` registers its value here when it is created, with
every form the sidecar may write it in (:func:`encoded_forms`: percent-encoded as it went
on the wire, JSON-escaped, repr). The audit renderer, the log renderer and the answer
writer pass their final text through :func:`scrub` or :func:`scrub_bytes` (which also
search a text holding escapes in its decoded views, :mod:`gateway.unescape`, for the
spellings no list can hold), so a
secret that reached a message by accident (an upstream echoing the key, an exception
carrying a URL with ``?key=...``) still never leaves the process. It is the second line
of defence: the first is never putting a value into text at all.
"""

from __future__ import annotations

import base64
import itertools
import json
import re
import sys
import threading
from collections import OrderedDict
from typing import Any, AnyStr, Final, NamedTuple
from urllib.parse import quote, quote_plus

from gateway.literals import MAX_NEEDLES, AnyOf
from gateway.unescape import views
from gateway.urls import URL

REDACTED: Final = "[REDACTED]"
_REDACTED_BYTES: Final = REDACTED.encode()
#: Values shorter than this are not scrubbed: they would mangle ordinary text, and no
#: real credential is that short.
MIN_SCRUB_LENGTH: Final = 8
_MAX_TRACKED: Final = 4096
MAX_REDACT_DEPTH: Final = 16
#: A secret's first characters shorter than this, left at a cut, are not masked.
_MIN_PREFIX: Final = 4

#: Keys whose values are replaced in audit and log records wherever they appear: these
#: names, and any name ending in one of :data:`SENSITIVE_SUFFIXES`, compared after
#: :func:`is_sensitive_key`'s normalisation (case, surrounding spaces, ``-`` as ``_``).
SENSITIVE_KEYS: Final = frozenset(
    {
        "authorization",
        "proxy-authorization",
        "x-api-key",
        "api-key",
        "api_key",
        "apikey",
        "cookie",
        "set-cookie",
        "password",
        "secret",
        "token",
        "client_token",
        "secret_id",
        "jwt",
        "access_token",
        "refresh_token",
        "bearer",
        "private_key",
        "credentials",
    }
)
_SENSITIVE_NORMALISED: Final = frozenset(k.replace("-", "_") for k in SENSITIVE_KEYS)
#: Name endings that mark a secret: ``client_secret``, ``openai_api_key``, ``id_token``.
SENSITIVE_SUFFIXES: Final = (
    "_token", "_secret", "_password", "_passwd", "_api_key", "_apikey", "_private_key",
    "_authorization", "_cookie", "_credentials",
)  # fmt: skip
#: Verdicts of is_sensitive_key (pure: the key lists are constants), as every record
#: field of every call asks again; bounded, cleared when full.
_NORMALISED: dict[str, bool] = {}
_MAX_NORMALISED: Final = 4096


def is_sensitive_key(key: str) -> bool:
    """True if a value under ``key`` must not be written: see :data:`SENSITIVE_KEYS`."""
    known = _NORMALISED.get(key)
    if known is None:
        name = key.strip().lower().replace("-", "_")
        known = name in _SENSITIVE_NORMALISED or name.endswith(SENSITIVE_SUFFIXES)
        if len(_NORMALISED) >= _MAX_NORMALISED:
            _NORMALISED.clear()
        if len(key) <= 64:  # agent-chosen names: keep only short ones
            _NORMALISED[key] = known
    return known


class _Registered(NamedTuple):
    forms: tuple[str, ...]  # longest first
    raw: tuple[bytes, ...]  # the same, UTF-8
    #: A run of characters that every form holds unchanged (letters, digits, "-._~"):
    #: text without it holds no form, so one search spares them all ("" when none).
    anchor: str
    raw_anchor: bytes
    #: The value's bytes as they look inside any base64 text (:func:`base64_forms`),
    #: searched whatever the anchor says (base64 changes every character).
    b64: tuple[str, ...] = ()
    raw_b64: tuple[bytes, ...] = ()
    #: Registration number: the value's key in :data:`_grams` and :data:`_by_order`.
    order: int = 0


_lock = threading.Lock()
_values: OrderedDict[str, _Registered] = OrderedDict()
_registered = itertools.count()
#: What proves that a text holds no registered form (:func:`_orders`): for each
#: value, its base64 forms and its anchor (or, without one, every form), its "needles".
#: A needle of :data:`_GRAM_MIN` bytes or more is known by the 8-byte words at its first
#: :data:`_STRIDE` offsets (:data:`_grams`: word -> the order of the value it belongs to,
#: or a set of orders when several share it); a shorter one is searched as it is
#: (:data:`_gate`: all of them in one pass, :class:`gateway.literals.AnyOf`), as are the
#: long ones while all the needles are at most :data:`_FEW`: that one pass is then
#: cheaper than reading the words of the text (~240 instructions a word).
#: Maintained under :data:`_lock` as values come and go.
_STRIDE: Final = 24
_GRAM_MIN: Final = _STRIDE + 7
_FEW: Final = MAX_NEEDLES
_grams: dict[int, int | set[int]] = {}
_by_order: dict[int, _Registered] = {}
#: Each value's short and long needles (as bytes, as str, with its order), by order:
#: what :data:`_gate` is made of again when a value comes or goes.
_short_of: dict[int, tuple[tuple[bytes, str, int], ...]] = {}
_long_of: dict[int, tuple[tuple[bytes, str, int], ...]] = {}


class _Gate(NamedTuple):
    """The needles searched by their own search (bytes and str, with their value's order),
    that search (:class:`gateway.literals.AnyOf`: whether a text holds one of them, in one
    pass; which ones is then asked of each), and whether the long needles are looked up by
    words instead (one snapshot, replaced whole)."""

    finds: tuple[tuple[bytes, int], ...] = ()
    finds_str: tuple[tuple[str, int], ...] = ()
    by_words: bool = False
    any_raw: AnyOf = AnyOf(())
    any_str: AnyOf = AnyOf(())


_gate = _Gate()
_HEX: Final = re.compile(r"%[0-9A-F]{2}")
_UNCHANGED: Final = re.compile(r"[A-Za-z0-9._~-]+")
_MIN_ANCHOR: Final = 4


def encoded_forms(value: str) -> tuple[str, ...]:
    """Every form in which the sidecar may write ``value``, longest first: one for a
    plain ASCII key, 79 for one holding every character that some encoding changes (288
    at most by construction); computed once per value, under a millisecond.

    * raw, and percent-encoded as it goes on the wire: the way yarl encodes a query
      value (what aiohttp sends for a ``query_param`` credential: ``+`` as ``%2B``, a
      space as ``+``) and yarl's half-decoded ``query_string`` of it, ``quote`` (with and
      without ``/`` safe) and ``quote_plus``, each also with lower-case hex digits
      (``%2b``: RFC 3986, section 2.1, says they are equivalent, and servers echo them);
    * Python's ``repr`` of the value and of its UTF-8 bytes (``\\xc3\\xa9``);
    * each of those JSON-escaped (``\\u00e9`` or as is, ``\\"``, ``\\\\``) and with
      ``/`` as ``\\/``, as an upstream may echo it; and all of those JSON-escaped again,
      as the sidecar's writers put an upstream's text into JSON.

    Base64 (answers carry bodies that are not text as base64) is :func:`base64_forms`.
    """
    encoded = {
        value,
        *_yarl_query_forms(value),
        quote(value, safe="", errors="surrogateescape"),
        quote(value, errors="surrogateescape"),
        quote_plus(value, safe="", errors="surrogateescape"),
    }
    encoded |= {_HEX.sub(lambda m: m.group(0).lower(), form) for form in encoded}
    encoded.add(repr(value)[1:-1])
    encoded.add(repr(value.encode("utf-8", "surrogateescape"))[2:-1])
    # What an upstream may echo (JSON-escaped, PHP's "\\/" too), then that as the
    # sidecar's JSON writers escape it once more.
    forms = encoded | _json_escaped(encoded)
    forms |= {form.replace("/", "\\/") for form in forms}
    forms |= _json_escaped(forms)
    # Longest first: a shorter form replaced first could leave a longer one half shown.
    return tuple(sorted((f for f in forms if len(f) >= MIN_SCRUB_LENGTH), key=len, reverse=True))


def base64_forms(value: str) -> tuple[str, ...]:
    """What the UTF-8 bytes of ``value`` look like inside standard base64 (RFC 4648
    section 4) of any bytes that contain them: one run of characters for each of the
    three alignments a byte string can have to base64's 3-byte groups, less the first
    and last characters, which depend on the neighbouring bytes."""
    raw = value.encode("utf-8", "surrogateescape")
    forms = []
    for lead in range(3):
        text = base64.b64encode(b"\x00" * lead + raw).decode("ascii")
        start = 4 if lead else 0  # the group holding the filler bytes
        end = ((lead + len(raw)) // 3) * 4  # whole groups of the value's own bytes only
        core = text[start:end]
        if len(core) >= MIN_SCRUB_LENGTH:
            forms.append(core)
    return tuple(forms)


def _json_escaped(forms: set[str]) -> set[str]:
    return {json.dumps(form, ensure_ascii=a)[1:-1] for form in forms for a in (True, False)}


def _yarl_query_forms(value: str) -> tuple[str, ...]:
    try:
        url = URL("http://h/").extend_query([("k", value)])
    except UnicodeError:  # a lone surrogate (an undecodable environment variable)
        return ()
    # The wire form, and yarl's half-decoded query_string (what an aiohttp upstream
    # echoes as request.query_string: "%2B" kept, "+" and "%C3%A9" decoded).
    return url.raw_query_string[2:], url.query_string[2:]


def _anchor(value: str, forms: tuple[str, ...]) -> str:
    anchor = max(_UNCHANGED.findall(value), key=len, default="")
    if len(anchor) < _MIN_ANCHOR or not all(anchor in form for form in forms):
        return ""  # e.g. a literal "%4B" in the value, which a lower-hex form changes
    return anchor


def register(value: str) -> None:
    """Remember ``value`` and its :func:`encoded_forms` so that :func:`scrub`,
    :func:`scrub_bytes` and :func:`scrub_cut` remove each of them. Values shorter than
    :data:`MIN_SCRUB_LENGTH` are not kept; at most :data:`_MAX_TRACKED` values are (the
    least recently registered go first)."""
    if len(value) < MIN_SCRUB_LENGTH:
        return
    with _lock:
        if value in _values:
            _values.move_to_end(value)
            return
    forms = encoded_forms(value)  # outside the lock: pure, and well under a millisecond
    anchor = _anchor(value, forms)
    b64 = base64_forms(value)
    entry = _Registered(
        forms,
        tuple(form.encode("utf-8", "surrogateescape") for form in forms),
        anchor,
        anchor.encode(),
        b64,
        tuple(form.encode("ascii") for form in b64),
        next(_registered),
    )
    global _gate
    with _lock:
        if value in _values:  # registered meanwhile by another thread
            return
        _values[value] = entry
        _index(entry, add=True)
        while len(_values) > _MAX_TRACKED:
            _index(_values.popitem(last=False)[1], add=False)
        finds = list(itertools.chain.from_iterable(_short_of.values()))
        by_words = len(finds) + sum(map(len, _long_of.values())) > _FEW
        if not by_words:
            finds += itertools.chain.from_iterable(_long_of.values())
        _gate = _Gate(
            tuple((b, o) for b, _, o in finds),
            tuple((t, o) for _, t, o in finds),
            by_words,
            AnyOf.of_bytes({b for b, _, _ in finds}),
            AnyOf({t for _, t, _ in finds}),
        )


def _needles(entry: _Registered) -> tuple[tuple[bytes, str], ...]:
    """What :func:`_orders` looks for to find ``entry`` (UTF-8, and as text): every text
    holding one of its forms holds one of these. Its base64 forms, and its anchor, or,
    when the anchor is short and every form long, every form (words, where the anchor
    would be a search), or without an anchor every form (they have nothing in common)."""
    b64 = tuple(zip(entry.raw_b64, entry.b64, strict=True))
    anchor = entry.raw_anchor
    if anchor and (len(anchor) >= _GRAM_MIN or min(map(len, entry.raw)) < _GRAM_MIN):
        return (*b64, (anchor, entry.anchor))
    return (*b64, *zip(entry.raw, entry.forms, strict=True))


def _words(needle: bytes) -> set[int]:
    """The 8-byte words (native order, as ``memoryview.cast("Q")`` reads them) at
    ``needle``'s first :data:`_STRIDE` offsets: a text that holds ``needle`` holds one of
    them at an offset that is a multiple of :data:`_STRIDE` (needle of
    :data:`_GRAM_MIN` bytes or more)."""
    return {int.from_bytes(needle[o : o + 8], sys.byteorder) for o in range(_STRIDE)}


def _index(entry: _Registered, *, add: bool) -> None:
    """Add ``entry``'s words to :data:`_grams` or take them out (under :data:`_lock`);
    in place, so that registering costs the value's words, not every value's."""
    needles = [(raw, text, entry.order) for raw, text in _needles(entry)]
    short = tuple(needle for needle in needles if len(needle[0]) < _GRAM_MIN)
    long = tuple(needle for needle in needles if len(needle[0]) >= _GRAM_MIN)
    for kind, mine in ((_short_of, short), (_long_of, long)):
        if add and mine:
            kind[entry.order] = mine
        elif not add:
            kind.pop(entry.order, None)
    if add:
        _by_order[entry.order] = entry
    else:
        _by_order.pop(entry.order, None)
    for needle, _, _ in long:
        for word in _words(needle):
            known = _grams.get(word)
            if add:  # an int until a second value shares the word (no set per word)
                _grams[word] = entry.order if known is None else _with(known, entry.order)
            elif isinstance(known, set):
                known.discard(entry.order)
            elif known == entry.order:
                del _grams[word]


def _with(known: int | set[int], order: int) -> set[int]:
    if isinstance(known, set):
        known.add(order)
        return known
    return {known, order}


def _orders(data: bytes) -> list[int]:
    """The orders of the registered values of which ``data`` holds a needle
    (:func:`_needles`; repeated, unordered, empty when none): every value one of whose
    forms ``data`` holds is among them. The cost does not grow with the number of values
    whose needles are long: the text's 8-byte words at every :data:`_STRIDE`-th offset
    are looked up in :data:`_grams` (one C call when none is known); the short needles
    (and all of them while they are few) are searched in one pass, then one by one only
    when that pass finds one."""
    gate = _gate
    orders: list[int] = []
    # One pass for all of them first: a text seldom holds one. ``find`` rather than
    # ``in``: CPython's ``bytes.__contains__`` first tries its argument as an integer and
    # formats a TypeError it then drops (~2,000 instructions).
    if gate.finds and gate.any_raw.found_bytes(data):
        orders += (order for needle, order in gate.finds if data.find(needle) >= 0)
    if gate.by_words:
        grams = _grams
        words = memoryview(data)[: len(data) & ~7].cast("Q")[:: _STRIDE // 8]
        if not grams.keys().isdisjoint(words):
            for word in words:
                hit = grams.get(word)
                if isinstance(hit, int):
                    orders.append(hit)
                elif hit:
                    orders += hit  # one C call: the set may change in another thread
    return orders


def _text_orders(text: str) -> list[int]:
    """:func:`_orders` for text: its needles as text while they are searched one by one,
    else its UTF-8 bytes' words (every value for a text UTF-8 cannot encode)."""
    gate = _gate
    if not gate.by_words:
        if not gate.any_str.found(text):
            return []
        return [order for needle, order in gate.finds_str if needle in text]
    try:
        return _orders(text.encode("utf-8", "surrogateescape"))
    except UnicodeEncodeError:  # a lone surrogate no value can hold: search them all
        return list(_by_order)


def _entries(orders: list[int]) -> list[_Registered]:
    found = (_by_order.get(order) for order in sorted(set(orders)))
    return [entry for entry in found if entry is not None]


def _spans(text: AnyStr, needles: list[AnyStr]) -> list[tuple[int, int]]:
    """Where each occurrence of each needle is in ``text``."""
    spans: list[tuple[int, int]] = []
    for needle in needles:
        start = text.find(needle)
        while start >= 0:
            spans.append((start, start + len(needle)))
            start = text.find(needle, start + 1)
    return spans


def _redact_spans(text: AnyStr, spans: list[tuple[int, int]], mark: AnyStr) -> AnyStr:
    """``text`` with each span replaced by ``mark``; spans that overlap (two secrets
    sharing characters, one secret the start of another) are one span, replaced once, so
    that no character of either is left."""
    if not spans:
        return text
    spans = sorted(spans)
    pieces: list[AnyStr] = []
    kept, (start, stop) = 0, spans[0]
    for here, end in spans[1:]:
        if here < stop:  # overlapping: one span
            stop = max(stop, end)
            continue
        pieces += (text[kept:start], mark)
        kept, start, stop = stop, here, end
    pieces += (text[kept:start], mark, text[stop:])
    return text[:0].join(pieces)


def scrub(text: str) -> str:
    """``text`` with every registered secret value, in each of its forms, replaced by
    ``[REDACTED]``; a secret spelled with JSON escapes or percent-encoding in any other
    way too (see :func:`scrub_bytes`)."""
    if not _values:
        return text
    orders = _text_orders(text)
    if "\\" not in text and "%" not in text:
        return _scrub_forms(text, orders) if orders else text
    data = text.encode("utf-8", "surrogatepass")  # one byte string for every str
    spans = _escaped_spans(data)
    if not spans:
        return _scrub_forms(text, orders)
    # Byte offsets to character offsets: a hit starts and ends on a character of the
    # value, so its span starts and ends between characters of the text.
    spans = [(_chars(data, start), _chars(data, stop)) for start, stop in spans]
    return _redact_spans(text, [*_form_spans(text, orders), *spans], REDACTED)


def _chars(data: bytes, offset: int) -> int:
    return len(data[:offset].decode("utf-8", "surrogatepass"))


def _form_spans(text: str, orders: list[int]) -> list[tuple[int, int]]:
    """Where the forms of the values ``orders`` names are in ``text``."""
    return _spans(text, [form for entry in _entries(orders) for form in (*entry.b64, *entry.forms)])


def _raw_form_spans(data: bytes, orders: list[int]) -> list[tuple[int, int]]:
    """:func:`_form_spans` for UTF-8 bytes."""
    found = _entries(orders)
    return _spans(data, [form for entry in found for form in (*entry.raw_b64, *entry.raw)])


def _scrub_forms(text: str, orders: list[int]) -> str:
    if not orders:
        return text
    return _redact_spans(text, _form_spans(text, orders), REDACTED)


def scrub_cut(text: str, limit: int) -> str:
    """``text`` scrubbed, then cut to ``limit`` characters, with any start of a secret
    left at the cut masked too (cutting first would leave all but its tail visible)."""
    text = scrub(text)
    if len(text) <= limit:
        return text
    text = text[:limit]
    for entry in tuple(_values.values()):
        for form in entry.forms:
            for size in range(min(len(form) - 1, len(text)), _MIN_PREFIX - 1, -1):
                if text.endswith(form[:size]):
                    return text[:-size] + REDACTED
    return text


def nesting_depth(value: Any, limit: int = MAX_REDACT_DEPTH + 1) -> int:
    """Levels of dicts and lists in ``value`` (a scalar: 0, ``{}``: 1), counted up to
    ``limit`` (deeper values report ``limit``)."""
    if not isinstance(value, dict | list):
        return 0
    if limit <= 1:
        return 1
    items = value.values() if isinstance(value, dict) else value
    return 1 + max((nesting_depth(item, limit - 1) for item in items), default=0)


def scrub_bytes(data: bytes) -> bytes:
    """:func:`scrub` for UTF-8 encoded text (the answer and audit line writers). A
    secret spelled with JSON escapes (RFC 8259, section 7: any character may be written
    ``\\uXXXX`` in either hex case, and ``"``, ``\\``, ``/`` as ``\\"``, ``\\\\``,
    ``\\/``) or percent-encoded bytes (``%XX``, either case) in any mix is found in the
    text's decoded views (:mod:`gateway.unescape`), and the text's own span behind it is
    redacted: the rest of the text keeps its bytes, escapes and all."""
    if not _values:
        return data
    orders = _orders(data)
    # Two memchr passes, inline: what every text without a secret pays for the views.
    escaped = data.find(b"\\") >= 0 or data.find(b"%") >= 0
    if not orders and not escaped:
        return data
    spans = _raw_form_spans(data, orders)
    if escaped:  # searched in the text as it is: a plain form may share an escape's span
        spans += _escaped_spans(data)
    return _redact_spans(data, spans, _REDACTED_BYTES)


def _escaped_spans(data: bytes) -> list[tuple[int, int]]:
    """The spans of ``data`` behind a registered form found in one of its decoded views
    (none when it holds no escape)."""
    spans: list[tuple[int, int]] = []
    for view in views(data):
        orders = _orders(view.data)
        if not orders:
            continue
        needles = [form for entry in _entries(orders) for form in entry.raw]
        spans += (view.origin(start, stop) for start, stop in _spans(view.data, needles))
    return spans


def redact_value(value: Any, depth: int = 0) -> Any:
    """A copy of ``value`` with the values of sensitive keys (:func:`is_sensitive_key`)
    replaced in every mapping. A container nested more than :data:`MAX_REDACT_DEPTH`
    levels down is replaced whole (it is not searched, so it is not written either; the
    envelope's ``metadata`` is refused deeper than that)."""
    if depth > MAX_REDACT_DEPTH:
        return REDACTED if isinstance(value, dict | list) else value
    if isinstance(value, dict):
        return {
            k: REDACTED
            if isinstance(k, str) and is_sensitive_key(k)
            else redact_value(v, depth + 1)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [redact_value(v, depth + 1) for v in value]
    return value
