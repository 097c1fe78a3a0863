"""The audit query tool prints what agents wrote (endpoints, MCP tool names, agent and
trace ids as recorded): a control character among them (ESC, or U+009B, which a
terminal reads as CSI) is printed as an escape, never raw, in every table."""

from __future__ import annotations

import io
import random
from pathlib import Path

from gateway.audit.log import AuditLog
from gateway.audit.query.cli import main
from gateway.policy import AuditSpec
from tests.auditlog_helpers import call_record

EVIL = "/v1/x\u009b2J\u001b]52;c;cHduZWQ=\u0007"


def test_agent_text_is_inert_in_every_table(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    log = AuditLog(AuditSpec(sink="file", path=str(path)), agent_id="a1")
    try:
        record = call_record(random.Random(1), 0, "a1", "trace-\u009b1")
        record.update(endpoint=EVIL, target_system="t\u009bx")
        log.call(record)
    finally:
        log.close()
    for argv in (["show"], ["summary"], ["trace", "trace-\u009b1"]):
        out, err = io.StringIO(), io.StringIO()
        code = main([*argv, str(path)], stdout=out, stderr=err)
        assert code == 0, err.getvalue()
        text = out.getvalue()
        assert text.strip(), argv
        assert not any(0x80 <= ord(c) <= 0x9F or c in "\x1b\x07" for c in text), (argv, text)
