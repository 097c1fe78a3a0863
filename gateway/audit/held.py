"""Call records held until their answer is written, so that each says what the caller got.

A call ends (its audit record made) before its answer is written: the write can still
fail (the agent hung up, it stopped reading). The calls listener holds the audit records
of a request (a :class:`Held` set in :data:`HELD_RECORDS` by the calls listener's
middleware, :mod:`gateway.server.app`, around its handler and the write of its answer) and
writes them once the answer is written or given up (:meth:`Held.release`, in a
``finally``: never lost, never twice). An answer that did not reach the caller
(:meth:`Held.undelivered`) is recorded as such: a success becomes ``success: false``
with the error code of the same failure mid-stream (STREAM_INTERRUPTED for an agent that
hung up, AGENT_TIMEOUT for one that stopped reading), a failure keeps its code (the
caller got neither), and either gets a warning naming the reason. What the writer had
to change in an answer (a header line it could not write) is noted in the warnings too
(:meth:`Held.note`). A record written outside a request, or after its release (a task
the request started), is written at once.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from contextvars import ContextVar
from typing import Any, Final

from gateway.audit.schema import Fields

Record = MutableMapping[str, Any]
Writer = Callable[[Record], None]

#: ``details.reason`` of an answer the agent did not take: it hung up before the answer
#: (or a stream's last bytes) was written, or it stopped reading (the write's bound passed).
AGENT_DISCONNECTED: Final = "agent_disconnected"
AGENT_STALLED: Final = "agent_stalled"
#: Reason -> (error code, retryable): those of the same failure met mid-stream
#: (:mod:`gateway.call.relay`).
_OUTCOMES: Final = {
    AGENT_DISCONNECTED: ("STREAM_INTERRUPTED", True),
    AGENT_STALLED: ("AGENT_TIMEOUT", True),
}
_WHY: Final = {
    AGENT_DISCONNECTED: "the agent hung up before its answer was written",
    AGENT_STALLED: "the agent did not take its answer within the write's bound",
}


class Held:
    """The audit records of one request, held until its answer is written."""

    __slots__ = ("_notes", "open", "reason", "records")

    def __init__(self) -> None:
        #: The records held, each with the function that writes it, while ``open``
        #: (:meth:`gateway.audit.AuditLog.call` appends to it: no call per record).
        self.records: list[tuple[Writer, Record]] = []
        self.open = True
        self._notes: list[str] = []
        #: Why the answer did not reach the caller (None: it did, as far as is known).
        self.reason: str | None = None

    def undelivered(self, reason: str) -> None:
        """The answer did not reach the caller, for ``reason`` (:data:`AGENT_DISCONNECTED`,
        :data:`AGENT_STALLED`); the first reason given stands."""
        if self.reason is None:
            self.reason = reason

    def ids(self) -> tuple[str | None, str | None]:
        """(trace_id, correlation_id) of the first record held, (None, None) for none:
        the ids of an answer that carries none in its headers (the envelope's)."""
        if not self.records:
            return None, None
        record = self.records[0][1]
        return record.get(Fields.TRACE_ID), record.get(Fields.CORRELATION_ID)

    def note(self, warning: str) -> None:
        """Add ``warning`` to the records (what the caller got differs from what they
        would say): those held now and those held later."""
        self._notes.append(warning)

    def release(self) -> None:
        """Write the held records (each amended when the answer was undelivered); any
        record written later is written at once."""
        self.open = False
        records, self.records = self.records, []
        notes = self._notes
        if self.reason is None and not notes:  # the answer went out as the records say
            for write, record in records:
                write(record)
            return
        if self.reason is not None:
            notes = [*notes, f"answer not delivered: {self.reason} ({_WHY[self.reason]})"]
        for write, record in records:
            if self.reason is not None:
                _failed(record, self.reason)
            if notes:
                record[Fields.WARNINGS] = [*(record.get(Fields.WARNINGS) or ()), *notes]
            write(record)


#: The records held for the request answered in this context (read directly by
#: :meth:`gateway.audit.AuditLog.call`: a variable read, no call, per record).
HELD_RECORDS: ContextVar[Held | None] = ContextVar("held_audit_records", default=None)


def _failed(record: Record, reason: str) -> None:
    """A successful ``record`` of a call whose answer did not reach the caller, for
    ``reason``, made a failure (a failure keeps its own code: the caller got neither)."""
    if record.get(Fields.SUCCESS):
        code, retryable = _OUTCOMES[reason]
        record[Fields.SUCCESS] = False
        record[Fields.ERROR_CODE] = code
        record[Fields.RETRYABLE] = retryable


def held() -> Held | None:
    """The records held for the request being answered in this context, if any."""
    return HELD_RECORDS.get()
