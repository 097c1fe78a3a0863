"""``audit verify`` checks the chained fields only: a log collector that adds fields
(and rewrites each line in its own key order) leaves the chain intact, while an edit,
a deletion or a reorder of what the sidecar wrote is still caught."""

from __future__ import annotations

import io
import json
from typing import Any

from gateway.audit.log import AuditLog
from gateway.audit.query.verify import MAX_FOREIGN_FIELDS, Verification, verify
from gateway.audit.schema import Fields
from gateway.call.record import CallContext, audit_record
from gateway.envelope import ExternalCallResponse
from gateway.policy import AuditSpec

ADDED = {"k8s": {"pod": "planner-7d9c-x2k4q", "namespace": "team-a"}, "host": "node-1"}


def _written() -> list[dict[str, Any]]:
    """Chained records from the real writer: events with fields of their own, calls."""
    buffer = io.StringIO()
    log = AuditLog(AuditSpec(chain=True), buffer, agent_id="a", sidecar_id="host:1:00000000")
    log.event("breaker_state_change", target_system="t", old_state="closed", new_state="open")
    log.event("probe", value={"nested": [1, 2.5, "x"]})  # a field no list names
    for status in (200, 502, 200):
        answer = ExternalCallResponse(success=status == 200, status_code=status, latency_ms=1.0)
        log.call(audit_record(CallContext(started=0.0, agent_id="a"), answer))
    return [json.loads(line) for line in buffer.getvalue().splitlines()]


def _collected(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What a collector ships: its fields first, then the record's in reverse key order."""
    return [{**ADDED, **dict(reversed(list(r.items())))} for r in records]


def _verify(records: list[dict[str, Any]]) -> Verification:
    text = "".join(json.dumps(r) + "\n" for r in records)
    return verify(["-"], stdin=io.BytesIO(text.encode()))


def _reasons(result: Verification) -> list[str]:
    return [b.reason for b in result.breaks]


def test_fields_added_by_a_collector_do_not_break_the_chain() -> None:
    result = _verify(_collected(_written()))
    assert result.ok, result.breaks
    assert result.chained == 5
    assert result.added_fields == {"host": 5, "k8s": 5}
    assert "fields added after writing, not part of the chain: host (5), k8s (5)" in (result.notes)
    assert result.to_dict()["added_fields"] == {"host": 5, "k8s": 5}


def test_an_edit_of_a_written_field_is_still_caught() -> None:
    records = _collected(_written())
    records[3][Fields.STATUS_CODE] = 200
    assert _reasons(_verify(records)) == ["hash does not match the record: record edited"]
    records = _collected(_written())
    records[1]["value"]["nested"][0] = 2  # an event's own field, named by no list
    assert _reasons(_verify(records)) == ["hash does not match the record: record edited"]


def test_removing_a_written_field_is_still_caught() -> None:
    for index, name in ((0, "new_state"), (1, "value"), (2, Fields.METADATA)):
        records = _collected(_written())
        del records[index][name]
        assert _reasons(_verify(records)) == ["hash does not match the record: record edited"]


def test_a_deleted_or_reordered_record_is_still_caught() -> None:
    records = _collected(_written())
    del records[2]
    assert _reasons(_verify(records)) == ["seq jumps from 2 (<stdin>:2): 1 record(s) missing"]
    records = _collected(_written())
    records[2], records[3] = records[3], records[2]
    assert _reasons(_verify(records)) == [
        "seq jumps from 2 (<stdin>:2): 1 record(s) missing",
        "seq does not follow 4 (<stdin>:3): record moved or repeated",
        "seq jumps from 3 (<stdin>:4): 1 record(s) missing",
    ]


def test_too_many_foreign_fields_are_reported_as_an_edit() -> None:
    records = _written()
    records[2].update({f"added_{i}": i for i in range(MAX_FOREIGN_FIELDS + 1)})
    assert _reasons(_verify(records)) == ["hash does not match the record: record edited"]
