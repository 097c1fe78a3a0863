"""gateway.literals.AnyOf: whether a text holds one of many strings, answered in one pass,
is exactly what searching each one would answer (the secret scrub trusts its "no")."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.literals import MAX_NEEDLES, AnyOf

#: Regex syntax, non-ASCII, a lone surrogate: what a pattern could get wrong.
_ALPHABET = st.sampled_from(list("ab.*+?|()[]{}^$\\-/ \t\n\"'é€\U0001f600\udcff\x00"))
_TEXT = st.text(_ALPHABET, max_size=40)
_NEEDLES = st.lists(st.text(_ALPHABET, min_size=1, max_size=6), max_size=8)


@settings(max_examples=300, deadline=None)
@given(_NEEDLES, _TEXT)
def test_text_holds_a_needle_exactly_when_one_of_them_is_in_it(
    needles: list[str], text: str
) -> None:
    assert AnyOf(needles).found(text) == any(needle in text for needle in needles)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=6), max_size=8), st.binary(max_size=40))
def test_bytes_hold_a_needle_exactly_when_find_finds_one(needles: list[bytes], data: bytes) -> None:
    expected = any(data.find(needle) >= 0 for needle in needles)
    assert AnyOf.of_bytes(needles).found_bytes(data) == expected


def test_a_needle_inside_a_longer_text_is_found_anywhere() -> None:
    any_of = AnyOf(["sk-live-0123456789", "Zm9vYmFy"])
    assert any_of.found('{"echo":"key=sk-live-0123456789&x=1"}')
    assert any_of.found("prefix Zm9vYmFy")
    assert not any_of.found("sk-live-012345678 Zm9vYmF")


def test_regex_syntax_in_a_needle_is_taken_literally() -> None:
    any_of = AnyOf(["a.b", "x|y", "(z)"])
    assert not any_of.found("aXb x z")
    assert any_of.found("(z)")


def test_a_text_with_a_lone_surrogate_is_still_searched() -> None:
    # The Rust side cannot read it; the needles are then searched one by one.
    assert AnyOf(["token-value"]).found("\udcff token-value")
    assert not AnyOf(["token-value"]).found("\udcff token")


def test_more_needles_than_the_pattern_takes_are_searched_one_by_one() -> None:
    needles = [f"needle-{i:04d}" for i in range(MAX_NEEDLES + 1)]
    any_of = AnyOf(needles)
    assert any_of.found(f"... {needles[-1]} ...")
    assert not any_of.found("needle-9999")


def test_no_needles_are_never_found() -> None:
    assert not AnyOf([]).found("anything")
    assert not AnyOf.of_bytes([]).found_bytes(b"anything")
