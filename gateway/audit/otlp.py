"""The OTLP logs sink of the audit trail (``audit.otlp``): every audit line, beside the
file or stdout sink, shipped to an OpenTelemetry collector over OTLP/HTTP with the
OpenTelemetry SDK's log exporter, at least once.

Lines go to a bounded on-disk spool first (:mod:`gateway.audit.spool`); one thread ships
them in batches and removes a batch only once the collector accepted it, retrying with
backoff (:data:`BACKOFF_MIN_S` doubling to :data:`BACKOFF_MAX_S`) while it is down. So a
collector outage loses nothing the spool can hold, and a restart of the sidecar resumes
from the spool. Each OTLP log record's body is the audit line itself, byte for byte, so
``egress-gateway audit verify`` checks what the collector received.

This module (and :mod:`gateway.telemetry.otel`) owns opentelemetry; it is imported only
when ``audit.otlp`` is set.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Final

from opentelemetry._logs import LogRecord, SeverityNumber
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.sdk._logs import ReadableLogRecord
from opentelemetry.sdk._logs.export import LogRecordExportResult
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from gateway.audit.spool import Spool

if TYPE_CHECKING:
    from gateway.policy import AuditOtlpSpec

#: Lines per OTLP request.
BATCH_LINES: Final = 512
#: Seconds between retries while the collector fails: doubling from min to max.
BACKOFF_MIN_S: Final = 0.05
BACKOFF_MAX_S: Final = 5.0
#: Seconds :meth:`OtlpShipper.close` keeps shipping what is spooled, while the collector
#: accepts it (what is left stays in the spool for the next start).
CLOSE_DRAIN_S: Final = 5.0
_SCOPE: Final = InstrumentationScope("gateway.audit")


class OtlpShipper:
    """Spools audit lines (:meth:`ship`, from any thread) and sends them to
    ``spec.endpoint`` from a thread of its own. :attr:`shipped`, :attr:`failures`
    (failed exports) and the spool's ``dropped`` count what happened. Raises OSError
    if the spool directory cannot be used. :meth:`close` is idempotent."""

    def __init__(self, spec: AuditOtlpSpec, *, service_name: str = "egress-gateway") -> None:
        self.spool = Spool(spec.spool_path, spec.spool_max_bytes)
        self._exporter = OTLPLogExporter(endpoint=spec.endpoint, timeout=spec.timeout_s)
        self._resource = Resource.create({"service.name": service_name})
        self.shipped = 0
        self.failures = 0
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._until = 0.0
        self._thread = threading.Thread(target=self._run, name="audit-otlp", daemon=True)
        self._thread.start()

    def ship(self, line: str) -> None:
        """Spool one audit line (without its newline) for sending."""
        self.spool.append(line)
        self._wake.set()

    def _record(self, line: str, now_ns: int) -> ReadableLogRecord:
        record = LogRecord(
            timestamp=now_ns,
            observed_timestamp=now_ns,
            severity_text="INFO",
            severity_number=SeverityNumber.INFO,
            body=line,
        )
        return ReadableLogRecord(record, self._resource, _SCOPE)

    def _send_one_batch(self) -> bool | None:
        """Ship the oldest batch: True sent, False failed, None nothing to send."""
        lines, end = self.spool.read(BATCH_LINES)
        if not lines:
            return None
        now_ns = time.time_ns()
        result = self._exporter.export([self._record(line, now_ns) for line in lines])
        if result is not LogRecordExportResult.SUCCESS:
            self.failures += 1
            return False
        self.spool.commit(end)
        self.shipped += len(lines)
        return True

    def _run(self) -> None:
        backoff = BACKOFF_MIN_S
        while True:
            sent = self._send_one_batch()
            if self._closing.is_set() and (sent is not True or time.monotonic() > self._until):
                return  # what is left stays in the spool for the next start
            if sent is False:
                self._closing.wait(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
                continue
            backoff = BACKOFF_MIN_S
            if sent is None:
                self._wake.wait(1.0)
                self._wake.clear()

    def close(self) -> None:
        """Ship what is spooled (for up to :data:`CLOSE_DRAIN_S`, until an export fails),
        then stop; idempotent."""
        self._until = time.monotonic() + CLOSE_DRAIN_S
        self._closing.set()
        self._wake.set()
        # Bounded: an export in progress may outlast it (the thread is a daemon; what it
        # had not shipped is still spooled), and the pod's grace period is short.
        self._thread.join(CLOSE_DRAIN_S)
        self._exporter.shutdown()  # type: ignore[no-untyped-call]
        self.spool.close()
