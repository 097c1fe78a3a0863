"""Shadow denials are visible in the ``audit`` commands: ``show`` and ``trace`` print
``shadow_denied`` (not ``ok``), ``--decision`` selects by decision, ``summary`` counts
them; the summary table fits the terminal it is printed to."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from rich.console import Console

from gateway.audit.log import AuditLog
from gateway.audit.query.cli import main
from gateway.audit.query.render import print_summary
from gateway.audit.query.summary import Summary
from gateway.call.record import CallContext, audit_record
from gateway.envelope import ErrorCode, ErrorPayload, ExternalCallResponse
from gateway.policy import AuditSpec


def _write(path: Path) -> list[dict[str, Any]]:
    """Three calls of one trace: allowed, allowed under a shadow rule, denied."""
    log = AuditLog(AuditSpec(sink="file", path=str(path)), agent_id="planner")
    ok = ExternalCallResponse(success=True, status_code=200, latency_ms=3.0)
    error = ErrorPayload(code=ErrorCode.PERMISSION_DENIED, message="no", retryable=False)
    denied = ExternalCallResponse(success=False, latency_ms=1.0, error=error)
    for index, (answer, shadow, decision) in enumerate(
        ((ok, [], "allowed"), (ok, ["budget:llm-daily"], "allowed"), (denied, [], "denied"))
    ):
        ctx = CallContext(started=0.0, agent_id="planner", shadow_denied=shadow)
        ctx.decision = decision
        record = audit_record(ctx, answer)
        record.update(trace_id="run-1", correlation_id=f"c{index}", target_system="openai")
        log.call(record)
    log.close()
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run(*argv: str) -> str:
    out = io.StringIO()
    assert main(list(argv), stdout=out, stderr=io.StringIO()) == 0
    return out.getvalue()


def test_show_and_trace_print_shadow_denied(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    written = _write(path)
    assert [r["decision"] for r in written] == ["allowed", "shadow_denied", "denied"]
    table = _run("show", str(path))
    rows = [line for line in table.splitlines() if "openai" in line]
    assert ["shadow_denied" in row for row in rows] == [False, True, False]
    assert " ok " in rows[0]
    timeline = _run("trace", "run-1", str(path))
    assert "shadow_denied" in timeline


def test_decision_filters_the_calls(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    _write(path)
    selected = _run("show", "--format", "json", "--decision", "shadow_denied", str(path))
    assert [json.loads(line)["correlation_id"] for line in selected.splitlines()] == ["c1"]
    selected = _run("show", "--format", "json", "--decision", "*denied", str(path))
    assert [json.loads(line)["correlation_id"] for line in selected.splitlines()] == ["c1", "c2"]
    summary = json.loads(_run("summary", "--format", "json", "--decision", "allowed", str(path)))
    assert summary["total"]["calls"] == 1


def test_summary_counts_shadow_denials(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    _write(path)
    summary = json.loads(_run("summary", "--format", "json", str(path)))
    assert summary["total"]["shadow_denied"] == 1
    assert summary["total"]["succeeded"] == 2  # a shadow denial was answered
    assert "shadow" in _run("summary", str(path))


def test_the_summary_table_fits_the_terminal(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    summary = Summary()
    for record in _write(path):
        summary.add_call(record)

    def printed(width: int) -> list[str]:
        out = io.StringIO()
        print_summary(Console(file=out, width=width, color_system=None), summary)
        return out.getvalue().splitlines()

    narrow = printed(100)
    assert max(len(line) for line in narrow) <= 100
    assert not [line for line in narrow if "p99 ms" in line]  # the compact columns
    assert [line for line in narrow if "shadow" in line and "spend USD" in line]
    wide = printed(240)
    assert [line for line in wide if "p99 ms" in line and "breaker opens" in line]
