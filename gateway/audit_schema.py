"""The audit record: one JSON line per outbound call (schema version 1).

This is the documented, versioned shape operators audit (see ``docs/audit.md``). Field
names are defined once here; the writer (:mod:`gateway.audit`) and the query tool import
them. Fields may be added in a minor change; a renamed or removed field bumps
``AUDIT_SCHEMA_VERSION``.

Units: ``*_ms`` are milliseconds (float), ``*_bytes`` bytes, token counts are integers,
``timestamp`` is ISO 8601 in UTC with a ``Z`` suffix, the time the call finished.
"""

from __future__ import annotations

from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict

AUDIT_SCHEMA_VERSION: Final = 1
CALL_EVENT: Final = "egress_call"

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
    # Present only with audit.chain: true (tamper evidence, per sidecar).
    seq: int | None = None
    prev_hash: str | None = None
    hash: str | None = None


AUDIT_FIELDS: Final = tuple(AuditRecord.model_fields)
