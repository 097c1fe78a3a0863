"""The audit writer (hash chain, rotating file sink) and the query library.

Logs are written by the real writer (gateway.audit) to files in tmp_path; expected values
are computed here from the file with plain ``json`` and ``statistics``.
"""

from __future__ import annotations

import gzip
import io
import itertools
import json
import statistics
import threading
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from gateway import fastjson, redaction
from gateway.audit import log as audit
from gateway.audit.log import AuditLog
from gateway.audit.query.filters import Filters, parse_when
from gateway.audit.query.reader import Malformed, entries, follow, records
from gateway.audit.query.summary import percentile, summarize
from gateway.audit.query.verify import verify
from gateway.audit.schema import AUDIT_FIELDS, GENESIS_HASH, AuditRecord, record_hash
from gateway.policy import AuditSpec
from tests.auditlog_helpers import AGENTS, calls_of, read_json, write_calls, write_log


@pytest.fixture(scope="module")
def log_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("audit") / "audit.log"
    write_log(path)
    return path


@pytest.fixture(scope="module")
def lines(log_path: Path) -> list[dict[str, Any]]:
    return read_json(log_path)


def _rewrite(path: Path, target: Path, change: Any) -> None:
    """Copy ``path`` to ``target``, passing the list of raw lines through ``change``."""
    raw = path.read_text().splitlines(keepends=True)
    target.write_text("".join(change(raw)))


def _oldest_first(path: Path) -> list[Path]:
    """``path`` and its rotated files (path.1 is newer than path.2), oldest first."""
    rotated = sorted(path.parent.glob(path.name + ".*"), key=lambda p: -int(p.suffix[1:]))
    return [*rotated, path]


# --- the writer -------------------------------------------------------------------


def test_every_call_record_validates_against_the_schema(log_path: Path) -> None:
    calls = [line for line in log_path.read_text().splitlines() if '"egress_call"' in line]
    assert len(calls) == 240
    for line in calls:
        from_dict = AuditRecord.model_validate(json.loads(line))
        assert AuditRecord.model_validate_json(line) == from_dict
        assert set(json.loads(line)) == set(AUDIT_FIELDS)  # chained: every field present


def test_unchained_records_validate_and_carry_no_chain_fields(tmp_path: Path) -> None:
    write_log(tmp_path / "plain.log", 30, chain=False)
    calls = calls_of(read_json(tmp_path / "plain.log"))
    assert len(calls) == 30
    for call in calls:
        assert AuditRecord.model_validate(call).seq is None
        assert "hash" not in call
        assert "seq" not in call


def test_chain_links_every_audit_record_in_order(lines: list[dict[str, Any]]) -> None:
    assert [line["seq"] for line in lines] == list(range(1, len(lines) + 1))
    assert lines[0]["prev_hash"] == GENESIS_HASH
    for before, after in itertools.pairwise(lines):
        assert after["prev_hash"] == before["hash"]
    assert all(line["hash"] == record_hash(line) for line in lines)
    events = Counter(line["event"] for line in lines)
    assert events == {"egress_call": 240, "breaker_state_change": 21, "policy_reload": 1}


def test_chain_survives_scrubbed_secrets_and_non_string_keys(tmp_path: Path) -> None:
    secret = "sk-canary-0123456789-ünï"
    redaction.register(secret)
    buffer = io.StringIO()
    log = AuditLog(AuditSpec(chain=True), buffer, agent_id="planner-01")
    log.event("odd", note=f"upstream echoed {secret}", keys={2: "a", 10: "b"}, pair=(1, 2))
    log.event("plain", n=1)
    (tmp_path / "s.log").write_text(buffer.getvalue())
    assert secret not in buffer.getvalue()
    assert "[REDACTED]" in buffer.getvalue()
    result = verify([str(tmp_path / "s.log")])
    assert result.ok, result.breaks
    assert result.chained == 2


def test_call_records_render_as_the_structlog_chain_does(tmp_path: Path) -> None:
    # AuditLog.call runs the chain's processors itself (docs/performance.md, round two):
    # its lines must hold what the structlog chain writes for the same fields (event()).
    secret = "sk-canary-call-path-0123456789"
    redaction.register(secret)
    fields: dict[str, Any] = {k: None for k in AUDIT_FIELDS if k not in ("seq", "hash")}
    fields.update(
        agent_id="a", trace_id=f"t {secret}", success=True, attempts=1, warnings=["w"],
        metadata={"task": "x", "api_key": "k", "deep": [{"password": "p", "n": 1}]},
    )  # fmt: skip
    for chain in (False, True):
        via_call, via_event = io.StringIO(), io.StringIO()
        for success in (True, False):
            record = {**fields, "success": success}
            for drop in ("event", "timestamp", "level", "prev_hash", "audit_schema"):
                record.pop(drop, None)
            spec = AuditSpec(chain=chain)
            AuditLog(spec, via_call, agent_id="a", sidecar_id="h:1:0").call(dict(record))
            AuditLog(spec, via_event, agent_id="a", sidecar_id="h:1:0").event(
                "egress_call", audit_schema=1, **record
            )
        got = [json.loads(line) for line in via_call.getvalue().splitlines()]
        want = [json.loads(line) for line in via_event.getvalue().splitlines()]
        assert secret not in via_call.getvalue()
        assert [g["level"] for g in got] == ["info", "warning"]
        assert got[0]["metadata"] == {
            "task": "x", "api_key": "[REDACTED]", "deep": [{"password": "[REDACTED]", "n": 1}]
        }  # fmt: skip
        for g, w in zip(got, want, strict=True):
            skip = {"timestamp", "level", "hash"}
            assert {k: v for k, v in g.items() if k not in skip} == {
                k: v for k, v in w.items() if k not in skip
            }
        if chain:
            (tmp_path / "c.log").write_text(via_call.getvalue())
            result = verify([str(tmp_path / "c.log")])
            assert result.ok, result.breaks


def test_audit_records_ignore_the_operational_level_and_skip_the_chain_for_ops() -> None:
    buffer = io.StringIO()
    audit.configure_logging(buffer, level="error")
    try:
        audit.get_logger("ops").warning("dropped at level error")
        audit.get_logger("ops").error("kept")
        AuditLog(AuditSpec(chain=True), buffer, agent_id="a").event("policy_reload", version=3)
    finally:
        audit.configure_logging(io.StringIO())
    out = [json.loads(line) for line in buffer.getvalue().splitlines()]
    assert [line["event"] for line in out] == ["kept", "policy_reload"]
    assert "seq" not in out[0]
    assert out[1]["seq"] == 1


def test_file_sink_rotates_by_size_and_keeps_ops_lines_out(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    ops = io.StringIO()
    spec = AuditSpec(sink="file", path=str(path), chain=True, max_bytes=8192, backup_count=50)
    audit.configure_logging(ops)
    log = AuditLog(spec, ops, agent_id=AGENTS[0])
    try:
        audit.get_logger("ops").info("operational")
        write_calls(log, 60)
    finally:
        log.close()
        audit.configure_logging(io.StringIO())
    files = _oldest_first(path)
    assert len(files) >= 3
    assert all(p.stat().st_size <= 8192 for p in files)
    seqs = [line["seq"] for p in files for line in read_json(p)]
    assert seqs == list(range(1, len(seqs) + 1))  # oldest file first, nothing lost
    assert len(calls_of([line for p in files for line in read_json(p)])) == 60
    assert '"operational"' in ops.getvalue()
    assert all("operational" not in p.read_text() for p in files)
    assert verify([str(p) for p in files]).ok
    assert not verify([str(p) for p in reversed(files)]).ok
    without_oldest = verify([str(p) for p in files[1:]])
    assert without_oldest.ok
    assert "starts at seq" in without_oldest.notes[0]


# --- chain verification -----------------------------------------------------------


def test_verify_intact_log(log_path: Path, lines: list[dict[str, Any]]) -> None:
    result = verify([str(log_path)])
    assert result.ok
    assert (result.chained, result.chains, result.breaks) == (len(lines), 1, [])


def test_verify_reports_a_deleted_record_at_the_next_line(log_path: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.log"
    _rewrite(log_path, cut, lambda raw: raw[:99] + raw[100:])  # line 100 (seq 100) gone
    result = verify([str(cut)])
    assert not result.ok
    first = result.breaks[0]
    assert (first.source, first.line, first.seq) == (str(cut), 100, 101)
    assert "1 record(s) missing" in first.reason
    assert len(result.breaks) == 1


def test_verify_reports_an_edited_record_at_its_line(log_path: Path, tmp_path: Path) -> None:
    edited = tmp_path / "edited.log"

    def change(raw: list[str]) -> list[str]:
        record = json.loads(raw[41])
        record["latency_ms"] = 1.0
        return [*raw[:41], json.dumps(record) + "\n", *raw[42:]]

    _rewrite(log_path, edited, change)
    result = verify([str(edited)])
    assert [(b.line, b.seq) for b in result.breaks] == [(42, 42)]
    assert "edited" in result.breaks[0].reason


def test_verify_reports_an_edited_and_rehashed_record_at_the_next_line(
    log_path: Path, tmp_path: Path
) -> None:
    forged = tmp_path / "forged.log"

    def change(raw: list[str]) -> list[str]:
        record = json.loads(raw[9])
        record["error_code"] = None
        record["hash"] = record_hash(record)
        return [*raw[:9], json.dumps(record) + "\n", *raw[10:]]

    _rewrite(log_path, forged, change)
    result = verify([str(forged)])
    assert [(b.line, b.seq) for b in result.breaks] == [(11, 11)]
    assert "prev_hash" in result.breaks[0].reason


def test_verify_reports_a_malformed_line_and_stripped_chain_fields(
    log_path: Path, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.log"

    def change(raw: list[str]) -> list[str]:
        stripped = json.loads(raw[20])
        for key in ("seq", "prev_hash", "hash"):
            del stripped[key]
        return [*raw[:5], "{not json\n", *raw[5:20], json.dumps(stripped) + "\n", *raw[21:]]

    _rewrite(log_path, bad, change)
    result = verify([str(bad)])
    assert result.breaks[0].line == 6
    assert "not valid JSON" in result.breaks[0].reason
    assert (result.breaks[1].line, result.breaks[1].reason) == (
        22,
        "record without chain fields inside a chain",
    )


def test_verify_accepts_a_restart_and_refuses_an_unchained_log(tmp_path: Path) -> None:
    both = tmp_path / "both.log"
    write_log(both, 10)
    write_log(both, 10)  # a second process run appends: a new chain at seq 1
    result = verify([str(both)])
    assert result.ok
    assert result.chains == 2
    write_log(tmp_path / "plain.log", 5, chain=False)
    plain = verify([str(tmp_path / "plain.log")])
    assert not plain.ok
    assert plain.notes == ["no chained records found (is audit.chain true?)"]


# --- reader -----------------------------------------------------------------------


def test_reader_reports_malformed_lines_and_keeps_going(log_path: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "damaged.log"
    _rewrite(
        log_path,
        damaged,
        lambda raw: [raw[0], "garbage\n", raw[1], "\n", "[1, 2]\n", *raw[2:], raw[2][:40]],
    )
    bad: list[Malformed] = []
    got = list(entries([str(damaged)], bad.append))
    assert [(b.line, b.reason.split(" (")[0]) for b in bad] == [
        (2, "not valid JSON"),
        (5, "not a JSON object"),
        (len(read_json(log_path)) + 4, "not valid JSON"),  # a truncated last line
    ]
    assert str(bad[0]).startswith(f"{damaged}:2: malformed line: not valid JSON")
    assert len(got) == len(read_json(log_path))
    assert [line for _, line, _ in got[:3]] == [1, 3, 6]


def test_reader_reads_gzip_and_stdin(log_path: Path, tmp_path: Path) -> None:
    packed = tmp_path / "audit.log.1"  # no .gz suffix: detected by magic bytes
    packed.write_bytes(gzip.compress(log_path.read_bytes()))
    expected = read_json(log_path)
    assert list(records([str(packed)])) == expected
    stdin = io.BufferedReader(io.BytesIO(gzip.compress(log_path.read_bytes())))
    assert list(records(["-"], stdin=stdin)) == expected
    assert list(records(["-"], stdin=io.BytesIO(log_path.read_bytes()))) == expected


def test_follow_reads_appended_lines_across_rotations(tmp_path: Path) -> None:
    path = tmp_path / "live.log"
    spec = AuditSpec(sink="file", path=str(path), chain=True, max_bytes=4096, backup_count=20)
    log = AuditLog(spec, io.StringIO(), agent_id="planner-01")
    stop = threading.Event()
    seen: list[int] = []
    progress = threading.Condition()

    def reader() -> None:
        for _, _, record in follow(str(path), stop, poll_s=0.01):
            with progress:
                seen.append(record["seq"])
                progress.notify_all()

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for number in range(30):
            log.event("policy_reload", version=number, padding="x" * 600)
            with progress:  # one record at a time: tail -F cannot see a file skipped past
                assert progress.wait_for(lambda n=number: len(seen) > n, timeout=10)
    finally:
        stop.set()
        thread.join(10)
        log.close()
    assert len(list(tmp_path.glob("live.log.*"))) >= 3  # it did rotate, several times
    assert seen == list(range(1, 31))


# --- filters and summary ----------------------------------------------------------


def _select(filters: Filters, log_path: Path) -> list[str]:
    match = filters.call_predicate()
    return [r["correlation_id"] for r in records([str(log_path)]) if match(r)]


FILTER_CASES = [
    ("trace", Filters(trace=("trace-007",)), lambda c: c["trace_id"] == "trace-007"),
    ("trace glob", Filters(trace=("trace-01*",)), lambda c: c["trace_id"].startswith("trace-01")),
    (
        "correlation",
        Filters(correlation=("corr-0005", "corr-0009")),
        lambda c: c["correlation_id"] in ("corr-0005", "corr-0009"),
    ),
    ("agent", Filters(agent=("coder-02",)), lambda c: c["agent_id"] == "coder-02"),
    ("target", Filters(target=("slack",)), lambda c: c["target_system"] == "slack"),
    ("endpoint", Filters(endpoint=("/v1/messages",)), lambda c: c["endpoint"] == "/v1/messages"),
    ("code", Filters(code=("CIRCUIT_OPEN",)), lambda c: c["error_code"] == "CIRCUIT_OPEN"),
    ("failed", Filters(failed=True), lambda c: not c["success"]),
    ("policy", Filters(policy=("b" * 64,)), lambda c: c["policy_sha256"] == "b" * 64),
    ("policy prefix", Filters(policy=("aaaa*",)), lambda c: c["policy_sha256"] == "a" * 64),
    ("min latency", Filters(min_latency_ms=100.0), lambda c: c["latency_ms"] >= 100.0),
    (
        "combined",
        Filters(agent=("planner-01",), target=("openai",), failed=True),
        lambda c: (
            c["agent_id"] == "planner-01" and c["target_system"] == "openai" and not c["success"]
        ),
    ),
]


@pytest.mark.parametrize(
    ("name", "filters", "expected"), FILTER_CASES, ids=[c[0] for c in FILTER_CASES]
)
def test_filter(
    name: str, filters: Filters, expected: Any, log_path: Path, lines: list[dict[str, Any]]
) -> None:
    want = [c["correlation_id"] for c in calls_of(lines) if expected(c)]
    assert want, f"the generated log has no case for {name}"
    assert _select(filters, log_path) == want


def test_time_filters(log_path: Path, lines: list[dict[str, Any]]) -> None:
    calls = calls_of(lines)
    middle = datetime.fromisoformat(calls[120]["timestamp"])
    late = datetime.fromisoformat(calls[200]["timestamp"])

    def when(c: dict[str, Any]) -> datetime:
        return datetime.fromisoformat(c["timestamp"])

    want = [c["correlation_id"] for c in calls if middle <= when(c) <= late]
    assert 0 < len(want) < len(calls)
    assert _select(Filters(since=middle, until=late), log_path) == want
    assert _select(Filters(since=parse_when("1h")), log_path) == [
        c["correlation_id"] for c in calls
    ]
    assert _select(Filters(until=parse_when("1h")), log_path) == []


def test_parse_when() -> None:
    now = datetime(2025, 1, 31, 12, 0, tzinfo=UTC)
    assert parse_when("15m", now) == now - timedelta(minutes=15)
    assert parse_when("2h", now) == now - timedelta(hours=2)
    assert parse_when("1d", now) == now - timedelta(days=1)
    assert parse_when("90s", now) == now - timedelta(seconds=90)
    assert parse_when("2025-01-31T10:00:00Z") == datetime(2025, 1, 31, 10, tzinfo=UTC)
    assert parse_when("2025-01-31T10:00:00+02:00") == datetime(2025, 1, 31, 8, tzinfo=UTC)
    assert parse_when("2025-01-31") == datetime(2025, 1, 31, tzinfo=UTC)
    with pytest.raises(ValueError, match="neither ISO 8601"):
        parse_when("yesterday")


@pytest.mark.parametrize(
    "values", [[5.0], [1.0, 2.0], [3.0, 1.0, 2.0, 10.0], [float(i) for i in range(1, 101)]]
)
def test_percentile_matches_statistics_inclusive(values: list[float]) -> None:
    ordered = sorted(values)
    cuts = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else None
    for q, index in ((0.50, 49), (0.95, 94), (0.99, 98)):
        want = values[0] if cuts is None else cuts[index]
        assert percentile(ordered, q) == pytest.approx(want)
    assert percentile([], 0.5) is None


def _expected_group(calls: list[dict[str, Any]], opens: int) -> dict[str, Any]:
    """Figures computed here, the documented way, from the parsed lines."""
    latencies = [c["latency_ms"] for c in calls]
    cuts = statistics.quantiles(latencies, n=100, method="inclusive")
    waits = [c["rate_limit_wait_ms"] for c in calls if c["rate_limit_wait_ms"] > 0]
    succeeded = sum(c["success"] for c in calls)
    return {
        "calls": len(calls),
        "succeeded": succeeded,
        "success_rate": succeeded / len(calls),
        "replays": sum(c["replayed"] for c in calls),
        "error_codes": dict(Counter(c["error_code"] for c in calls if not c["success"])),
        "latency_ms": {"p50": cuts[49], "p95": cuts[94], "p99": cuts[98]},
        "retries": sum(max(c["attempts"] - 1, 0) for c in calls),
        "tokens": {
            kind: sum(c[f"tokens_{kind}"] or 0 for c in calls)
            for kind in ("input", "output", "cached")
        },
        "rate_limit_waits": {"count": len(waits), "total_ms": sum(waits)},
        "breaker_opens": opens,
    }


def _assert_figures(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["latency_ms"] == pytest.approx(want["latency_ms"])
    assert got["rate_limit_waits"]["total_ms"] == pytest.approx(
        want["rate_limit_waits"]["total_ms"]
    )
    assert got["success_rate"] == pytest.approx(want["success_rate"])
    for key in (
        "calls",
        "succeeded",
        "replays",
        "error_codes",
        "retries",
        "tokens",
        "breaker_opens",
    ):
        assert got[key] == want[key], key
    assert got["rate_limit_waits"]["count"] == want["rate_limit_waits"]["count"]


def test_summary_figures(log_path: Path, lines: list[dict[str, Any]]) -> None:
    filters = Filters()
    result = summarize(
        records([str(log_path)]), filters.call_predicate(), filters.event_predicate()
    ).to_dict()
    calls = calls_of(lines)
    opens = [e for e in lines if e["event"] == "breaker_state_change" and e["new_state"] == "open"]
    assert sorted(result["agents"]) == sorted(AGENTS)
    for agent in AGENTS:
        want = _expected_group(
            [c for c in calls if c["agent_id"] == agent],
            sum(e["agent_id"] == agent for e in opens),
        )
        _assert_figures(result["agents"][agent], want)
    for target in ("openai", "anthropic", "slack"):
        want = _expected_group(
            [c for c in calls if c["target_system"] == target],
            sum(e["target_system"] == target for e in opens),
        )
        _assert_figures(result["targets"][target], want)
    _assert_figures(result["total"], _expected_group(calls, len(opens)))
    assert result["total"]["replays"] > 0
    assert result["total"]["retries"] > 0
    assert result["total"]["breaker_opens"] == 7


def test_summary_applies_filters_to_calls_and_breaker_events(
    log_path: Path, lines: list[dict[str, Any]]
) -> None:
    filters = Filters(target=("slack",), failed=True)
    result = summarize(
        records([str(log_path)]), filters.call_predicate(), filters.event_predicate()
    ).to_dict()
    calls = [c for c in calls_of(lines) if c["target_system"] == "slack" and not c["success"]]
    opens = sum(
        e["event"] == "breaker_state_change"
        and e["new_state"] == "open"
        and e["target_system"] == "slack"
        for e in lines
    )
    assert list(result["targets"]) == ["slack"]
    _assert_figures(result["total"], _expected_group(calls, opens))


@pytest.mark.parametrize(
    "metadata",
    [
        {"task": "t", "n": 1, "ratio": 0.1, "tiny": 1e-05, "big": 1e300, "ok": True, "x": None},
        {"nested": [{"api_key": "s", "deep": {"Token": "s2"}}], "name": "Zoë ☃"},
        {"huge": 2**70},  # past 64 bits: orjson refuses it, the stdlib writes it
        {"keys": {2: "a", 10: "b"}},  # non-string keys: the stdlib's way
        {"lone": "\ud800"},  # no UTF-8 form: escaped by the stdlib path
    ],
    ids=["scalars", "nested-redacted", "huge-int", "int-keys", "lone-surrogate"],
)
def test_fast_and_stdlib_json_paths_write_the_same_record(
    metadata: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    def write(buffer: io.StringIO) -> dict[str, Any]:
        log = AuditLog(AuditSpec(chain=True), buffer, agent_id="a", sidecar_id="host:1:0")
        log.event("probe", metadata=metadata, api_key="sk-never-written")
        [line] = buffer.getvalue().splitlines()
        assert "sk-never-written" not in line
        doc: dict[str, Any] = json.loads(line)
        assert doc["hash"] == record_hash(doc)  # the chain hashes what a reader parses
        del doc["timestamp"], doc["hash"]  # the time differs, and so the hash
        return doc

    fast = write(io.StringIO())
    monkeypatch.setattr(fastjson, "orjson", None)  # our own optional import, not a library
    plain = write(io.StringIO())
    assert fast == plain
    assert fast["api_key"] == "[REDACTED]"
