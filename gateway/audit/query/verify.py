"""Verification of the audit hash chain (``audit.chain: true``) over one or more files.

Each chained record carries ``seq`` (1, 2, ... per sidecar start), ``prev_hash`` (the
previous record's ``hash``; 64 zeros for seq 1) and ``hash`` (SHA-256 of
:func:`gateway.audit.schema.canonical_text` of the record without ``hash``, as parsed
back from its line, exactly: :func:`gateway.fastjson.loads`). Chains are followed per
``sidecar_id`` (unique per start), so logs of several sidecars may be interleaved; files
are read in the order given (rotated files oldest first: ``audit.log.2 audit.log.1
audit.log``). A record with ``seq`` 1 and the genesis ``prev_hash`` starts a new chain
(a start with nothing to continue); an ``audit_chain_continued`` event with ``seq`` 1
starts a chain that continues the record it names (``prev_sidecar_id``, ``prev_seq``,
``prev_hash``): the last record of the audit file when that start opened it.

Reported as breaks, each with file and line: a line that is not JSON; a record whose
``hash`` does not match its content (edited); a ``seq`` that skips (records missing) or
goes back; a ``prev_hash`` that is not the previous record's ``hash`` (the previous
record was replaced); a record of a chained sidecar without chain fields; a start that
continues a record missing from before it (records cut before a restart); a chain first
met past seq 1 whose ``chain_start`` (the hash its start continued) is a record given
before it (its first records cut after a restart).

Fields added after writing (a log collector's ``k8s.pod``, ``host``...) are not part of
the chain and do not break it: a record whose ``hash`` matches it without some of the
fields the sidecar never writes (:func:`written_part`) verifies, with a note naming the
added fields. That is sound: the hash matches only the exact set of fields, and values,
that the sidecar wrote, so a field edited or removed, or one of its own fields removed,
is still "record edited". What a plain
hash chain cannot show: records cut from the very start or end of the log, or a log
rewritten wholesale with new hashes; keep the latest ``hash`` elsewhere to catch those.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import combinations
from typing import IO, Any, Final

from gateway.audit.query.reader import Malformed, entries
from gateway.audit.schema import (
    AUDIT_FIELDS,
    CHAIN_CONTINUED_EVENT,
    GENESIS_HASH,
    PREV_SEQ,
    PREV_SIDECAR_ID,
    Fields,
    record_hash,
)

#: Fields the sidecar writes: the call record's, and those of its other audit events
#: (chain continued, policy reload, breaker state change).
WRITTEN_FIELDS: Final = frozenset(AUDIT_FIELDS) | {
    PREV_SIDECAR_ID,
    PREV_SEQ,
    "policy",
    "targets",
    "changed_targets",
    "restart_needed_for",
    "old_state",
    "new_state",
}
#: Fields outside WRITTEN_FIELDS searched for the ones added after writing (2**N hashes
#: at most per record): an event field the list above misses is still found.
MAX_FOREIGN_FIELDS: Final = 8


def written_part(record: dict[str, Any], stored: str) -> list[str] | None:
    """The fields added to ``record`` after it was written ([] for none), found as the
    largest set of fields outside :data:`WRITTEN_FIELDS` whose removal makes the record
    hash to ``stored``; None when no such set exists (the record was edited)."""
    if record_hash(record) == stored:
        return []
    foreign = sorted(k for k in record if k not in WRITTEN_FIELDS)
    if not foreign or len(foreign) > MAX_FOREIGN_FIELDS:
        return None
    # Most likely first: everything foreign added, then fewer and fewer of them.
    for size in range(len(foreign), 0, -1):
        for added in combinations(foreign, size):
            kept = {k: v for k, v in record.items() if k not in added}
            if record_hash(kept) == stored:
                return list(added)
    return None


@dataclass(frozen=True, slots=True)
class Break:
    """Where and how the chain is broken."""

    source: str
    line: int
    seq: int | None
    reason: str

    def __str__(self) -> str:
        seq = f" (seq {self.seq})" if self.seq is not None else ""
        return f"{self.source}:{self.line}{seq}: {self.reason}"


@dataclass
class _Link:
    seq: int
    hash: str
    where: str


@dataclass
class Verification:
    """The outcome: ``ok`` when at least one chained record and no break were found."""

    chained: int = 0
    unchained: int = 0
    chains: int = 0
    breaks: list[Break] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: Fields added after writing (not part of the chain), with how many records had each.
    added_fields: Counter[str] = field(default_factory=Counter)

    @property
    def ok(self) -> bool:
        return self.chained > 0 and not self.breaks

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "chained_records": self.chained,
            "unchained_records": self.unchained,
            "chains": self.chains,
            "breaks": [
                {"file": b.source, "line": b.line, "seq": b.seq, "reason": b.reason}
                for b in self.breaks
            ],
            "notes": self.notes,
            "added_fields": dict(sorted(self.added_fields.items())),
        }


def verify(sources: Iterable[str], *, stdin: IO[bytes] | None = None) -> Verification:
    """Check the chains of ``sources`` (paths or ``-``), in order; see the module doc.

    Raises ``OSError`` if a file cannot be read.
    """
    result = Verification()
    last: dict[str, _Link] = {}

    def malformed(bad: Malformed) -> None:
        result.breaks.append(Break(bad.source, bad.line, None, bad.reason))

    for source, line, record in entries(sources, malformed, stdin=stdin):
        sidecar = record.get(Fields.SIDECAR_ID)
        if not isinstance(sidecar, str):
            result.unchained += 1  # an operational log line, not an audit record
            continue
        seq, prev, stored = (record.get(k) for k in (Fields.SEQ, Fields.PREV_HASH, Fields.HASH))
        where = f"{source}:{line}"
        if seq is None and prev is None and stored is None:
            result.unchained += 1
            if sidecar in last:
                result.breaks.append(
                    Break(source, line, None, "record without chain fields inside a chain")
                )
            continue
        if not (type(seq) is int and isinstance(prev, str) and isinstance(stored, str)):
            result.breaks.append(Break(source, line, None, "chain fields missing or mistyped"))
            continue
        result.chained += 1
        if seq == 1 and record.get(Fields.EVENT) == CHAIN_CONTINUED_EVENT:
            problem = _continued_problem(record, prev, last, result, where)
        elif last.get(sidecar) is None and seq > 1:
            problem = _start_problem(record, seq, last, result, sidecar, where)
        else:
            problem = _link_problem(seq, prev, last.get(sidecar), result, sidecar, where)
        if problem:
            result.breaks.append(Break(source, line, seq, problem))
        added = written_part(record, stored)
        if added is None:
            result.breaks.append(
                Break(source, line, seq, "hash does not match the record: record edited")
            )
        else:
            result.added_fields.update(added)
        last[sidecar] = _Link(seq, stored, where)
    if result.chained == 0:
        result.notes.append("no chained records found (is audit.chain true?)")
    if result.added_fields:
        fields = ", ".join(f"{k} ({n})" for k, n in sorted(result.added_fields.items()))
        result.notes.append(f"fields added after writing, not part of the chain: {fields}")
    return result


def _start_problem(
    record: dict[str, Any],
    seq: int,
    last: dict[str, _Link],
    result: Verification,
    sidecar: str,
    where: str,
) -> str | None:
    """A chain first met past its seq 1: its first records were rotated away, unless it
    names (``chain_start``) a record given before it, which its start continued: then
    they were cut after that record."""
    result.chains += 1
    start = record.get(Fields.CHAIN_START)
    continued = next((link for link in last.values() if link.hash == start), None)
    if continued is not None:
        return (
            f"records cut after a restart: this start continued the record at "
            f"{continued.where}; its first {seq - 1} record(s) missing"
        )
    result.notes.append(
        f"{where}: chain of {sidecar} starts at seq {seq}: "
        "earlier records not given (rotated away?), not verified"
    )
    return None


def _link_problem(
    seq: int, prev: str, before: _Link | None, result: Verification, sidecar: str, where: str
) -> str | None:
    if seq == 1:
        result.chains += 1
        return None if prev == GENESIS_HASH else "seq 1 without the genesis prev_hash"
    if before is None:
        result.chains += 1
        result.notes.append(
            f"{where}: chain of {sidecar} starts at seq {seq}: "
            "earlier records not given (rotated away?), not verified"
        )
        return None
    if seq > before.seq + 1:
        missing = seq - before.seq - 1
        return f"seq jumps from {before.seq} ({before.where}): {missing} record(s) missing"
    if seq <= before.seq:
        return f"seq does not follow {before.seq} ({before.where}): record moved or repeated"
    if prev != before.hash:
        return f"prev_hash is not the hash of seq {before.seq} ({before.where}): record replaced"
    return None


def _continued_problem(
    record: dict[str, Any], prev: str, last: dict[str, _Link], result: Verification, where: str
) -> str | None:
    """A start that continued its audit file's chain: is the record it names, which was
    that file's last record then, still the last record of its chain before it?"""
    result.chains += 1
    of, at = record.get(PREV_SIDECAR_ID), record.get(PREV_SEQ)
    if not (isinstance(of, str) and type(at) is int):
        return "chain fields missing or mistyped"
    before = last.get(of)
    if before is None:
        result.notes.append(
            f"{where}: this start continues the chain of {of} at seq {at}: "
            "those records not given (rotated away?), not verified"
        )
        return None
    if before.seq < at:
        return (
            f"records cut before this start: the chain of {of} ends at seq {before.seq} "
            f"({before.where}), this start continues it at seq {at}: "
            f"{at - before.seq} record(s) missing"
        )
    if before.seq > at:
        result.notes.append(
            f"{where}: the chain of {of} went on past seq {at} ({before.where}) after this "
            "start continued it (two sidecars writing one file?)"
        )
        return None
    if prev != before.hash:
        return f"prev_hash is not the hash of seq {at} of {of} ({before.where}): record replaced"
    return None
