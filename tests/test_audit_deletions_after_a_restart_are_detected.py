"""A chained audit file keeps, across restarts, the evidence that any of its records
was deleted: a start that continues the file's chain carries the hash it continued in
each of its records, so deleting the first records written after a restart (its
``audit_chain_continued`` event and what follows) is a break for ``audit verify``, not
a "rotated away?" note; only when the record it continued is not given either (rotated
away) is it a note."""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from gateway.audit.log import AuditLog
from gateway.audit.query.cli import main
from gateway.audit.query.verify import verify
from gateway.audit.schema import CHAIN_CONTINUED_EVENT, GENESIS_HASH, AuditRecord, Fields
from gateway.call.record import CallContext, audit_record
from gateway.envelope import ExternalCallResponse
from gateway.policy import AuditSpec
from tests.auditlog_helpers import read_json


def _starts(path: Path, counts: list[int], **spec: Any) -> None:
    """One AuditLog per start (as one container restarting), ``counts[i]`` events each."""
    for start, count in enumerate(counts):
        log = AuditLog(
            AuditSpec(sink="file", path=str(path), chain=True, **spec), agent_id="planner-01"
        )
        for number in range(count):
            log.event("policy_reload", start=start, version=number, padding="p" * 200)
        log.close()


def _without(path: Path, out: Path, cut: list[int]) -> Path:
    raw = path.read_text().splitlines(keepends=True)
    out.write_text("".join(line for i, line in enumerate(raw) if i not in cut))
    return out


def _verify_exit(*paths: Path) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(["verify", *map(str, paths)])
    return code, out.getvalue()


# Lines 0-4: the first start (seq 1-5); 5: the restart's audit_chain_continued (seq 1);
# 6-9: its records (seq 2-5).
@pytest.mark.parametrize(
    "cut", [[5], [5, 6], [5, 6, 7], [6], [6, 7]], ids=["start", "2", "3", "after-start", "two"]
)
def test_records_deleted_right_after_a_restart_are_detected(tmp_path: Path, cut: list[int]):
    path = tmp_path / "audit.log"
    _starts(path, [5, 4])
    lines = read_json(path)
    assert lines[5][Fields.EVENT] == CHAIN_CONTINUED_EVENT
    result = verify([str(_without(path, tmp_path / "cut.log", cut))])
    assert not result.ok, result.notes
    [broken] = result.breaks
    assert broken.line == (6 if 5 in cut else 7)  # the first record after the cut
    assert f"{len(cut)} record(s) missing" in broken.reason
    code, out = _verify_exit(tmp_path / "cut.log")
    assert code == 1
    assert out.startswith("FAILED")
    for line in lines[5:]:  # the restart's records name the record it continued
        assert line["chain_start"] == lines[4][Fields.HASH]
    assert all(line["chain_start"] == GENESIS_HASH for line in lines[:5])  # from genesis


def test_a_call_record_of_a_continued_chain_validates(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    _starts(path, [1])
    log = AuditLog(AuditSpec(sink="file", path=str(path), chain=True), agent_id="a")
    answer = ExternalCallResponse(success=True, status_code=200, latency_ms=1.0)
    log.call(audit_record(CallContext(started=0.0, agent_id="a"), answer))
    log.close()
    first, _, call = read_json(path)
    assert call["chain_start"] == first["hash"]
    AuditRecord.model_validate(call)
    assert verify([str(path)]).ok


def test_deleted_after_a_restart_in_a_new_file_after_rotation_is_detected(tmp_path: Path):
    path = tmp_path / "audit.log"
    _starts(path, [12, 12], max_bytes=4096, backup_count=20)
    files = sorted(tmp_path.glob("audit.log.*"), key=lambda p: -int(p.suffix[1:]))
    whole = verify([*map(str, files), str(path)])
    assert whole.ok, whole.breaks
    # The restart's first record, wherever it went, is deleted.
    for file in [*files, path]:
        raw = file.read_text().splitlines(keepends=True)
        kept = [ln for ln in raw if CHAIN_CONTINUED_EVENT not in ln]
        file.write_text("".join(kept))
    result = verify([*map(str, files), str(path)])
    assert not result.ok
    assert "1 record(s) missing" in result.breaks[0].reason


def test_an_intact_restart_and_a_rotated_away_start_still_verify(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    _starts(path, [5, 4, 2])
    assert verify([str(path)]).ok
    # The first start and the restart's first records gone, as rotated away: a note.
    tail = _without(path, tmp_path / "tail.log", [0, 1, 2, 3, 4, 5, 6])
    result = verify([str(tail)])
    assert result.ok, result.breaks
    assert "rotated away?" in result.notes[0]
