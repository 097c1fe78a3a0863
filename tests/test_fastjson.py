"""gateway.fastjson: orjson and the stdlib write the same JSON values."""

from __future__ import annotations

import json
import tracemalloc
from typing import Any

import pytest

from gateway import fastjson

VALUES: list[Any] = [
    {"model": "m", "messages": [{"role": "user", "content": 'Zoë ☃ 😀 \n " \\ \u2028'}]},
    {"n": [0, -1, 2**63 - 1, -(2**63), 1.5, -0.0, 1e16, 1e-7, 0.1]},
    {"big": 2**70},  # past 64 bits: orjson refuses, the stdlib writes it
    {"ok": True, "no": False, "none": None, "empty": {}, "list": []},
    [1, "two", [3, {"four": 4}]],
    "just a string",
]


@pytest.mark.parametrize("value", VALUES, ids=range(len(VALUES)))
def test_compact_matches_the_stdlib(value: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fast = fastjson.compact(value)
    monkeypatch.setattr(fastjson, "orjson", None)  # our optional import, not a library
    plain = fastjson.compact(value)
    assert plain == json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
    assert json.loads(fast) == json.loads(plain) == value
    if not (isinstance(value, dict) and "n" in value):  # floats: orjson 1e16, stdlib 1e+16
        assert fast == plain  # the same bytes: escapes, no whitespace, raw UTF-8


@pytest.mark.parametrize("value", VALUES, ids=range(len(VALUES)))
def test_held_bytes_are_the_same_and_cost_their_length(value: Any) -> None:
    assert fastjson.compact(value, held=True) == fastjson.compact(value)
    tracemalloc.start()
    try:
        kept = fastjson.compact(value, held=True)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < len(kept) + 128  # the bytes object's header, not a 4 KiB buffer


def test_default_and_refusals_are_the_stdlib_ones() -> None:
    class Odd:
        def __str__(self) -> str:
            return "odd"

    assert json.loads(fastjson.compact({"x": Odd()}, default=str)) == {"x": "odd"}
    with pytest.raises(TypeError):
        fastjson.compact({"x": Odd()})
    with pytest.raises(UnicodeEncodeError):
        fastjson.compact({"x": "\ud800"})
    assert json.loads(fastjson.compact({1: "a"})) == {"1": "a"}  # as the stdlib does
