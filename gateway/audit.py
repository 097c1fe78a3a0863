"""Audit records and operational logs: structlog, JSON lines, redaction as a processor.

This module owns structlog. Everything the sidecar writes goes through the processor
chain configured here:

    add level -> UTC ISO 8601 timestamp -> redact sensitive keys -> traceback without
    locals -> JSON -> scrub known secret values -> the sink (stdout, or a file)

``get_logger()`` gives other modules an operational logger; ``AuditLog.call()`` writes
the one canonical audit record of a call (fields: :mod:`gateway.audit_schema`).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
from collections.abc import MutableMapping
from typing import IO, Any, Final

import structlog
from structlog.tracebacks import ExceptionDictTransformer
from structlog.types import EventDict, WrappedLogger

from gateway import redaction
from gateway.audit_schema import AUDIT_SCHEMA_VERSION, CALL_EVENT

SIDECAR_ID: Final = f"{socket.gethostname()}:{os.getpid()}"


class _Sink:
    """A swappable, line-buffered text sink shared by every logger (thread-safe)."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self._lock = threading.Lock()

    def msg(self, line: str) -> None:
        with self._lock:
            self.stream.write(line + "\n")
            self.stream.flush()

    # structlog calls the method named after the level.
    debug = info = warning = warn = error = critical = exception = fatal = log = msg


_sink = _Sink(sys.stdout)


def _redact_keys(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    for key in list(event_dict):
        if key.lower() in redaction.SENSITIVE_KEYS:
            event_dict[key] = redaction.REDACTED
    return event_dict


def _render(_: WrappedLogger, __: str, event_dict: EventDict) -> str:
    line = json.dumps(event_dict, ensure_ascii=False, separators=(",", ":"), default=str)
    return redaction.scrub(line)


def configure(stream: IO[str] | None = None, *, level: str = "info") -> None:
    """Route every log line to ``stream`` (default stdout). Safe to call again."""
    _sink.stream = stream if stream is not None else sys.stdout
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="timestamp"),
            _redact_keys,
            structlog.processors.ExceptionRenderer(ExceptionDictTransformer(show_locals=False)),
            _render,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level.upper()),
        logger_factory=lambda *_: _sink,
        cache_logger_on_first_use=True,
    )


def get_logger(name: str = "gateway") -> Any:
    """An operational logger (structlog BoundLogger) writing JSON lines to the sink."""
    return structlog.get_logger(component=name)


class AuditLog:
    """Writes audit records. ``call(record)`` writes the canonical per-call record."""

    def __init__(self, agent_id: str) -> None:
        self.agent_id = agent_id
        self._log = structlog.get_logger("audit")

    def call(self, record: MutableMapping[str, Any]) -> None:
        """Write one call record. ``record`` holds the call fields of ``AuditRecord``."""
        record["audit_schema"] = AUDIT_SCHEMA_VERSION
        record["sidecar_id"] = SIDECAR_ID
        level = "info" if record.get("success") else "warning"
        getattr(self._log, level)(CALL_EVENT, **record)

    def event(self, name: str, **fields: Any) -> None:
        """Write an audit event that is not a call (breaker state, policy reload...)."""
        self._log.info(name, sidecar_id=SIDECAR_ID, agent_id=self.agent_id, **fields)
