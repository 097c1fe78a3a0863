"""The audit trail: ``log`` (structlog: operational lines and one audit record per call),
``schema`` (the record's fields, defined once), ``file`` (the rotating file sink) and
``query`` (the ``egress-gateway audit`` commands that read a log back)."""

from gateway.audit.log import (
    LOG_FORMATS,
    AuditLog,
    configure_logging,
    get_logger,
    new_sidecar_id,
    set_log_format,
)

__all__ = [
    "LOG_FORMATS",
    "AuditLog",
    "configure_logging",
    "get_logger",
    "new_sidecar_id",
    "set_log_format",
]
