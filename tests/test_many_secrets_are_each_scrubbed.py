"""However many secrets the sidecar holds, each is scrubbed in every form it may be
written in, from text and from bytes; secrets that share characters leave none of them."""

from __future__ import annotations

import base64
import json
import random
import subprocess
import sys
import textwrap
import uuid

from gateway import redaction
from gateway.redaction import REDACTED, register, scrub, scrub_bytes

#: Characters some encoding changes (percent, JSON, repr), and plain ones.
_NASTY = ' +/=&?#%"\\\n\té€\U0001f511'
_PLAIN = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_."


def _secrets(count: int, seed: int) -> list[str]:
    """``count`` new values of 8 to 80 characters, a third with characters that encodings
    change, the same ones for the same seed (and a unique part: the registry is global)."""
    rng = random.Random(seed)
    unique = uuid.uuid4().hex
    values = []
    for i in range(count):
        size = rng.randint(redaction.MIN_SCRUB_LENGTH, 80)
        alphabet = _PLAIN + _NASTY if i % 3 == 0 else _PLAIN
        body = "".join(rng.choice(alphabet) for _ in range(size))
        values.append(f"{i:02d}{unique[i % 24 : i % 24 + 6]}{body}"[:size])
    return values


def _texts(value: str) -> list[tuple[str, bytes]]:
    """Texts holding ``value`` in each form (as str and as UTF-8 bytes), and the forms
    that must not be left in the scrubbed text."""
    raw = value.encode("utf-8", "surrogateescape")
    texts = []
    for form in redaction.encoded_forms(value):
        text = f'{{"echo": "you sent {form} here", "n": 1}}'
        texts.append((text, text.encode("utf-8", "surrogateescape")))
    for lead in range(3):  # base64 at each alignment, inside longer bytes
        encoded = base64.b64encode(b"x" * lead + b"<" + raw + b">").decode()
        texts.append((f"data: {encoded}\n", f"data: {encoded}\n".encode()))
    escaped = "".join(f"\\u{ord(c):04x}" if c.isascii() and c.isprintable() else c for c in value)
    if "\\" not in value and '"' not in value:  # \\uXXXX escapes of every printable char
        texts.append((f'{{"x": "{escaped}"}}', f'{{"x": "{escaped}"}}'.encode()))
    return texts


def _left(value: str, scrubbed: str) -> list[str]:
    forms = [*redaction.encoded_forms(value), *redaction.base64_forms(value)]
    return [form for form in forms if form in scrubbed]


def test_fifty_secrets_are_each_scrubbed_in_every_form_from_str_and_bytes() -> None:
    values = _secrets(50, seed=35)
    for value in values:
        register(value)
    checked = 0
    for value in values:
        for text, data in _texts(value):
            as_text = scrub(text)
            as_bytes = scrub_bytes(data).decode("utf-8", "surrogateescape")
            for scrubbed in (as_text, as_bytes):
                assert REDACTED in scrubbed, (value, text)
                assert not _left(value, scrubbed), (value, text, scrubbed)
                assert value not in scrubbed
            assert as_bytes == as_text  # the two writers agree
            checked += 1
    assert checked >= 50 * 4


def test_text_holding_none_of_fifty_secrets_keeps_its_bytes() -> None:
    for value in _secrets(50, seed=36):
        register(value)
    answer = json.dumps({"choices": [{"text": "plain words, " * 120, "n": list(range(40))}]})
    assert scrub_bytes(answer.encode()) == answer.encode()
    assert scrub(answer) == answer
    escaped = answer.replace("plain", "\\u0070lain")  # escapes, no secret behind them
    assert scrub_bytes(escaped.encode()) == escaped.encode()


def test_a_secret_that_starts_another_leaves_nothing_of_the_longer() -> None:
    short = "pre-" + uuid.uuid4().hex[:12]
    long = short + "-tail-" + uuid.uuid4().hex
    register(short)  # the shorter first: it must not cut the longer one in two
    register(long)
    for text in (f"a {long} b", f"a {short} b"):
        assert scrub(text) == f"a {REDACTED} b"
        assert scrub_bytes(text.encode()) == f"a {REDACTED} b".encode()


def test_overlapping_secrets_are_one_redaction_and_adjacent_ones_two() -> None:
    first = "ovl-" + uuid.uuid4().hex
    second = first[-10:] + "-more-" + uuid.uuid4().hex  # starts with the first's end
    register(first)
    register(second)
    overlapping = first + second[10:]
    assert first in overlapping
    assert second in overlapping
    for text in (f"[{overlapping}]", f"[{first}{second}]"):
        for scrubbed in (scrub(text), scrub_bytes(text.encode()).decode()):
            assert first[4:] not in scrubbed, scrubbed
            assert second[10:] not in scrubbed, scrubbed
    assert scrub(f"[{overlapping}]") == f"[{REDACTED}]"
    assert scrub(f"[{first}{second}]") == f"[{REDACTED}{REDACTED}]"


def test_the_registry_stays_bounded_and_forgets_the_oldest() -> None:
    # In a process of its own: filling the registry would evict the other tests' values.
    code = textwrap.dedent(
        """
        from gateway import redaction
        values = [f"bounded-{i:05d}-0123456789abcdef" for i in range(redaction._MAX_TRACKED + 50)]
        for value in values:
            redaction.register(value)
        assert len(redaction._values) == redaction._MAX_TRACKED
        assert redaction.scrub(values[0]) == values[0]  # forgotten
        assert redaction.scrub(values[-1]) == redaction.REDACTED
        assert redaction.scrub(values[50]) == redaction.REDACTED
        kept = set()
        for orders in redaction._grams.values():
            kept |= orders if isinstance(orders, set) else {orders}
        assert kept == {entry.order for entry in redaction._values.values()}
        assert len(redaction._by_order) == redaction._MAX_TRACKED
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.stdout.strip() == "ok", done.stderr[-2000:]


def test_text_that_utf8_cannot_encode_is_still_scrubbed() -> None:
    # A lone surrogate (not one of surrogateescape's) stops the byte-level search: the
    # text is then searched for every value's forms.
    values = _secrets(20, seed=37)
    for value in values:
        register(value)
    assert scrub(f"\ud800 {values[7]} \ud800") == f"\ud800 {REDACTED} \ud800"
    assert scrub("\ud800 nothing") == "\ud800 nothing"
