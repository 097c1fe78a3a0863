"""The audit file sink rotates exactly as the standard library's RotatingFileHandler."""

from __future__ import annotations

import logging
import logging.handlers
import random
from pathlib import Path

import pytest

from gateway.audit.file import RotatingFile, last_line


def _lines(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return [
        "".join(rng.choice('abcdé€{}:,"') for _ in range(rng.randint(1, 300))) for _ in range(count)
    ]


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize(
    ("max_bytes", "backup_count"),
    [(4096, 3), (4096, 0), (700, 1), (100, 2), (0, 3)],
)
def test_same_files_as_rotating_file_handler(
    tmp_path: Path, max_bytes: int, backup_count: int
) -> None:
    ours, stdlib = tmp_path / "ours", tmp_path / "stdlib"
    ours.mkdir()
    stdlib.mkdir()
    (ours / "audit.jsonl").write_text("an older line\n")  # appended to, not replaced
    (stdlib / "audit.jsonl").write_text("an older line\n")
    sink = RotatingFile(str(ours / "audit.jsonl"), max_bytes, backup_count)
    handler = logging.handlers.RotatingFileHandler(
        stdlib / "audit.jsonl", maxBytes=max_bytes, backupCount=backup_count, encoding="utf-8"
    )
    handler.setFormatter(logging.Formatter("%(message)s"))
    for line in _lines(max_bytes + backup_count, 200):
        sink.write(line)
        handler.handle(logging.makeLogRecord({"msg": line, "levelno": logging.INFO}))
    sink.close()
    handler.close()
    assert _files(ours) == _files(stdlib)
    if max_bytes:
        assert len(_files(ours)) == backup_count + 1  # it did rotate


def test_dev_null_never_rolls_over() -> None:
    sink = RotatingFile("/dev/null", 100, 2)
    for line in _lines(1, 50):
        sink.write(line)
    sink.close()
    assert Path("/dev/null").is_char_device()


def test_each_line_is_on_disk_before_write_returns(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    sink = RotatingFile(str(path), 0, 0)
    sink.write('{"event":"call"}')
    assert path.read_text() == '{"event":"call"}\n'
    sink.close()


def test_a_lone_surrogate_is_written_escaped_not_lost(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    sink = RotatingFile(str(path), 0, 0)
    sink.write('{"metadata":{"x":"\ud800"}}')
    sink.write('{"next":1}')
    sink.close()
    assert path.read_text().splitlines() == ['{"metadata":{"x":"\\ud800"}}', '{"next":1}']


def test_a_line_cut_short_before_the_file_was_opened_gets_its_newline(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_bytes(b'{"whole":1}\n{"cut sho')
    sink = RotatingFile(str(path), 0, 0)
    sink.write('{"next":2}')
    sink.close()
    assert path.read_text().splitlines() == ['{"whole":1}', '{"cut sho', '{"next":2}']


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"", None),
        (b"no newline at all", None),
        (b"one\n", b"one"),
        (b"one\ntwo\n", b"two"),
        (b"one\ntwo\nthree, cut sh", b"two"),
        (b"one\n\n", None),  # a blank last line: nothing to continue
        (b"a" * 200_000 + b"\n" + b"b" * 150_000 + b"\n", b"b" * 150_000),  # past blocks
        (b"b" * 150_000 + b"\n" + b"c" * 70_000, b"b" * 150_000),
    ],
    ids=["empty", "partial", "one", "two", "cut-tail", "blank", "long", "long-cut"],
)
def test_last_line_is_the_last_whole_line(
    tmp_path: Path, content: bytes, expected: bytes | None
) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_bytes(content)
    assert last_line(str(path)) == expected


def test_last_line_refuses_what_it_cannot_or_should_not_read(tmp_path: Path) -> None:
    assert last_line(str(tmp_path / "missing")) is None
    assert last_line("/dev/null") is None
    assert last_line(str(tmp_path)) is None  # a directory
    path = tmp_path / "audit.jsonl"
    path.write_bytes(b"x" * 5000 + b"\n")
    assert last_line(str(path), limit=4096) is None
    assert last_line(str(path), limit=5000) == b"x" * 5000
