"""Scrubbing of secret values from any text the sidecar writes (pure, no I/O).

Every :class:`gateway.secrets.Secret` registers its value here when it is created. The
audit renderer and the answer writer pass their final text through :func:`scrub`, so a
secret that reached a message by accident (an upstream echoing the key, an exception
carrying a URL with ``?key=...``) still never leaves the process. It is the second line
of defence: the first is never putting a value into text at all.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Final

REDACTED: Final = "[REDACTED]"
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


_lock = threading.Lock()
_values: OrderedDict[str, tuple[str, ...]] = OrderedDict()


def register(value: str) -> None:
    """Remember ``value`` (and its JSON-escaped form) so that :func:`scrub` removes it."""
    if len(value) < MIN_SCRUB_LENGTH:
        return
    with _lock:
        if value in _values:
            _values.move_to_end(value)
            return
        # Both escapings: the audit renderer writes non-ASCII as is (ensure_ascii=False).
        forms = {value, json.dumps(value)[1:-1], json.dumps(value, ensure_ascii=False)[1:-1]}
        for piece in list(forms):
            forms.add(piece.replace("/", "\\/"))
        _values[value] = tuple(f for f in forms if len(f) >= MIN_SCRUB_LENGTH)
        while len(_values) > _MAX_TRACKED:
            _values.popitem(last=False)


def scrub(text: str) -> str:
    """``text`` with every registered secret value replaced by ``[REDACTED]``."""
    if not _values:
        return text
    for forms in tuple(_values.values()):
        for form in forms:
            if form in text:
                text = text.replace(form, REDACTED)
    return text


def scrub_cut(text: str, limit: int) -> str:
    """``text`` scrubbed, then cut to ``limit`` characters, with any start of a secret
    left at the cut masked too (cutting first would leave all but its tail visible)."""
    text = scrub(text)
    if len(text) <= limit:
        return text
    text = text[:limit]
    for forms in tuple(_values.values()):
        for form in forms:
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
    """:func:`scrub` for UTF-8 encoded text (the answer and audit line writers)."""
    if not _values:
        return data
    for forms in tuple(_values.values()):
        for form in forms:
            raw = form.encode()
            if raw in data:
                data = data.replace(raw, REDACTED.encode())
    return data


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
