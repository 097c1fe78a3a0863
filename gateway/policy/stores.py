"""The policy's sections for the services the sidecar itself uses: Vault (``secrets``),
Redis (``redis``) and the audit sink (``audit``); and the strict base of every policy
model (unknown keys are errors, strict types, frozen)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.policy import defaults as d


class StrictModel(BaseModel):
    # defer_build: a section's own validator is compiled only when it is used on its own
    # (a default instance, a direct validation); the policy's validator holds every
    # section's rules anyway. Compiling each of ~60 models at import cost ~0.4 MiB of
    # resident memory in every sidecar for validators nothing called.
    model_config = ConfigDict(
        extra="forbid", frozen=True, strict=True, allow_inf_nan=False, defer_build=True
    )


class VaultAuthSpec(StrictModel):
    method: Literal["token", "kubernetes", "approle"] = "token"
    token_file: str | None = None
    role: str | None = None
    jwt_path: str = d.DEFAULT_K8S_JWT_PATH
    mount_path: str | None = None
    role_id_file: str | None = None
    secret_id_file: str | None = None

    @model_validator(mode="after")
    def _needs(self) -> VaultAuthSpec:
        if self.method == "kubernetes" and not self.role:
            raise ValueError("kubernetes auth needs 'role'")
        return self


class VaultRefSpec(StrictModel):
    """An explicit mapping of one vault:// ref to a mount, KV version, path and field."""

    mount: str | None = None
    kv_version: Literal[1, 2] | None = None
    path: str
    field: str | None = None


class VaultSpec(StrictModel):
    address: str | None = None
    namespace: str | None = None
    auth: VaultAuthSpec = Field(default_factory=VaultAuthSpec)
    kv_mount: str = "secret"
    kv_version: Literal[1, 2] = 2
    refs: dict[str, VaultRefSpec] = Field(default_factory=dict)
    cache_ttl_s: float = Field(d.DEFAULT_VAULT_CACHE_TTL_S, ge=0, le=d.MAX_VAULT_CACHE_TTL_S)
    stale_if_error_s: float = Field(
        d.DEFAULT_VAULT_STALE_IF_ERROR_S, ge=0, le=d.MAX_VAULT_STALE_IF_ERROR_S
    )
    timeout_s: float = Field(d.DEFAULT_VAULT_TIMEOUT_S, gt=0, le=d.MAX_VAULT_TIMEOUT_S)
    ca_cert: str | None = None
    skip_verify: bool = False


class SecretsSpec(StrictModel):
    vault: VaultSpec | None = None


class RedisSpec(StrictModel):
    url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "egress"
    pool_size: int = Field(32, ge=1, le=d.MAX_REDIS_POOL_SIZE)
    socket_timeout_s: float = Field(d.DEFAULT_REDIS_TIMEOUT_S, gt=0, le=d.MAX_REDIS_TIMEOUT_S)
    connect_timeout_s: float = Field(d.DEFAULT_REDIS_TIMEOUT_S, gt=0, le=d.MAX_REDIS_TIMEOUT_S)


class AuditOtlpSpec(StrictModel):
    """``audit.otlp``: ship every audit line to an OpenTelemetry collector (OTLP/HTTP
    logs), beside the file or stdout sink, through a bounded on-disk spool. Headers
    (a collector's token) come from OTEL_EXPORTER_OTLP_LOGS_HEADERS, never the policy."""

    endpoint: str = Field(pattern=r"^https?://[^\s]+$")  # e.g. http://otel-collector:4318/v1/logs
    timeout_s: float = Field(d.DEFAULT_AUDIT_OTLP_TIMEOUT_S, gt=0, le=d.MAX_AUDIT_OTLP_TIMEOUT_S)
    spool_path: str = d.DEFAULT_AUDIT_SPOOL_PATH
    spool_max_bytes: int = Field(
        d.DEFAULT_AUDIT_SPOOL_BYTES, ge=d.MIN_AUDIT_SPOOL_BYTES, le=d.MAX_AUDIT_SPOOL_BYTES
    )


class AuditSpec(StrictModel):
    sink: Literal["stdout", "file"] = "stdout"
    otlp: AuditOtlpSpec | None = None
    path: str | None = None
    payloads: Literal["none", "summary"] = "summary"
    chain: bool = False
    max_bytes: int | None = Field(None, ge=4096, le=d.MAX_AUDIT_FILE_BYTES)
    backup_count: int = Field(5, ge=0, le=d.MAX_AUDIT_BACKUPS)

    @model_validator(mode="after")
    def _file_needs_path(self) -> AuditSpec:
        if self.sink == "file" and not self.path:
            raise ValueError("sink 'file' needs 'path'")
        return self
