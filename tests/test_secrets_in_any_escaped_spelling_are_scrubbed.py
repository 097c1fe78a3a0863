"""A secret spelled with any mix of JSON escapes (RFC 8259 section 7: any character as
``\\uXXXX`` in either hex case; ``"``, ``\\``, ``/`` also as ``\\"``, ``\\\\``, ``\\/``)
or percent-encoded bytes (``%XX`` in either case, RFC 3986 section 2.1) is redacted whole,
from text and from bytes; a text holding no secret keeps every byte, escapes and all."""

from __future__ import annotations

import json
import uuid
from urllib.parse import quote

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.redaction import REDACTED, register, scrub, scrub_bytes

#: Characters an encoding changes, and plain ones.
_ALPHABET = 'abcXYZ019-_.~ +/=&?#%"\\\n\té€\U0001f511'
_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _hex(code: int, upper: bool, width: int) -> str:
    text = f"{code:0{width}x}"
    return text.upper() if upper else text


def _json_char(char: str, draw: st.DrawFn) -> str:
    """``char`` as a JSON string writes it: plain where that is allowed, else escaped."""
    escape = draw(st.booleans()) or char in '"\\' or ord(char) < 0x20
    if not escape:
        return char
    if char in '"\\/' and draw(st.booleans()):
        return "\\" + char
    upper = draw(st.booleans())
    units = char.encode("utf-16-be")
    return "".join(
        "\\u" + _hex(int.from_bytes(units[i : i + 2], "big"), upper, 4)
        for i in range(0, len(units), 2)
    )


def _percent_char(char: str, draw: st.DrawFn) -> str:
    if not draw(st.booleans()) and char.isascii() and char.isalnum():
        return char
    upper = draw(st.booleans())
    return "".join("%" + _hex(byte, upper, 2) for byte in char.encode())


@st.composite
def _spelled(draw: st.DrawFn) -> tuple[str, str, str]:
    """A new secret of 8 to 80 characters, a text holding one spelling of it (JSON-escaped
    or percent-encoded, each character or not, in either hex case), and that text with
    the spelling redacted."""
    body = draw(st.text(alphabet=_ALPHABET, min_size=0, max_size=68))
    secret = (uuid.uuid4().hex[:12] + body)[: draw(st.integers(8, 80))]
    if draw(st.booleans()):
        spelling = "".join(_json_char(c, draw) for c in secret)
        template = '{"echo": "you sent @ here", "n": 1}'
        assert json.loads(template.replace("@", spelling))["echo"] == f"you sent {secret} here"
    else:
        spelling = "".join(_percent_char(c, draw) for c in secret)
        template = "GET /echo?key=@&n=1"
    return secret, template.replace("@", spelling), template.replace("@", REDACTED)


@_SETTINGS
@given(_spelled())
def test_every_spelling_of_a_secret_is_redacted_whole(case: tuple[str, str, str]) -> None:
    secret, text, redacted = case
    register(secret)
    assert scrub(text) == redacted, (secret, text)
    assert scrub_bytes(text.encode()) == redacted.encode()


@_SETTINGS
@given(st.text(alphabet='abc019 %\\"/uUe\u00e9ABCDEF', max_size=200))
def test_a_text_without_a_secret_keeps_its_bytes(text: str) -> None:
    register("kept-" + uuid.uuid4().hex)
    assert scrub(text) == text
    assert scrub_bytes(text.encode()) == text.encode()


def test_a_secret_in_an_encoded_url_is_redacted() -> None:
    secret = "sk-proj-" + uuid.uuid4().hex
    register(secret)
    for spelling in (
        secret[:10] + "%" + _hex(ord(secret[10]), True, 2) + secret[11:],
        "".join(f"%{b:02X}" for b in secret.encode()),
        "".join(f"%{b:02x}" for b in secret.encode()),
        quote(secret, safe="-_.!~*'()"),  # JavaScript's encodeURIComponent
    ):
        assert scrub(f"url=https://x/?k={spelling}&a=1") == f"url=https://x/?k={REDACTED}&a=1"
