"""Idempotency keys: derive them, fingerprint requests, and remember answers.

``keys`` is pure (key derivation, fingerprints); ``base`` is the store interface;
``memory`` the in-process store (a Redis store implements the same interface).
"""

from gateway.idempotency.base import (
    Conflict,
    IdempotencyStore,
    InFlight,
    Outcome,
    Proceed,
    Replay,
)
from gateway.idempotency.keys import canonical_json, derive_key, fingerprint, store_key
from gateway.idempotency.memory import MemoryIdempotencyStore

__all__ = [
    "Conflict",
    "IdempotencyStore",
    "InFlight",
    "MemoryIdempotencyStore",
    "Outcome",
    "Proceed",
    "Replay",
    "canonical_json",
    "derive_key",
    "fingerprint",
    "store_key",
]
