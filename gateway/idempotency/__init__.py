"""Idempotency keys: derive them, fingerprint requests, and remember answers.

``keys`` is pure (key derivation, fingerprints); ``base`` is the store interface;
``memory`` the in-process store (``scope: local``), ``redis`` the shared one (``scope:
cluster``); ``scopes`` picks one by a target's scope.
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
from gateway.idempotency.scopes import IdempotencyStores

__all__ = [
    "Conflict",
    "IdempotencyStore",
    "IdempotencyStores",
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
