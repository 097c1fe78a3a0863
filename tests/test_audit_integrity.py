"""Audit integrity: ``verify`` never calls an untampered log edited, and sees what was cut.

Every JSON value the writer may emit is read back exactly as it was hashed, with and
without orjson on either side (a property test over generated values, with the real
writer and the real ``verify``), and a changed byte is reported. Each start has its own
chain id, and a start that appends to its audit file continues the chain that file
ended with, so records cut from before a restart are found.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway import fastjson
from gateway.audit.log import AuditLog, new_sidecar_id
from gateway.audit.query.cli import main
from gateway.audit.query.verify import Verification, verify
from gateway.audit.schema import (
    AUDIT_FIELDS,
    CHAIN_CONTINUED_EVENT,
    GENESIS_HASH,
    AuditRecord,
    Fields,
    canonical_text,
)
from gateway.call.record import CallContext, audit_record, refusal_record
from gateway.envelope import ExternalCallResponse
from gateway.policy import AuditSpec
from tests.auditlog_helpers import read_json

CHAINED = AuditSpec(chain=True)


@contextlib.contextmanager
def _orjson(enabled: bool) -> Iterator[None]:
    """orjson on (as installed) or off (the stdlib path), for what runs inside."""
    with pytest.MonkeyPatch.context() as patch:
        if not enabled:
            patch.setattr(fastjson, "orjson", None)  # our own optional import, not a library
        yield


def _verify_text(text: str) -> Verification:
    return verify(["-"], stdin=io.BytesIO(text.encode("utf-8")))


def _write(value: Any, *, fast: bool) -> str:
    """Two chained records carrying ``value``, written by the real writer."""
    buffer = io.StringIO()
    with _orjson(fast):
        log = AuditLog(CHAINED, buffer, agent_id="a", sidecar_id="host:1:00000000")
        log.event("probe", value=value)
        record = audit_record(CallContext(started=0.0, agent_id="a"), _answer())
        record[Fields.METADATA] = {"v": value}
        log.call(record)
    return buffer.getvalue()


def _answer() -> ExternalCallResponse:
    return ExternalCallResponse(success=True, status_code=200, latency_ms=1.0)


# JSON-ish values as the writer meets them: integers of any size (up to the stdlib's
# 4300-digit conversion limit), floats of every kind, text with escapes and lone
# surrogates, lists and tuples, dicts with keys that are not strings.
_INTEGERS = st.one_of(
    st.integers(),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 2**70]),
)
_FLOATS = st.one_of(st.floats(), st.sampled_from([1e16, -0.0, 5e-324, 1.7976931348623157e308]))
_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
_KEYS = st.one_of(_TEXT, st.integers(), st.floats(), st.booleans(), st.none())
_SCALARS = st.one_of(st.none(), st.booleans(), _INTEGERS, _FLOATS, _TEXT)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(_KEYS, inner, max_size=4),
    ),
    max_leaves=16,
)
_PROPERTY = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.parametrize("writer_fast", [True, False], ids=["orjson-writer", "stdlib-writer"])
@pytest.mark.parametrize("reader_fast", [True, False], ids=["orjson-reader", "stdlib-reader"])
@_PROPERTY
@given(value=_VALUES)
def test_verify_reports_an_untampered_log_intact(
    value: Any, writer_fast: bool, reader_fast: bool
) -> None:
    text = _write(value, fast=writer_fast)
    with _orjson(reader_fast):
        result = _verify_text(text)
    assert result.ok, (result.breaks, text)
    assert result.chained == 2


def _value_span(line: str) -> tuple[int, int]:
    """Where the event's ``value`` is in its line (it comes before the writer's fields)."""
    start = line.index('"agent_id":"a","value":') + len('"agent_id":"a","value":')
    return start, line.rindex(',"event":"probe"')


def _replacement(old: int) -> st.SearchStrategy[int]:
    """Another byte, mostly of the same kind (a digit for a digit, a letter for a
    letter), so that most edits still parse and change the value rather than the syntax."""
    kinds = (b"0123456789", b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    same = next((kind for kind in kinds if old in kind), None)
    anything = st.integers(0, 255)
    likely = st.sampled_from(sorted(set(same) - {old})) if same else anything
    return st.one_of(likely, likely, anything).filter(lambda b: b != old)


@_PROPERTY
@given(value=_VALUES, data=st.data())
def test_verify_reports_an_edit_when_one_byte_of_a_value_changes(
    value: Any, data: st.DataObject
) -> None:
    text = _write(value, fast=True)
    first, rest = text.split("\n", 1)
    start, end = _value_span(first)
    raw = bytearray(first.encode("utf-8"))
    # Offsets in the UTF-8 bytes of the value.
    start, end = len(first[:start].encode("utf-8")), len(first[:end].encode("utf-8"))
    anywhere = st.integers(min_value=start, max_value=end - 1)
    # Mostly a digit or a letter: an edit of the value rather than of the JSON syntax.
    alnum = [i for i in range(start, end) if chr(raw[i]).isascii() and chr(raw[i]).isalnum()]
    at = data.draw(st.one_of(st.sampled_from(alnum), anywhere) if alnum else anywhere, "offset")
    byte = data.draw(_replacement(raw[at]), label="byte")
    raw[at] = byte
    edited = bytes(raw) + b"\n" + rest.encode("utf-8")
    result = verify(["-"], stdin=io.BytesIO(edited))
    try:
        read_back = json.loads(bytes(raw))
    except ValueError:
        read_back = None
    if read_back is not None and canonical_text(read_back) == canonical_text(json.loads(first)):
        assert result.ok, result.breaks  # the same value spelt otherwise ("1E16", "\\u00E9")
    else:
        assert not result.ok, (first, edited)
        assert result.breaks[0].line == 1


@pytest.mark.parametrize(
    "value",
    [
        2**70,
        -(2**100),
        10**400,
        -(2**63) - 1,
        1e16,
        -0.0,
        5e-324,
        math.nan,
        math.inf,
        -math.inf,
        '\udc80 lone, \\ " \n \x00 \u2028 é',
        {1: "int key", "1": "its string twin", False: "bool", None: "none", 1.5: "float"},
        {"deep": [{"a": [1, [2, [3, {"b": 2**65}]]]}]},
    ],
    ids=repr,
)
@pytest.mark.parametrize("writer_fast", [True, False], ids=["orjson-writer", "stdlib-writer"])
@pytest.mark.parametrize("reader_fast", [True, False], ids=["orjson-reader", "stdlib-reader"])
def test_values_orjson_and_the_stdlib_disagree_on_verify(
    value: Any, writer_fast: bool, reader_fast: bool
) -> None:
    text = _write(value, fast=writer_fast)
    with _orjson(reader_fast):
        result = _verify_text(text)
    assert result.ok, result.breaks


@pytest.mark.parametrize(
    ("value", "written", "edited"),
    [
        (2**70, "1180591620717411303424", "1180591620717411303425"),
        (-(2**100), "-1267650600228229401496703205376", "-1267650600228229401496703205370"),
        (1e16, "1e+16", "1e+17"),
        (5e-324, "5e-324", "5e-323"),
        ("caf\u00e9 \udc80", r'"caf\u00e9 \udc80"', r'"caf\u00e9 \udc81"'),
    ],
    ids=["2**70", "-2**100", "1e16", "5e-324", "lone-surrogate"],
)
@pytest.mark.parametrize("reader_fast", [True, False], ids=["orjson-reader", "stdlib-reader"])
def test_one_changed_byte_of_a_value_is_reported_as_an_edit(
    value: Any, written: str, edited: str, reader_fast: bool
) -> None:
    text = _write(value, fast=False)  # the stdlib spells every one of these values
    first = text.split("\n", 1)[0]
    assert f'"value":{written},' in first
    with _orjson(reader_fast):
        assert _verify_text(text).ok
        result = _verify_text(first.replace(f'"value":{written},', f'"value":{edited},') + "\n")
    [broken] = result.breaks
    assert (broken.line, broken.reason) == (1, "hash does not match the record: record edited")


def test_the_exact_reader_keeps_integers_past_64_bits() -> None:
    for number in (2**63, 2**64 - 1, 2**64, 2**70, -(2**63) - 1, -(2**100), 10**400):
        raw = json.dumps({"n": number, "x": 1.5}).encode()
        assert fastjson.loads(raw) == {"n": number, "x": 1.5}
        assert type(fastjson.loads(raw)["n"]) is int
    assert fastjson.loads(b'{"f":1e16,"g":-0.0}') == {"f": 1e16, "g": -0.0}


# --- one chain per start, continued across a restart ------------------------------------


def test_every_start_has_its_own_sidecar_id() -> None:
    ids = {new_sidecar_id() for _ in range(50)}
    assert len(ids) == 50  # same host, same pid: what a container restart reuses
    host_pid = {i.rsplit(":", 1)[0] for i in ids}
    assert len(host_pid) == 1
    assert all(len(i.rsplit(":", 1)[1]) == 8 for i in ids)
    a = AuditLog(CHAINED, io.StringIO(), agent_id="a")
    b = AuditLog(CHAINED, io.StringIO(), agent_id="a")
    assert a.sidecar_id != b.sidecar_id


def _starts(path: Path, counts: list[int], **spec: Any) -> None:
    """One AuditLog per start (as one container restarting), ``counts[i]`` events each."""
    for start, count in enumerate(counts):
        log = AuditLog(
            AuditSpec(sink="file", path=str(path), chain=True, **spec), agent_id="planner-01"
        )
        for number in range(count):
            log.event("policy_reload", start=start, version=number, padding="p" * 200)
        log.close()


def test_a_restart_continues_the_chain_its_audit_file_ended_with(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    _starts(path, [5, 3])
    lines = read_json(path)
    assert len(lines) == 9
    continued = lines[5]
    assert continued[Fields.EVENT] == CHAIN_CONTINUED_EVENT
    assert continued[Fields.SEQ] == 1
    assert continued[Fields.PREV_HASH] == lines[4][Fields.HASH]
    assert (continued["prev_sidecar_id"], continued["prev_seq"]) == (lines[0]["sidecar_id"], 5)
    assert continued["sidecar_id"] != lines[0]["sidecar_id"]
    assert [line["seq"] for line in lines] == [1, 2, 3, 4, 5, 1, 2, 3, 4]
    result = verify([str(path)])
    assert result.ok, result.breaks
    assert result.chains == 2


@pytest.mark.parametrize("cut", [[3, 4], [4], [1, 2, 3, 4]], ids=["two", "last", "all-but-first"])
def test_records_cut_just_before_a_restart_are_detected(tmp_path: Path, cut: list[int]) -> None:
    path = tmp_path / "audit.log"
    _starts(path, [5, 3])
    raw = path.read_text().splitlines(keepends=True)
    edited = tmp_path / "cut.log"
    edited.write_text("".join(line for i, line in enumerate(raw) if i not in cut))
    result = verify([str(edited)])
    assert not result.ok
    [broken] = result.breaks
    assert (broken.line, broken.seq) == (6 - len(cut), 1)
    assert broken.reason.startswith("records cut before this start")
    assert broken.reason.endswith(f"{len(cut)} record(s) missing")


def test_the_whole_earlier_chain_cut_from_before_a_restart_is_only_a_note(
    tmp_path: Path,
) -> None:
    # As when the older files were rotated away: nothing to compare with.
    path = tmp_path / "audit.log"
    _starts(path, [2, 2])
    raw = path.read_text().splitlines(keepends=True)
    (tmp_path / "tail.log").write_text("".join(raw[2:]))
    result = verify([str(tmp_path / "tail.log")])
    assert result.ok
    assert "this start continues the chain of" in result.notes[0]


def test_a_restart_after_rotation_continues_across_files(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    _starts(path, [12, 12], max_bytes=4096, backup_count=20)
    files = sorted(tmp_path.glob("audit.log.*"), key=lambda p: -int(p.suffix[1:]))
    assert files  # it did rotate
    result = verify([*map(str, files), str(path)])
    assert result.ok, result.breaks
    assert result.chains == 2


def test_a_line_cut_short_by_a_crash_stays_alone_and_the_restart_links_past_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.log"
    _starts(path, [3])
    whole = read_json(path)
    with path.open("a") as fh:
        fh.write('{"event":"policy_reload","sidecar_id":"x","seq":4,"prev_h')  # no newline
    _starts(path, [2])
    lines = path.read_text().splitlines()
    assert len(lines) == 7
    continued = json.loads(lines[4])
    assert continued["prev_seq"] == 3
    assert continued["prev_hash"] == whole[-1]["hash"]
    result = verify([str(path)])
    [broken] = result.breaks  # the cut line itself, nothing else
    assert broken.line == 4
    assert "not valid JSON" in broken.reason


def test_stdout_starts_are_separate_chains_from_genesis() -> None:
    buffer = io.StringIO()
    for _ in range(2):
        AuditLog(CHAINED, buffer, agent_id="a").event("policy_reload", version=1)
    first, second = (json.loads(line) for line in buffer.getvalue().splitlines())
    assert first["sidecar_id"] != second["sidecar_id"]
    assert first["prev_hash"] == second["prev_hash"] == GENESIS_HASH
    assert _verify_text(buffer.getvalue()).chains == 2


# --- field names defined once --------------------------------------------------------------


def test_field_constants_are_exactly_the_schema_fields() -> None:
    names = {value for key, value in vars(Fields).items() if key.isupper()}
    assert names == set(AUDIT_FIELDS)
    assert all(getattr(Fields, name.upper()) == name for name in AUDIT_FIELDS)


def test_the_record_builders_give_every_call_field_and_validate() -> None:
    written_by_the_log = {
        Fields.AUDIT_SCHEMA,
        Fields.EVENT,
        Fields.TIMESTAMP,
        Fields.LEVEL,
        Fields.SIDECAR_ID,
        Fields.SEQ,
        Fields.PREV_HASH,
        Fields.HASH,
        Fields.CHAIN_START,
    }
    call = audit_record(CallContext(started=0.0, agent_id="a"), _answer())
    refused = refusal_record(
        "a", _answer(), http_method="GET", http_path="/v1/" + "x" * 400, http_status=405
    )
    for record in (call, refused):
        assert set(record) == set(AUDIT_FIELDS) - written_by_the_log
        buffer = io.StringIO()
        AuditLog(CHAINED, buffer, agent_id="a").call(record)
        AuditRecord.model_validate_json(buffer.getvalue())
    assert (refused["http_method"], refused["http_status"]) == ("GET", 405)
    assert len(refused["http_path"]) == 256


def test_show_prints_integers_past_64_bits_exactly(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    log = AuditLog(AuditSpec(sink="file", path=str(path)), agent_id="a")
    record = audit_record(CallContext(started=0.0, agent_id="a"), _answer())
    record[Fields.METADATA] = {"id": 2**70, "neg": -(2**64) - 5}
    log.call(record)
    log.close()
    out = io.StringIO()
    assert main(["show", str(path), "--format", "json"], stdout=out) == 0
    assert json.loads(out.getvalue())["metadata"] == {"id": 2**70, "neg": -(2**64) - 5}
