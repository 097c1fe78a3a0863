"""Idempotency keys and request fingerprints (pure).

Both are SHA-256 over canonical JSON: UTF-8, keys sorted, no whitespace
(``separators=(",", ":")``), NaN and infinities refused. Canonical JSON here is not
RFC 8785 (JCS): numbers keep Python's JSON spelling, so ``500`` and ``500.0`` differ. An
agent that resends the same envelope (same trace_id, correlation_id, target, method,
endpoint and parameters) gets the same key and the same fingerprint; changing the
parameters keeps the key and changes the fingerprint, which the store reports as a
conflict.

The bytes are the stdlib's (``json.dumps``), whoever writes them: orjson where it writes
exactly the same (:func:`gateway.fastjson.sorted_compact`), else the stdlib's C encoder
called directly (``json.dumps`` builds a new encoder for every call), else ``json.dumps``
itself, which also gives every error. So a key or fingerprint is the same with or
without orjson installed, and the same as every earlier version computed: keys stored
in a shared Redis by an older sidecar still match.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from json.encoder import encode_basestring as _encode_str  # what json.dumps uses for str
from typing import Any, Final

from gateway.fastjson import sorted_compact

__all__ = [
    "DERIVED_KEY_PREFIX",
    "canonical_json",
    "derive_key",
    "fingerprint",
    "fingerprinted",
    "store_key",
]

#: Prefix of derived keys (versioned, so the derivation can change without collisions).
#: A derived key is this plus 64 hex digits: 69 characters, within Stripe's 255.
DERIVED_KEY_PREFIX: Final = "egw1-"


def _refuse(value: Any) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _c_encoder() -> Callable[[Any, int], list[str]] | None:
    """The stdlib's C encoder with :func:`canonical_json`'s settings, built once; None
    where the interpreter has none or it does not write what ``json.dumps`` writes."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # pragma: no cover - CPython always has it
        return None
    try:
        # No circular-reference markers (they would be shared between calls): a cycle
        # ends in RecursionError here, and json.dumps then gives its own error.
        encode: Callable[[Any, int], list[str]] = make(
            None, _refuse, _encode_str, None, ":", ",", True, False, False
        )
        sample = {"b": [1, 2.5, -0.0, 1e-07, None, True], "a": 'é"\\n\u2028'}
        if "".join(encode(sample, 0)) != _stdlib(sample):
            return None  # pragma: no cover - another interpreter's encoder
    except Exception:  # noqa: BLE001 - pragma: no cover - a changed signature: not used
        return None
    return encode


def _stdlib(value: Any) -> str:
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


_ENCODE: Final = _c_encoder()


def canonical_json(value: Any) -> bytes:
    """``value`` as canonical JSON bytes: ``json.dumps(value, sort_keys=True, separators=
    (",", ":"), ensure_ascii=False, allow_nan=False)`` in UTF-8 (see the module
    docstring for who writes them). Raises ValueError for NaN/inf (UnicodeEncodeError
    for a lone surrogate), TypeError for values JSON cannot hold, RecursionError past
    the interpreter's depth: json.dumps' own errors."""
    fast = sorted_compact(value)
    if fast is not None:
        return fast
    if _ENCODE is not None:
        try:
            return "".join(_ENCODE(value, 0)).encode("utf-8")
        except (ValueError, TypeError, RecursionError):
            pass  # json.dumps raises the same, with its own message
    return _stdlib(value).encode("utf-8")


def derive_key(
    trace_id: str, correlation_id: str, target_system: str, method: str, endpoint: str
) -> str:
    """The idempotency key of an envelope that gives none: the same transaction and
    operation give the same key. ``method`` is compared case-insensitively."""
    parts = (trace_id, correlation_id, target_system, method.upper(), endpoint)
    # = canonical_json(list(parts)), built from the stdlib's own string encoder.
    text = "[" + ",".join(map(_encode_str, parts)) + "]"
    return DERIVED_KEY_PREFIX + hashlib.sha256(text.encode("utf-8")).hexdigest()


def fingerprint(
    target_system: str,
    method: str,
    endpoint: str,
    parameters: Any,
    *,
    query: Any = None,
    body: Any = None,
) -> str:
    """SHA-256 hex of the request a key stands for (target, method, endpoint, parameters,
    and the envelope's ``query`` and ``body`` when it has them: an envelope without them
    keeps the fingerprint it always had): of :func:`fingerprinted`'s bytes."""
    data = fingerprinted(target_system, method, endpoint, parameters, query=query, body=body)
    return hashlib.sha256(data).hexdigest()


def fingerprinted(
    target_system: str,
    method: str,
    endpoint: str,
    parameters: Any,
    *,
    query: Any = None,
    body: Any = None,
) -> bytes:
    """The canonical JSON bytes :func:`fingerprint` hashes (its arguments); raises what
    :func:`canonical_json` raises."""
    if query or body is not None:
        return canonical_json(
            {
                "target_system": target_system,
                "method": method.upper(),
                "endpoint": endpoint,
                "parameters": parameters,
                "query": query or {},
                "body": body,
            }
        )
    # = canonical_json({"target_system": ..., "method": ..., "endpoint": ...,
    # "parameters": ...}): keys in sorted order, the strings by the stdlib's encoder.
    params = canonical_json(parameters)
    head = (
        '{"endpoint":' + _encode_str(endpoint) + ',"method":' + _encode_str(method.upper())
    ).encode("utf-8")
    tail = (',"target_system":' + _encode_str(target_system) + "}").encode("utf-8")
    return b"".join((head, b',"parameters":', params, tail))


def store_key(target_system: str, idempotency_key: str) -> str:
    """The store's key for an idempotency key sent to a target: keys are scoped per
    target, as each upstream has its own key space (Stripe's is per account)."""
    return f"{target_system}:{idempotency_key}"  # target names cannot contain ":"
