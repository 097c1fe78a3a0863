"""``egress-gateway audit show`` on a terminal: the call table fits the terminal's width
(rich's), leaving out the less telling columns and narrowing the call column, and every
batch keeps the header's columns."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from gateway.audit.query.render import CallTable, fit_columns

RECORD = {
    "timestamp": "2026-12-01T19:33:49.160603Z", "agent_id": "planner-agent-01",
    "target_system": "openai", "method": "POST", "endpoint": "/v1/chat/completions",
    "status_code": 200, "success": True, "attempts": 1, "latency_ms": 5.7,
    "tokens_used": 22, "trace_id": "tr-demo-0001-abcdef-0123456789",
}  # fmt: skip


def _shown(width: int, batch: int = 500) -> list[str]:
    out = io.StringIO()
    table = CallTable(Console(file=out, width=width, color_system=None), batch=batch)
    for _ in range(3):
        table.add(RECORD)
    table.flush()
    return out.getvalue().splitlines()


@pytest.mark.parametrize("width", [80, 100, 120, 178, 240])
def test_every_line_of_the_call_table_fits_the_width(width: int) -> None:
    lines = _shown(width)
    assert len(lines) == 5  # header, rule, three rows: no row wraps
    assert all(len(line) <= width for line in lines), lines
    header = lines[0]
    for kept in ("time (UTC)", "target", "call", "status", "outcome"):
        assert kept in header
    assert "2026-12-01 19:33:49.160" in lines[2]
    assert " ok" in lines[2]


def test_a_wide_console_shows_every_column_and_a_narrow_one_the_essential() -> None:
    wide, narrow = _shown(240)[0], _shown(80)[0]
    for column in ("agent", "tries", "latency ms", "tokens", "trace"):
        assert column in wide
        assert column not in narrow
    assert "POST /v1/chat/completions" in _shown(240)[2]


def test_batches_line_up_under_one_header() -> None:
    lines = _shown(100, batch=1)
    assert len(lines) == 5
    starts = {line.index("POST") for line in lines[2:]}
    assert len(starts) == 1


def test_fit_columns_leaves_out_in_order_and_never_narrows_below_the_floor() -> None:
    assert len(fit_columns(240)) == 10
    assert [i for i, _ in fit_columns(120)] == [0, 2, 3, 4, 5, 7]
    assert dict(fit_columns(20))[3] == 16
