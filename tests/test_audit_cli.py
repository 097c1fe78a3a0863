"""The ``audit`` command (``python -m gateway.audit.query`` / ``egress-gateway audit``).

Runs the real argparse front end over logs written by the real writer; expected values
come from the file parsed here with plain ``json``.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import subprocess
import sys
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from gateway.audit import log as audit
from gateway.audit.query.cli import main, register
from gateway.policy import AuditSpec
from tests.auditlog_helpers import call_record, calls_of, read_json, write_log
from tests.conftest import FakeUpstream, Sidecar
from tests.test_budgets import call, policy


@pytest.fixture(scope="module")
def log_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("audit-cli") / "audit.log"
    write_log(path)
    return path


@pytest.fixture(scope="module")
def calls(log_path: Path) -> list[dict[str, Any]]:
    return calls_of(read_json(log_path))


def run(*argv: str, stdin: bytes | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(
        list(argv), stdout=out, stderr=err, stdin=io.BytesIO(stdin) if stdin is not None else None
    )
    return code, out.getvalue(), err.getvalue()


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines()]


def correlations(text: str) -> list[str]:
    return [record["correlation_id"] for record in json_lines(text)]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--trace", "trace-010"], lambda c: c["trace_id"] == "trace-010"),
        (["--correlation", "corr-0042"], lambda c: c["correlation_id"] == "corr-0042"),
        (
            ["--agent", "reviewer-03", "--agent", "coder-02"],
            lambda c: c["agent_id"] in ("reviewer-03", "coder-02"),
        ),
        (["--target", "open*"], lambda c: c["target_system"] == "openai"),
        (
            ["--endpoint", "/api/chat.postMessage"],
            lambda c: c["endpoint"] == "/api/chat.postMessage",
        ),
        (["--code", "CAPACITY_EXCEEDED"], lambda c: c["error_code"] == "CAPACITY_EXCEEDED"),
        (["--failed"], lambda c: not c["success"]),
        (["--min-latency", "150"], lambda c: c["latency_ms"] >= 150),
        (["--policy", "bbbb*"], lambda c: c["policy_sha256"] == "b" * 64),
        (
            ["--failed", "--target", "anthropic", "--min-latency", "20"],
            lambda c: (
                not c["success"] and c["target_system"] == "anthropic" and c["latency_ms"] >= 20
            ),
        ),
    ],
    ids=[
        "trace",
        "correlation",
        "agents",
        "target-glob",
        "endpoint",
        "code",
        "failed",
        "min-latency",
        "policy-digest",
        "combined",
    ],
)
def test_show_json_filters(
    flags: list[str], expected: Any, log_path: Path, calls: list[dict[str, Any]]
) -> None:
    code, out, err = run("show", str(log_path), "--format", "json", *flags)
    want = [c["correlation_id"] for c in calls if expected(c)]
    assert (code, err) == (0, "")
    assert want
    assert correlations(out) == want
    assert json_lines(out) == [c for c in calls if expected(c)]  # records unchanged


def test_show_since_until_iso(log_path: Path, calls: list[dict[str, Any]]) -> None:
    since, until = calls[50]["timestamp"], calls[90]["timestamp"]
    code, out, _ = run(
        "show", str(log_path), "--format", "json", "--since", since, "--until", until
    )
    lo, hi = datetime.fromisoformat(since), datetime.fromisoformat(until)
    want = [
        c["correlation_id"] for c in calls if lo <= datetime.fromisoformat(c["timestamp"]) <= hi
    ]
    assert code == 0
    assert correlations(out) == want
    assert 40 <= len(want) < len(calls)


def test_show_relative_since(tmp_path: Path, log_path: Path) -> None:
    """Half the records are made three hours old; --since 2h keeps the recent half."""
    lines = read_json(log_path)
    old = datetime.now(UTC) - timedelta(hours=3)
    for line in lines[::2]:
        line["timestamp"] = old.isoformat().replace("+00:00", "Z")
    aged = tmp_path / "aged.log"
    aged.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, out, _ = run("show", str(aged), "--format", "json", "--since", "2h")
    recent = [line["correlation_id"] for line in calls_of(lines[1::2])]
    assert code == 0
    assert correlations(out) == recent
    code, out, _ = run("show", str(aged), "--format", "json", "--until", "150m")
    assert correlations(out) == [line["correlation_id"] for line in calls_of(lines[::2])]


def test_show_table(log_path: Path, calls: list[dict[str, Any]]) -> None:
    code, out, _ = run("show", str(log_path), "--code", "CIRCUIT_OPEN")
    rows = [line for line in out.splitlines() if "CIRCUIT_OPEN" in line]
    assert code == 0
    assert out.splitlines()[0].split()[:3] == ["time", "(UTC)", "agent"]
    assert len(rows) == sum(c["error_code"] == "CIRCUIT_OPEN" for c in calls)
    first = next(c for c in calls if c["error_code"] == "CIRCUIT_OPEN")
    assert first["trace_id"] in rows[0]
    assert first["agent_id"] in rows[0]


def test_show_large_table_streams_in_batches_under_one_header(log_path: Path) -> None:
    code, out, _ = run("show", str(log_path))
    assert code == 0
    assert out.count("time (UTC)") == 1
    assert sum("POST /" in line for line in out.splitlines()) == 240


def test_summary_json_and_table(log_path: Path, calls: list[dict[str, Any]]) -> None:
    code, out, _ = run("summary", str(log_path), "--format", "json")
    figures = json.loads(out)
    assert code == 0
    assert figures["total"]["calls"] == len(calls)
    assert figures["agents"]["coder-02"]["calls"] == sum(c["agent_id"] == "coder-02" for c in calls)
    slack_failed = [c for c in calls if c["target_system"] == "slack" and not c["success"]]
    code, out, _ = run(
        "summary", str(log_path), "--target", "slack", "--failed", "--format", "json"
    )
    assert json.loads(out)["total"]["calls"] == len(slack_failed)
    code, out, _ = run("summary", str(log_path))
    assert code == 0
    assert "Calls by agent" in out
    assert "Calls by target" in out
    all_rows = [line.split() for line in out.splitlines() if line.strip().startswith("all ")]
    assert len(all_rows) == 2
    assert all_rows[0][1] == str(len(calls))


def test_trace_timeline(log_path: Path, calls: list[dict[str, Any]]) -> None:
    mine = [c for c in calls if c["trace_id"] == "trace-012"]

    def start(c: dict[str, Any]) -> datetime:
        return datetime.fromisoformat(c["timestamp"]) - timedelta(milliseconds=c["latency_ms"])

    ordered = sorted(mine, key=start)
    code, out, _ = run("trace", "trace-012", str(log_path), "--format", "json")
    steps = json_lines(out)
    assert code == 0
    assert [s["correlation_id"] for s in steps] == [c["correlation_id"] for c in ordered]
    assert steps[0]["start_offset_ms"] == 0.0
    want = (start(ordered[-1]) - start(ordered[0])) / timedelta(milliseconds=1)
    assert steps[-1]["start_offset_ms"] == pytest.approx(want, abs=1e-3)
    code, out, _ = run("trace", "trace-012", str(log_path))
    assert code == 0
    assert f"trace trace-012: {len(mine)} calls" in out
    assert all(c["correlation_id"] in out for c in mine)
    assert "█" in out
    assert run("trace", "no-such-trace", str(log_path))[::2] == (
        1,
        "no calls for trace no-such-trace\n",
    )


def test_trace_names_the_agents_of_its_call_chains(tmp_path: Path) -> None:
    # Only the executor's log is at hand: the planner that started the chain is named by
    # the chain its calls carried.
    import random

    path = tmp_path / "executor.log"
    log = audit.AuditLog(AuditSpec(sink="file", path=str(path)), agent_id="executor")
    try:
        for number in range(2):
            record = call_record(random.Random(number), number, "executor", "trace-a2a")
            record["call_chain"] = ["planner", "executor"]
            record["call_chain_depth"] = 2
            log.call(record)
    finally:
        log.close()
    code, out, _ = run("trace", "trace-a2a", str(path))
    assert code == 0
    assert "(agents: executor, planner)" in out
    assert "planner > executor" in out


def test_verify_command(log_path: Path, tmp_path: Path) -> None:
    code, out, _ = run("verify", str(log_path))
    assert (code, out) == (
        0,
        "OK: 262 chained record(s) in 1 chain(s) verified (0 unchained line(s) ignored)\n",
    )
    raw = log_path.read_text().splitlines(keepends=True)
    cut = tmp_path / "cut.log"
    cut.write_text("".join(raw[:199] + raw[200:]))
    code, out, _ = run("verify", str(cut))
    assert code == 1
    assert out.startswith(f"FAILED: first break at {cut}:200 (seq 201): seq jumps from 199")
    code, out, _ = run("verify", str(cut), "--format", "json")
    report = json.loads(out)
    assert (code, report["ok"], report["breaks"][0]["line"]) == (1, False, 200)


def test_malformed_lines_are_reported_and_the_rest_processed(
    log_path: Path, tmp_path: Path, calls: list[dict[str, Any]]
) -> None:
    raw = log_path.read_text().splitlines(keepends=True)
    damaged = tmp_path / "damaged.log"
    damaged.write_text("".join([*raw[:3], "oops\n", *raw[3:10], '{"half": \n', *raw[10:]]))
    code, out, err = run("summary", str(damaged), "--format", "json")
    assert code == 0
    assert json.loads(out)["total"]["calls"] == len(calls)
    assert err.splitlines() == [
        f"{damaged}:4: malformed line: not valid JSON (Expecting value at column 1)",
        f"{damaged}:12: malformed line: not valid JSON (Expecting value at column 10)",
        "2 malformed line(s) skipped",
    ]


def test_gzip_and_stdin(log_path: Path, tmp_path: Path, calls: list[dict[str, Any]]) -> None:
    packed = tmp_path / "audit.log.gz"
    packed.write_bytes(gzip.compress(log_path.read_bytes()))
    failed = [c["correlation_id"] for c in calls if not c["success"]]
    for argv, stdin in (
        ([str(packed)], None),
        (["-"], log_path.read_bytes()),
        ([], gzip.compress(log_path.read_bytes())),
        ([str(packed), str(log_path)], None),
    ):
        code, out, _ = run("show", *argv, "--failed", "--format", "json", stdin=stdin)
        assert code == 0
        assert correlations(out) == failed * (2 if len(argv) == 2 else 1)


def test_follow_with_stop_event_and_limit(tmp_path: Path) -> None:
    path = tmp_path / "live.log"
    spec = AuditSpec(sink="file", path=str(path), chain=True)
    log = audit.AuditLog(spec, io.StringIO(), agent_id="planner-01")
    out = _GrowingText()
    stop = threading.Event()
    result: list[int] = []
    argv = ["show", str(path), "--follow", "--format", "json", "--limit", "3", "--agent", "x*"]
    thread = threading.Thread(target=lambda: result.append(main(argv, stdout=out, stop=stop)))
    thread.start()
    try:
        for number in range(3):
            log.event("noise", n=number)  # not a call: filtered out
            log.call(_call(f"x-{number}", number))
            assert out.wait_for_lines(number + 1)
        thread.join(10)
        assert result == [0]  # --limit ended it
        table_out = _GrowingText()
        argv = ["show", str(path), "--follow"]
        thread = threading.Thread(target=lambda: main(argv, stdout=table_out, stop=stop))
        thread.start()
        assert table_out.wait_for_lines(5)  # header, rule, three rows
        stop.set()
        thread.join(10)
        assert not thread.is_alive()
    finally:
        stop.set()
        log.close()
    assert [json.loads(line)["agent_id"] for line in out.lines()] == ["x-0", "x-1", "x-2"]


def test_usage_and_input_errors(tmp_path: Path) -> None:
    code, _, err = run("show", str(tmp_path / "missing.log"))
    assert code == 2
    assert "No such file or directory" in err
    with pytest.raises(SystemExit) as exc:
        run("show", "--since", "yesterday", "x.log")
    assert exc.value.code == 2
    code, _, err = run("show", "a.log", "b.log", "--follow")
    assert (code, err) == (2, "error: --follow takes exactly one FILE\n")


def test_register_adds_the_audit_command_to_a_parent_parser(log_path: Path) -> None:
    parser = argparse.ArgumentParser(prog="egress-gateway")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["audit", "summary", str(log_path), "--format", "json"])
    out = io.StringIO()
    assert args.func(args, stdout=out) == 0
    assert json.loads(out.getvalue())["total"]["calls"] == 240


def test_module_entry_point(log_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gateway.audit.query", "verify", str(log_path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert (done.returncode, done.stdout.split(":")[0]) == (0, "OK")


class _GrowingText(io.StringIO):
    """A stdout the test can wait on: lines written so far, with a bounded wait."""

    def __init__(self) -> None:
        super().__init__()
        self._changed = threading.Condition()

    def write(self, text: str) -> int:
        with self._changed:
            written = super().write(text)
            self._changed.notify_all()
            return written

    def lines(self) -> list[str]:
        with self._changed:
            return self.getvalue().splitlines()

    def wait_for_lines(self, count: int, timeout: float = 10) -> bool:
        with self._changed:
            return self._changed.wait_for(
                lambda: len(self.getvalue().splitlines()) >= count, timeout
            )


def _call(agent: str, number: int) -> dict[str, Any]:
    return {
        "agent_id": agent,
        "trace_id": "t-live",
        "correlation_id": f"live-{number}",
        "target_system": "openai",
        "endpoint": "/v1/chat/completions",
        "method": "POST",
        "upstream": "https://api.openai.com:443",
        "decision": "allowed",
        "success": True,
        "status_code": 200,
        "error_code": None,
        "retryable": None,
        "attempts": 1,
        "latency_ms": 12.5,
        "upstream_latency_ms": 11.0,
        "tokens_used": 3,
        "tokens_input": 2,
        "tokens_output": 1,
        "tokens_cached": 0,
        "request_bytes": 10,
        "request_sha256": None,
        "response_bytes": 20,
        "api_key_ref": "vault://openai-key",
        "rate_limit_group": None,
        "rate_limit_wait_ms": 0.0,
        "idempotency_key": None,
        "replayed": False,
        "warnings": [],
        "metadata": {},
    }


async def test_the_summary_shows_small_spends(
    upstream_factory: Any, sidecar_factory: Any, tmp_path: Any
) -> None:
    """An auditor's table: a day of gpt-4o-mini calls costs cents; four decimals showed
    a real spend of 0.000028 USD as 0.0000."""
    upstream: FakeUpstream = await upstream_factory()
    sc: Sidecar = await sidecar_factory(policy(upstream.url, {}))
    await sc.call(call())
    record = {**sc.audit_records()[-1], "cost_usd": 0.000028}
    path = tmp_path / "audit.jsonl"
    path.write_text(json.dumps(record) + "\n")
    out = io.StringIO()
    assert main(["summary", str(path)], stdout=out, stderr=io.StringIO()) == 0
    rows = [line.split() for line in out.getvalue().splitlines() if line.strip()[:4] == "all "]
    assert rows[0][-1] == "0.000028"
