"""Fingerprints written faster, never differently: the same canonical JSON
bytes whoever writes them (orjson where it spells them as the stdlib does, the stdlib's
C encoder, json.dumps), with or without orjson installed, and the same as earlier
versions computed, so a resend across a rolling upgrade of sidecars sharing a Redis
store is replayed."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway import fastjson
from gateway.idempotency import Proceed, Replay, canonical_json, fingerprint, keys
from gateway.idempotency.redis import RedisIdempotencyStore
from gateway.policy import RedisSpec
from gateway.stores.redis import RedisClient
from tests.redis_fixtures import SHARED_URL

# Computed by the sidecar before this change (commit b3e62be, json.dumps only): a
# fingerprint must never change, or a resend of a key stored by an older sidecar
# would be refused as IDEMPOTENCY_CONFLICT.
PINNED: list[tuple[dict[str, Any], str]] = [
    (
        {
            "model": "gpt-4o-mini",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 64,
            "temperature": 0,
        },
        "f8d2258603684d52c75ea6bc68f13d0237af125a0e6e903107b22cd1e03922fd",
    ),
    (
        {"temperature": 0.7, "top_p": 1e-05, "eps": 1e-07, "big": 1e16, "neg": -0.0, "n": 2**70},
        "d4ba9141715c029aa8fd5aa42c9205b7ac669fe5a91bc4ed8b6bb6fa6afc8b1a",
    ),
    (
        {"stop": None, "text": 'null v1.2 1e5 é ☃ 😀 \u2028 "q" \\ \n\t\x00', "ok": True},
        "3f15e9913b901dc5c50d20c2e69f5ba70211fda58180a4c4c8a94fb0831de993",
    ),
    (
        {"ключ": [1, {"z": 1, "a": [], "é": {}}], "": "empty key"},
        "557bf62687aef6c61d341841095588e2aa6c0db49c7ee9c95b81ee20b1d1d0f3",
    ),
]
PATHS = ["orjson", "c_encoder", "json_dumps"]


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which writer canonical_json may use: all three, orjson absent, or json.dumps only."""
    if request.param != "orjson":
        monkeypatch.setattr(fastjson, "orjson", None)  # our optional import, not a library
    if request.param == "json_dumps":
        monkeypatch.setattr(keys, "_ENCODE", None)
    return str(request.param)


def stdlib(value: Any) -> bytes:
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


@pytest.mark.parametrize(("parameters", "expected"), PINNED)
def test_fingerprints_are_those_earlier_versions_computed(
    path: str, parameters: dict[str, Any], expected: str
) -> None:
    assert fingerprint("fake-openai", "POST", "/v1/chat/completions", parameters) == expected
    reordered = dict(reversed(parameters.items()))
    assert fingerprint("fake-openai", "post", "/v1/chat/completions", reordered) == expected


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=400, deadline=None)
@given(JSON)
def test_every_writer_gives_the_stdlib_bytes(value: Any) -> None:
    expected = stdlib(value)
    fast = fastjson.sorted_compact(value)
    assert fast is None or fast == expected
    assert canonical_json(value) == expected
    assert keys._ENCODE is not None
    assert "".join(keys._ENCODE(value, 0)).encode() == expected


def test_orjson_writes_only_what_it_spells_as_the_stdlib() -> None:
    if fastjson.orjson is None:
        pytest.skip("orjson (the fast extra) is not installed")
    plain = {"model": "m", "messages": [{"content": 'é \n "x"'}], "max_tokens": 64, "t": 0}
    assert fastjson.sorted_compact(plain) == stdlib(plain)  # the fast path is taken
    for refused in (
        {"temperature": 0.7},  # any float
        {"eps": 1e-07},  # orjson: 1e-7
        {"eps": 1e-05},  # orjson: 0.00001
        {"stop": None},  # orjson writes NaN as null: a null is not trusted
        {"n": float("nan")},
        {"n": 2**70},  # orjson refuses it
        {1: "non-str key"},
        {"s": "\ud800"},
    ):
        assert fastjson.sorted_compact(refused) is None, refused
    assert fastjson.sorted_compact({"text": "v1.2"}) is None  # a digit and "." in a text


def test_errors_are_json_dumps_errors(path: str) -> None:
    cycle: list[Any] = []
    cycle.append(cycle)
    with pytest.raises(ValueError, match="JSON compliant"):
        canonical_json({"v": float("nan")})
    with pytest.raises(ValueError, match="Circular reference"):
        canonical_json(cycle)
    with pytest.raises(TypeError, match="not JSON serializable"):
        canonical_json({"v": object()})
    with pytest.raises(UnicodeEncodeError):
        canonical_json({"v": "\ud800"})
    assert canonical_json({1: 2}) == b'{"1":2}'  # as json.dumps writes a non-str key
    assert canonical_json({"big": 2**70}) == b'{"big":1180591620717411303424}'


async def test_a_key_stored_by_an_older_sidecar_is_replayed(redis_prefix: str) -> None:
    """The rolling upgrade: an older sidecar (json.dumps + SHA-256, as below) stored the
    answer in the shared Redis; this one's fingerprint of the resend matches it, on
    every writer, so the resend is replayed and nothing is sent twice."""
    parameters, _ = PINNED[1]  # floats the writers spell differently
    doc = {"endpoint": "/v1/chat/completions", "method": "POST", "parameters": parameters}
    old_fp = hashlib.sha256(stdlib({**doc, "target_system": "fake-openai"})).hexdigest()
    old = RedisIdempotencyStore(RedisClient(RedisSpec(key_prefix=redis_prefix), url=SHARED_URL))
    new = RedisIdempotencyStore(RedisClient(RedisSpec(key_prefix=redis_prefix), url=SHARED_URL))
    try:
        claim = await old.begin("fake-openai:k-upgrade", old_fp, lease_s=5)
        assert isinstance(claim, Proceed)
        assert await old.complete("fake-openai:k-upgrade", claim.token, b"answer", ttl_s=60)
        for writer in PATHS:
            with pytest.MonkeyPatch.context() as patch:
                if writer != "orjson":
                    patch.setattr(fastjson, "orjson", None)
                if writer == "json_dumps":
                    patch.setattr(keys, "_ENCODE", None)
                fp = fingerprint("fake-openai", "POST", "/v1/chat/completions", parameters)
            assert await new.begin("fake-openai:k-upgrade", fp, lease_s=5) == Replay(b"answer")
    finally:
        for store in (old, new):
            await store.aclose()
            await store.client.aclose()
