"""The audit record: one JSON line per outbound call (schema version 1).

This is the documented, versioned shape operators audit (see ``docs/audit.md``). Field
names are defined once here; the writer (:mod:`gateway.audit`) and the query tool import
them. Fields may be added in a minor change; a renamed or removed field bumps
``AUDIT_SCHEMA_VERSION``.

Units: ``*_ms`` are milliseconds (float), ``*_bytes`` bytes, token counts are integers,
``timestamp`` is ISO 8601 in UTC with a ``Z`` suffix, the time the call finished.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict

AUDIT_SCHEMA_VERSION: Final = 1
CALL_EVENT: Final = "egress_call"
BREAKER_EVENT: Final = "breaker_state_change"

#: ``prev_hash`` of the first record of a chain (``seq`` 1): 64 zero hex digits.
GENESIS_HASH: Final = "0" * 64

Decision = Literal["allowed", "denied", "invalid", "replayed"]


class AuditRecord(BaseModel):
    """One outbound call, written once when the call ends, whatever its outcome."""

    model_config = ConfigDict(extra="forbid", strict=True)

    audit_schema: Literal[1]
    event: Literal["egress_call"]
    timestamp: str
    level: str
    sidecar_id: str
    agent_id: str
    trace_id: str | None
    correlation_id: str | None
    target_system: str | None
    endpoint: str | None
    method: str | None
    upstream: str | None  # scheme://host:port only: never a path, query or credential
    decision: Decision
    success: bool
    status_code: int | None
    error_code: str | None
    retryable: bool | None
    attempts: int
    latency_ms: float
    upstream_latency_ms: float | None
    tokens_used: int | None
    tokens_input: int | None
    tokens_output: int | None
    tokens_cached: int | None
    request_bytes: int
    request_sha256: str | None
    response_bytes: int | None
    api_key_ref: str | None  # the reference, never the value
    rate_limit_group: str | None
    rate_limit_wait_ms: float
    idempotency_key: str | None
    replayed: bool
    warnings: list[str]
    metadata: dict[str, Any]
    # W3C traceparent sent upstream (trace-id and this call's parent-id); added in 1.x.
    traceparent: str | None = None
    # Present only with audit.chain: true (tamper evidence, per sidecar).
    seq: int | None = None
    prev_hash: str | None = None
    hash: str | None = None


AUDIT_FIELDS: Final = tuple(AuditRecord.model_fields)


def canonical_text(record: Mapping[str, Any]) -> str:
    """The canonical serialization the chain hashes: ``record`` without ``hash``.

    JSON with keys sorted, no whitespace, ASCII only (non-ASCII as ``\\uXXXX``), floats
    as Python's shortest round-trip repr, other objects as ``str()``:
    ``json.dumps(..., sort_keys=True, separators=(",", ":"), ensure_ascii=True,
    default=str)``. A record parsed back from its JSON line gives the same text.
    """
    body = {k: v for k, v in record.items() if k != "hash"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)


def hash_text(canonical: str) -> str:
    """SHA-256 (hex, 64 chars) of a :func:`canonical_text` (ASCII)."""
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def record_hash(record: Mapping[str, Any]) -> str:
    """The chain ``hash`` a record should carry: :func:`hash_text` of its canonical text."""
    return hash_text(canonical_text(record))
