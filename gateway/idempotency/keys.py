"""Idempotency keys and request fingerprints (pure).

Both are SHA-256 over canonical JSON: UTF-8, keys sorted, no whitespace
(``separators=(",", ":")``), NaN and infinities refused. Canonical JSON here is not
RFC 8785 (JCS): numbers keep Python's JSON spelling, so ``500`` and ``500.0`` differ. An
agent that resends the same envelope (same trace_id, correlation_id, target, method,
endpoint and parameters) gets the same key and the same fingerprint; changing the
parameters keeps the key and changes the fingerprint, which the store reports as a
conflict.
"""

from __future__ import annotations

import hashlib
import json
from json.encoder import encode_basestring as _encode_str  # what json.dumps uses for str
from typing import Any, Final

__all__ = ["DERIVED_KEY_PREFIX", "canonical_json", "derive_key", "fingerprint", "store_key"]

#: Prefix of derived keys (versioned, so the derivation can change without collisions).
#: A derived key is this plus 64 hex digits: 69 characters, within Stripe's 255.
DERIVED_KEY_PREFIX: Final = "egw1-"


def canonical_json(value: Any) -> bytes:
    """``value`` as canonical JSON bytes. Raises ValueError for NaN/inf, TypeError for
    values JSON cannot hold."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


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
    keeps the fingerprint it always had)."""
    if query or body is not None:
        return hashlib.sha256(
            canonical_json(
                {
                    "target_system": target_system,
                    "method": method.upper(),
                    "endpoint": endpoint,
                    "parameters": parameters,
                    "query": query or {},
                    "body": body,
                }
            )
        ).hexdigest()
    # = canonical_json({"target_system": ..., "method": ..., "endpoint": ...,
    # "parameters": ...}): keys in sorted order, the strings by the stdlib's encoder.
    params = canonical_json(parameters)
    head = (
        '{"endpoint":' + _encode_str(endpoint) + ',"method":' + _encode_str(method.upper())
    ).encode("utf-8")
    tail = (',"target_system":' + _encode_str(target_system) + "}").encode("utf-8")
    return hashlib.sha256(head + b',"parameters":' + params + tail).hexdigest()


def store_key(target_system: str, idempotency_key: str) -> str:
    """The store's key for an idempotency key sent to a target: keys are scoped per
    target, as each upstream has its own key space (Stripe's is per account)."""
    return f"{target_system}:{idempotency_key}"  # target names cannot contain ":"
