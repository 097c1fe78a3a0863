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

#: Keys whose values are replaced in audit and log records wherever they appear.
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
    }
)

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
    """A copy of ``value`` with the values of :data:`SENSITIVE_KEYS` replaced in every
    mapping, at any depth (up to :data:`MAX_REDACT_DEPTH` levels; below that, as is)."""
    if depth > MAX_REDACT_DEPTH:
        return value
    if isinstance(value, dict):
        return {
            k: REDACTED
            if isinstance(k, str) and k.lower() in SENSITIVE_KEYS
            else redact_value(v, depth + 1)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [redact_value(v, depth + 1) for v in value]
    return value
