"""Audit records and operational logs: structlog, JSON lines, redaction as a processor.

This module owns structlog. Everything the sidecar writes goes through one processor
chain:

    add level -> UTC ISO 8601 timestamp -> redact sensitive keys -> traceback without
    locals -> hash chain (audit records only, when enabled) -> JSON -> scrub known
    secret values -> the sink

Operational lines (``get_logger()``) go to the log stream (stdout by default). Audit
records (``AuditLog``) go to the audit sink: the same stream, or a size-rotated file
(``audit: {sink: file, path: ..., max_bytes: ..., backup_count: ...}``,
:mod:`gateway.audit.file`). Audit records
are written whatever the operational log level.

With ``audit.chain: true`` every audit record carries ``seq`` (1, 2, ... per sidecar
process), ``prev_hash`` (the previous record's ``hash``; :data:`GENESIS_HASH` for seq 1)
and ``hash`` = SHA-256 of :func:`gateway.audit.schema.canonical_bytes` of the record
without ``hash``. The chain runs on across rotated files; each ``configure*`` call starts
a new chain, like a restart. ``python -m gateway.audit.query verify`` checks it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
from collections.abc import Iterable, MutableMapping
from typing import IO, TYPE_CHECKING, Any, Final

from gateway import fastjson, redaction
from gateway.audit.file import RotatingFile
from gateway.audit.schema import (
    AUDIT_FIELDS,
    AUDIT_SCHEMA_VERSION,
    CALL_EVENT,
    GENESIS_HASH,
    canonical_text,
    hash_text,
)
from gateway.imports import without

# structlog imports rich when it is installed (for its ConsoleRenderer's tracebacks; the
# sidecar renders JSON): 3 MiB of RSS in every sidecar, so it is hidden while structlog loads.
with without("rich"):
    import structlog
    from structlog.tracebacks import ExceptionDictTransformer
    from structlog.types import EventDict, WrappedLogger

if TYPE_CHECKING:
    from gateway.policy import AuditSpec

SIDECAR_ID: Final = f"{socket.gethostname()}:{os.getpid()}"


class _Sink:
    """A swappable, line-buffered text sink: a stream, or a rotating file (thread-safe)."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.handler: RotatingFile | None = None
        self._lock = threading.Lock()

    def msg(self, line: str) -> None:
        if self.handler is not None:
            # It locks, rolls over before a line would reach max_bytes, flushes.
            self.handler.write(line)
            return
        with self._lock:
            self.stream.write(line + "\n")
            self.stream.flush()

    def to_stream(self, stream: IO[str]) -> None:
        self.close()
        self.stream = stream

    def to_file(self, path: str, max_bytes: int, backup_count: int) -> None:
        """Append to ``path``; past ``max_bytes`` (0: never) rename to ``path.1``..."""
        self.close()
        self.handler = RotatingFile(path, max_bytes, backup_count)

    def close(self) -> None:
        if self.handler is not None:
            self.handler.close()
            self.handler = None

    # structlog calls the method named after the level.
    debug = info = warning = warn = error = critical = exception = fatal = log = msg


_sink = _Sink(sys.stdout)
_audit_sink = _Sink(sys.stdout)


class _HashChain:
    """The processor that chains audit records (``seq``, ``prev_hash``, ``hash``)."""

    def __init__(self) -> None:
        self.enabled = False
        self._lock = threading.Lock()
        self._seq = 0
        self._prev = GENESIS_HASH

    def reset(self, *, enabled: bool) -> None:
        with self._lock:
            self.enabled = enabled
            self._seq = 0
            self._prev = GENESIS_HASH

    def __call__(self, logger: WrappedLogger, _: str, event_dict: EventDict) -> EventDict:
        if not self.enabled or logger is not _audit_sink:
            return event_dict
        if _has_non_str_keys(event_dict):
            # Only such keys change on the way through JSON (sorting 2 < 10 vs "10" < "2");
            # hash the record as a reader will parse it back.
            event_dict = json.loads(fastjson.log_line(event_dict))
        event_dict.pop("hash", None)
        with self._lock:
            self._seq += 1
            event_dict["seq"] = self._seq
            event_dict["prev_hash"] = self._prev
            # The renderer scrubs secret values from the line; hash what it will write.
            text = redaction.scrub(canonical_text(event_dict))
            self._prev = event_dict["hash"] = hash_text(text)
        return event_dict


def _has_non_str_keys(value: Any) -> bool:
    items = value.items() if isinstance(value, dict) else ((None, v) for v in value)
    for key, item in items:
        if isinstance(value, dict) and not isinstance(key, str):
            return True
        if isinstance(item, _CONTAINERS) and _has_non_str_keys(item):
            return True
    return False


_CONTAINERS: Final = (dict, list, tuple)
_NESTED: Final = (dict, list)


_chain = _HashChain()
# One AuditLog write at a time, so that seq order is file order.
_write_lock = threading.Lock()


def _redact_keys(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    _redact_fields(event_dict, list(event_dict))
    return event_dict


#: Audit record fields the schema types as scalars (str, int, float, bool or null): no
#: nested value and no sensitive name among them, so the audit processors search only
#: the others (``metadata``, ``warnings`` and any field of a non-call event).
_SCALAR_AUDIT_FIELDS: Final = frozenset(AUDIT_FIELDS) - {"metadata", "warnings"}


def _redact_audit_keys(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    _redact_fields(event_dict, event_dict.keys() - _SCALAR_AUDIT_FIELDS)
    return event_dict


def _redact_fields(event_dict: EventDict, keys: Iterable[str]) -> None:
    for key in keys:
        value = event_dict[key]
        if redaction.is_sensitive_key(key):
            event_dict[key] = redaction.REDACTED
        elif value and isinstance(value, _NESTED):
            # Nested values too: an agent's metadata may carry {"api_key": ...}.
            event_dict[key] = redaction.redact_value(value)


def _render(_: WrappedLogger, __: str, event_dict: EventDict) -> str:
    return redaction.scrub(fastjson.log_line(event_dict))


# Fixed once: cached loggers keep this list, so the switches live in _sink / _chain.
_PROCESSORS: Final[list[Any]] = [
    structlog.contextvars.merge_contextvars,
    structlog.processors.add_log_level,
    structlog.processors.TimeStamper(fmt="iso", utc=True, key="timestamp"),
    _redact_keys,
    structlog.processors.ExceptionRenderer(ExceptionDictTransformer(show_locals=False)),
    _chain,
    _render,
]
#: Audit records have a fixed schema (gateway.audit.schema): no context variables are
#: merged into them, and only the fields that may nest are searched for sensitive keys.
_AUDIT_PROCESSORS: Final[list[Any]] = [
    p if p is not _redact_keys else _redact_audit_keys for p in _PROCESSORS[1:]
]


def configure(stream: IO[str] | None = None, *, level: str = "info", chain: bool = False) -> None:
    """Route every log line and audit record to ``stream`` (default stdout).

    ``level`` filters operational lines only. ``chain`` turns on the audit hash chain
    (a new chain starts, seq 1). Safe to call again.
    """
    target = stream if stream is not None else sys.stdout
    _sink.to_stream(target)
    _audit_sink.to_stream(target)
    _apply(level, chain)


def configure_from_spec(
    spec: AuditSpec, stream: IO[str] | None = None, *, level: str = "info"
) -> None:
    """Configure from the policy's ``audit:`` block.

    Operational lines go to ``stream`` (default stdout). Audit records go there too with
    ``sink: stdout``; with ``sink: file`` they are appended to ``spec.path`` and rotated
    by size (as stdlib ``RotatingFileHandler`` does: past ``max_bytes`` the file becomes
    ``path.1``, older ones shift up to ``path.<backup_count>``; no ``max_bytes``: never
    rotated). ``spec.chain`` turns on the hash chain (a new chain starts). Raises
    ``OSError`` if the file cannot be opened.
    """
    target = stream if stream is not None else sys.stdout
    _sink.to_stream(target)
    if spec.sink == "file" and spec.path:
        _audit_sink.to_file(spec.path, spec.max_bytes or 0, spec.backup_count)
    else:
        _audit_sink.to_stream(target)
    _apply(level, spec.chain)


def close() -> None:
    """Close the audit file, if any (at shutdown); later records go to stdout."""
    _audit_sink.to_stream(sys.stdout)


def _apply(level: str, chain: bool) -> None:
    _chain.reset(enabled=chain)
    structlog.configure(
        processors=_PROCESSORS,
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
        self._log = structlog.wrap_logger(
            _audit_sink,
            processors=_AUDIT_PROCESSORS,
            wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        )

    def call(self, record: MutableMapping[str, Any]) -> None:
        """Write one call record. ``record`` holds the call fields of ``AuditRecord``."""
        record["audit_schema"] = AUDIT_SCHEMA_VERSION
        record["sidecar_id"] = SIDECAR_ID
        level = "info" if record.get("success") else "warning"
        with _write_lock:
            getattr(self._log, level)(CALL_EVENT, **record)

    def event(self, name: str, **fields: Any) -> None:
        """Write an audit event that is not a call (breaker state, policy reload...)."""
        with _write_lock:
            self._log.info(name, sidecar_id=SIDECAR_ID, agent_id=self.agent_id, **fields)
