"""Audit records and operational logs: structlog, JSON lines, redaction as a processor.

This module owns structlog. Everything the sidecar writes goes through one processor
chain:

    add level -> UTC ISO 8601 timestamp -> redact sensitive keys -> traceback without
    locals -> JSON -> scrub known secret values -> hash chain (audit records only, when
    enabled) -> the sink

Operational lines (``get_logger()``) have one configuration for the process
(:func:`configure_logging`: their stream and level), as structlog's configuration is
global. So has the log format (:func:`set_log_format`): ``json`` (the default, for
collectors) or ``console``, structlog's ConsoleRenderer for a person at a terminal: one
readable line per call (target, method, endpoint, status or code, latency, tokens, cost,
trace) and per event. Console lines are scrubbed of secrets like JSON ones; an audit
*file* is always JSON, and a hash chain is computed over the JSON line all the same.
Audit records belong to an :class:`AuditLog`, which owns its sink (the stream it is
given, or a size-rotated file: ``audit: {sink: file, path: ..., max_bytes: ...,
backup_count: ...}``, :mod:`gateway.audit.file`), its ``sidecar_id`` and its hash chain:
two gateways in one process write two audit streams. Audit records are written whatever
the operational log level.

With ``audit.chain: true`` every audit record carries ``seq`` (1, 2, ... per AuditLog,
that is per sidecar start), ``prev_hash`` (the previous record's ``hash``;
:data:`GENESIS_HASH` for seq 1) and ``hash`` = SHA-256 of
:func:`gateway.audit.schema.canonical_text` of the record without ``hash``, *as a
reader parses the written line back* (so every value the writer emits, integers past 64
bits, floats in either spelling, escaped lone surrogates, non-string keys, verifies).
The chain runs on across rotated files. A start that appends to an audit file whose
last line is a chained record first writes an ``audit_chain_continued`` event whose
``prev_hash`` is that record's hash (and names it: ``prev_sidecar_id``, ``prev_seq``),
so that records cut from before a restart are detectable; every record of that start
carries that hash too (``chain_start``), so that records cut from its own beginning
are detectable as well. ``egress-gateway audit verify`` checks it all.
"""

from __future__ import annotations

import datetime
import logging
import os
import secrets
import socket
import sys
import threading
from collections.abc import Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, Final

from gateway import fastjson, redaction
from gateway.audit.file import RotatingFile, last_line
from gateway.audit.held import HELD_RECORDS
from gateway.audit.schema import (
    AUDIT_FIELDS,
    AUDIT_SCHEMA_VERSION,
    CALL_EVENT,
    CHAIN_CONTINUED_EVENT,
    CHAIN_FIELDS,
    GENESIS_HASH,
    PREV_SEQ,
    PREV_SIDECAR_ID,
    Fields,
    canonical_text,
    hash_text,
)
from gateway.imports import without

# structlog imports rich when it is installed (for its ConsoleRenderer's tracebacks; the
# sidecar renders JSON): 3 MiB of RSS in every sidecar, so it is hidden while structlog loads.
# So is colorama (and the ctypes it loads, 0.4 MiB): structlog needs it for colours on
# Windows only; elsewhere its ConsoleRenderer writes the same ANSI codes without it.
with without("rich", "colorama"):
    import structlog
    from structlog.tracebacks import ExceptionDictTransformer
    from structlog.types import EventDict, WrappedLogger

if TYPE_CHECKING:
    from types import TracebackType

    from gateway.policy import AuditSpec


def new_sidecar_id() -> str:
    """A ``sidecar_id`` unique to one start: ``hostname:pid:8 hex digits`` (random).

    A container restart keeps the hostname and, as PID 1, the pid: the random part keeps
    two starts' chains apart (``verify`` follows one chain per ``sidecar_id``).
    """
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


class _Sink:
    """A swappable, line-buffered text sink: a stream, or a rotating file (thread-safe)."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.handler: RotatingFile | None = None
        #: Where every line also goes (audit.otlp's spool), after the sink has it.
        self.tee: Callable[[str], None] | None = None
        self._lock = threading.Lock()

    def msg(self, line: str) -> None:
        if self.handler is not None:
            # It locks, rolls over before a line would reach max_bytes, flushes.
            self.handler.write(line)
        else:
            with self._lock:
                self.stream.write(line + "\n")
                self.stream.flush()
        if self.tee is not None:
            self.tee(line)

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


#: Operational lines: one stream for the process (structlog's configuration is global).
_ops_sink = _Sink(sys.stdout)


@dataclass(frozen=True, slots=True)
class _Link:
    """The chained record an audit file ended with, which a new start continues."""

    sidecar_id: str
    seq: int
    hash: str


def _file_link(path: str) -> _Link | None:
    """The chained audit record that ends the file ``path``, if it ends with one."""
    raw = last_line(path)
    if raw is None:
        return None
    try:
        record = fastjson.loads(raw)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    sidecar, seq, digest = (record.get(k) for k in (Fields.SIDECAR_ID, Fields.SEQ, Fields.HASH))
    if isinstance(sidecar, str) and type(seq) is int and isinstance(digest, str):
        return _Link(sidecar, seq, digest)
    return None


def _render_json(_: WrappedLogger, __: str, event_dict: EventDict) -> str:
    return _render_line(event_dict)


class _ConsoleAfterChain:
    """A chained record shown on a terminal: the chain advances over the JSON line (so
    ``seq`` and ``hash`` stay right), and the readable line is what is written."""

    def __init__(self, chain: _HashChain) -> None:
        self._chain = chain

    def __call__(self, logger: WrappedLogger, name: str, event_dict: EventDict) -> str:
        self._chain(logger, name, event_dict)
        return _console_line(logger, name, event_dict)


class _HashChain:
    """The last processor of a chained AuditLog: renders the line, adds ``seq``,
    ``prev_hash`` and the ``hash`` of the line as a reader parses it back.

    Called under the AuditLog's write lock (seq order is file order).
    """

    def __init__(self, link: _Link | None) -> None:
        self._seq = 0
        self._prev = link.hash if link is not None else GENESIS_HASH
        # In every record: the record this start continued (genesis for none), so that
        # deleting its first records (its continued event included) still leaves a
        # record that names what came before it.
        self._start = self._prev

    def __call__(self, _: WrappedLogger, __: str, event_dict: EventDict) -> str:
        for key in CHAIN_FIELDS:
            event_dict.pop(key, None)  # the chain's, never a caller's
        seq = self._seq + 1
        event_dict[Fields.SEQ] = seq
        event_dict[Fields.PREV_HASH] = self._prev
        event_dict[Fields.CHAIN_START] = self._start
        line = _render_line(event_dict)
        digest = hash_text(canonical_text(_read_back(line)))
        # Only now: a record that could not be rendered leaves no gap in the chain.
        self._seq, self._prev = seq, digest
        # The line ends with the object's "}"; seq makes it non-empty, so a comma is right.
        return f'{line[:-1]},"{Fields.HASH}":"{digest}"}}'


def _read_back(line: str) -> dict[str, Any]:
    """``line`` as a reader parses it (:func:`gateway.fastjson.loads`, exact)."""
    try:
        parsed = fastjson.loads(line.encode("utf-8"))
    except ValueError:  # UnicodeEncodeError too
        parsed = None
    if isinstance(parsed, dict):
        return parsed
    # Not JSON after scrubbing (a secret value that cut an escape in two): readers report
    # the line as malformed whatever it carries, so any hash will do; this one is defined.
    return {"unparsed_line": line}


_NESTED: Final = (dict, list)


def _redact_keys(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    _redact_fields(event_dict, list(event_dict))
    return event_dict


#: Audit record fields the schema types as scalars (str, int, float, bool or null): no
#: nested value and no sensitive name among them, so the audit processors search only
#: the others (``metadata``, ``warnings`` and any field of a non-call event).
_SCALAR_AUDIT_FIELDS: Final = frozenset(AUDIT_FIELDS) - {Fields.METADATA, Fields.WARNINGS}


#: Every field of the schema, and those of them that may nest.
_AUDIT_FIELD_SET: Final = frozenset(AUDIT_FIELDS)
_NESTED_AUDIT_FIELDS: Final = (Fields.METADATA, Fields.WARNINGS)


def _redact_audit_keys(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    if _AUDIT_FIELD_SET.issuperset(event_dict):
        # A record of schema fields only (every call record): the same keys as the set
        # difference below, without building a set of the record's ~80 keys for it.
        _redact_fields(event_dict, [k for k in _NESTED_AUDIT_FIELDS if k in event_dict])
    else:
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


def _render_line(event_dict: EventDict) -> str:
    return redaction.scrub(fastjson.log_line(event_dict))


def _render(logger: WrappedLogger, name: str, event_dict: EventDict) -> str:
    if _console is not None:
        return _console_line(logger, name, event_dict)
    return _render_line(event_dict)


#: The log formats of :func:`set_log_format` (``serve --log-format``, GATEWAY_LOG_FORMAT).
LOG_FORMATS: Final = ("json", "console")
#: The console renderer when the format is ``console``; None renders JSON.
_console: structlog.dev.ConsoleRenderer | None = None
#: Fields a console line leaves out: the machine's (schema, chain, ids of the process).
_CONSOLE_HIDDEN: Final = frozenset(
    {Fields.AUDIT_SCHEMA, Fields.SIDECAR_ID, Fields.AGENT_ID, *CHAIN_FIELDS, "component"}
)


def set_log_format(log_format: str, *, colors: bool = False) -> None:
    """``json`` (one JSON line per record) or ``console`` (one readable line, with ANSI
    colours when ``colors``) for every line written to a stream from now on: a process
    setting, like structlog's configuration, set by ``serve`` before the sidecar starts.
    Raises ValueError for another format."""
    global _console
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be json or console, not {log_format!r}")
    _console = (
        structlog.dev.ConsoleRenderer(colors=colors, sort_keys=False, pad_event_to=0)
        if log_format == "console"
        else None
    )


def _console_line(logger: WrappedLogger, name: str, event_dict: EventDict) -> str:
    """One readable line: a call as ``target METHOD endpoint -> status`` and its figures,
    any other event with its fields but the machine's."""
    assert _console is not None
    if event_dict.get(Fields.EVENT) == CALL_EVENT:
        event_dict = _call_summary(event_dict)
    else:
        event_dict = {k: v for k, v in event_dict.items() if k not in _CONSOLE_HIDDEN}
    return redaction.scrub(str(_console(logger, name, event_dict)))


def _call_summary(record: EventDict) -> EventDict:
    target = record.get(Fields.TARGET_SYSTEM) or "-"
    method = record.get(Fields.METHOD) or record.get(Fields.HTTP_METHOD) or "-"
    endpoint = record.get(Fields.ENDPOINT) or record.get(Fields.HTTP_PATH) or "-"
    status = record.get(Fields.STATUS_CODE) or record.get(Fields.HTTP_STATUS)
    outcome = record.get(Fields.ERROR_CODE) or ("ok" if record.get(Fields.SUCCESS) else "-")
    line: EventDict = {
        Fields.TIMESTAMP: record.get(Fields.TIMESTAMP),
        Fields.LEVEL: record.get(Fields.LEVEL),
        Fields.EVENT: f"{target} {method} {endpoint} -> {status or '-'} {outcome}",
    }
    shown = (
        Fields.DECISION,
        Fields.LATENCY_MS,
        Fields.TOKENS_USED,
        Fields.COST_USD,
        Fields.ATTEMPTS,
        Fields.REPLAYED,
        Fields.TRACE_ID,
    )
    for key in shown:
        value = record.get(key)
        if value is None or value is False or (key == Fields.DECISION and value == "allowed"):
            continue
        if key == Fields.ATTEMPTS and value in (0, 1):
            continue
        line[key] = value
    return line


_now: Final = datetime.datetime.now
_UTC: Final = datetime.UTC
_TIMESTAMPER: Final = structlog.processors.TimeStamper(fmt="iso", utc=True, key=Fields.TIMESTAMP)
_EXCEPTIONS: Final = structlog.processors.ExceptionRenderer(
    ExceptionDictTransformer(show_locals=False)
)
# Fixed once: cached loggers keep this list, so the switch lives in _ops_sink.
_PROCESSORS: Final[list[Any]] = [
    structlog.contextvars.merge_contextvars,
    structlog.processors.add_log_level,
    _TIMESTAMPER,
    _redact_keys,
    _EXCEPTIONS,
    _render,
]


def configure_logging(stream: IO[str] | None = None, *, level: str = "info") -> None:
    """Route operational lines (:func:`get_logger`) of the whole process to ``stream``
    (default stdout); ``level`` filters them. Audit records are not affected (each
    :class:`AuditLog` has its own sink). Safe to call again."""
    _ops_sink.to_stream(stream if stream is not None else sys.stdout)
    structlog.configure(
        processors=_PROCESSORS,
        wrapper_class=structlog.make_filtering_bound_logger(level.upper()),
        logger_factory=lambda *_: _ops_sink,
        cache_logger_on_first_use=True,
    )


def get_logger(name: str = "gateway") -> Any:
    """An operational logger (structlog BoundLogger) writing JSON lines to the sink."""
    return structlog.get_logger(component=name)


class AuditLog:
    """The audit trail of one sidecar start: its sink, its ``sidecar_id``, its hash chain.

    ``spec`` is the policy's ``audit:`` block: with ``sink: stdout`` records go to
    ``stream`` (default stdout, not closed here); with ``sink: file`` they are appended to
    ``spec.path`` and rotated by size (as stdlib ``RotatingFileHandler`` does: past
    ``max_bytes`` the file becomes ``path.1``, older ones shift up to
    ``path.<backup_count>``; no ``max_bytes``: never rotated). With ``spec.otlp`` every
    line is also shipped to an OpenTelemetry collector (:mod:`gateway.audit.otlp`).
    ``spec.chain`` turns on the hash chain (seq 1 at construction). ``agent_id`` goes into
    events;
    ``sidecar_id`` defaults to :func:`new_sidecar_id`. Raises ``OSError`` if the file
    cannot be opened.

    ``call(record)`` writes the canonical per-call record, ``event(name, ...)`` any other
    audit event; neither raises for an I/O error (reported on stderr). :meth:`close` (or
    ``await aclose()``, or ``async with``) closes the file, once; records written after
    it go to stdout, never lost and never into a reopened file.
    """

    def __init__(
        self,
        spec: AuditSpec,
        stream: IO[str] | None = None,
        *,
        agent_id: str,
        sidecar_id: str | None = None,
    ) -> None:
        self.agent_id = agent_id
        self.sidecar_id = sidecar_id or new_sidecar_id()
        self._sink = _Sink(stream if stream is not None else sys.stdout)
        # One write at a time, so that seq order is file order.
        self._lock = threading.Lock()
        link = None
        if spec.sink == "file" and spec.path:
            if spec.chain:
                link = _file_link(spec.path)  # before the sink may add a newline to it
            self._sink.to_file(spec.path, spec.max_bytes or 0, spec.backup_count)
        self._otlp = None
        if spec.otlp is not None:
            from gateway.audit.otlp import OtlpShipper  # opentelemetry: only when asked

            self._otlp = OtlpShipper(spec.otlp)
            self._sink.tee = self._otlp.ship
        # An audit file is for machines: always JSON. A stream is rendered in the format
        # of the process (set_log_format), a chained record after its hash is taken.
        on_stream = spec.sink == "stdout"
        last: Any = _render if on_stream else _render_json
        if spec.chain:
            last = _HashChain(link)
            if on_stream and _console is not None:
                last = _ConsoleAfterChain(last)
        self._last = last
        # Audit records have a fixed schema (gateway.audit.schema): no context variables
        # are merged into them, and only the fields that may nest are searched for
        # sensitive keys.
        self._log = structlog.wrap_logger(
            self._sink,
            processors=[
                structlog.processors.add_log_level,
                _TIMESTAMPER,
                _redact_audit_keys,
                _EXCEPTIONS,
                last,
            ],
            wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        )
        if link is not None:
            self.event(
                CHAIN_CONTINUED_EVENT, **{PREV_SIDECAR_ID: link.sidecar_id, PREV_SEQ: link.seq}
            )

    def call(self, record: MutableMapping[str, Any]) -> None:
        """Write one call record. ``record`` holds the call fields of ``AuditRecord``.
        While a request's answer is being written its records are held, and written
        (:meth:`write_call`) once it is (:mod:`gateway.audit.held`): then they say what
        the caller got."""
        waiting = HELD_RECORDS.get()
        if waiting is not None and waiting.open:
            waiting.records.append((self.write_call, record))
            return
        self.write_call(record)

    def write_call(self, record: MutableMapping[str, Any]) -> None:
        """Write one call record now (:meth:`call`, unless it is held)."""
        record[Fields.AUDIT_SCHEMA] = AUDIT_SCHEMA_VERSION
        record[Fields.SIDECAR_ID] = self.sidecar_id
        level = "info" if record.get(Fields.SUCCESS) else "warning"
        # The same processors as the structlog chain of event(), called directly: a call
        # record is built once by the pipeline with the schema's fields, so it needs no
        # copy into an event dict and no bound-logger dispatch (~20 us of the ~32 us a
        # record cost through structlog; docs/performance.md). The line is the same.
        record[Fields.EVENT] = CALL_EVENT
        record[Fields.LEVEL] = level
        with self._lock:
            # What _TIMESTAMPER writes (structlog's ISO UTC stamp), without its three frames.
            record[Fields.TIMESTAMP] = _now(_UTC).isoformat().replace("+00:00", "Z")
            _redact_audit_keys(self._sink, level, record)
            if "exc_info" in record:  # never from the pipeline; as structlog would render it
                _EXCEPTIONS(self._sink, level, record)
            self._sink.msg(self._last(self._sink, level, record))

    def event(self, name: str, **fields: Any) -> None:
        """Write an audit event that is not a call (breaker state, policy reload...).

        ``agent_id`` defaults to this log's."""
        record = {Fields.SIDECAR_ID: self.sidecar_id, Fields.AGENT_ID: self.agent_id, **fields}
        record[Fields.SIDECAR_ID] = self.sidecar_id
        with self._lock:
            self._log.info(name, **record)

    @property
    def shipping(self) -> tuple[int, int] | None:
        """With ``audit.otlp``: (lines dropped from the full spool so far, bytes spooled
        and not yet accepted by the collector); None without it."""
        otlp = self._otlp
        if otlp is None:
            return None
        return otlp.spool.dropped, otlp.spool.pending_bytes

    @property
    def write_failures(self) -> int:
        """Audit lines the file sink could not write so far (0 for stdout)."""
        handler = self._sink.handler
        return handler.failures if handler is not None else 0

    def close(self) -> None:
        """Close the audit file, if any (idempotent); later records go to stdout."""
        with self._lock:
            if self._sink.handler is not None:
                self._sink.to_stream(sys.stdout)
            otlp, self._otlp, self._sink.tee = self._otlp, None, None
        if otlp is not None:
            otlp.close()  # ships what is spooled, for a bounded time; the rest stays spooled

    async def aclose(self) -> None:
        """:meth:`close`, for an ``AsyncExitStack``."""
        self.close()

    async def __aenter__(self) -> AuditLog:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
