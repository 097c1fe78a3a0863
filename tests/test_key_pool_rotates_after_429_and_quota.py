"""A key pool (``credential.refs``): a key refused with 429 or a quota error rests (for
the wait asked, else a cool-down) and the next key serves the same call at once;
QUOTA_EXHAUSTED only when every key is spent. Records name keys by reference only."""

from __future__ import annotations

import json

import pytest
from aiohttp import web

from gateway.call.keys import pick
from tests.conftest import compile_policy, envelope, openai_target

KEYS = {"POOL_KEY_A": "sk-pool-A-NOTREAL-0001", "POOL_KEY_B": "sk-pool-B-NOTREAL-0002"}
QUOTA = {"error": {"message": "You exceeded your current quota", "type": "insufficient_quota",
                   "code": "insufficient_quota"}}  # fmt: skip


@pytest.fixture(autouse=True)
def _keys(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in KEYS.items():
        monkeypatch.setenv(name, value)


def _pool_target(url: str) -> dict:
    target = openai_target(url, retry={"max_retries": 0})
    target["credential"] = {
        "header": "Authorization",
        "format": "Bearer {secret}",
        "refs": ["env://POOL_KEY_A", "env://POOL_KEY_B"],
    }
    return target


def _key_of(request: web.Request) -> str:
    return request.headers["Authorization"].removeprefix("Bearer ")


async def _sidecar(upstream_factory, sidecar_factory, handler):
    up = await upstream_factory(handler)
    sc = await sidecar_factory(compile_policy({"llm": _pool_target(up.url)}))
    return up, sc


def _env() -> dict:
    return envelope(target_system="llm", api_key_ref=None, max_retries=0)


async def test_a_rate_limited_key_rests_and_the_next_serves_the_same_call(
    upstream_factory, sidecar_factory
):
    async def handler(request: web.Request) -> web.StreamResponse:
        if _key_of(request) == KEYS["POOL_KEY_A"]:
            return web.json_response(
                {"error": {"message": "slow"}}, status=429, headers={"retry-after": "600"}
            )
        return web.json_response({"ok": True})

    up, sc = await _sidecar(upstream_factory, sidecar_factory, handler)
    _, body = await sc.call(_env())
    assert body["success"] is True
    assert [_key_of_seen(s) for s in up.seen] == ["A", "B"]
    _, body = await sc.call(_env())  # A rests for its Retry-After: B at once
    assert body["success"] is True
    assert [_key_of_seen(s) for s in up.seen] == ["A", "B", "B"]
    first, second = sc.audit_records()
    assert first["api_key_ref"] == "env://POOL_KEY_B"
    assert first["attempts"] == 2
    assert second["attempts"] == 1
    # Each attempt with the key it was sent with: A refused (429), B answered.
    assert [(t["api_key_ref"], t["outcome"], t["upstream_status"]) for t in first["tried"]] == [
        ("env://POOL_KEY_A", "credential_changed", 429),
        ("env://POOL_KEY_B", "ok", 200),
    ]
    assert second["tried"] is None  # one attempt: nothing to list
    assert not any(v in json.dumps(sc.audit_records()) for v in KEYS.values())


def _key_of_seen(seen) -> str:
    key = seen.headers["Authorization"].removeprefix("Bearer ")
    return "A" if key == KEYS["POOL_KEY_A"] else "B"


async def test_quota_exhausted_only_when_every_key_is_spent(upstream_factory, sidecar_factory):
    async def spent(_: web.Request) -> web.StreamResponse:
        return web.json_response(QUOTA, status=429)

    up, sc = await _sidecar(upstream_factory, sidecar_factory, spent)
    status, body = await sc.call(_env())
    assert body["error"]["code"] == "QUOTA_EXHAUSTED"
    assert status == 429
    assert [_key_of_seen(s) for s in up.seen] == ["A", "B"]  # both tried, once each
    _, body = await sc.call(_env())  # every key rests: not sent
    assert body["error"]["code"] == "QUOTA_EXHAUSTED"
    assert body["error"]["details"]["reason"] == "every_key_resting"
    assert body["error"]["suggested_retry_after"] > 0
    assert up.hits == 2


async def test_every_key_rate_limited_is_capacity_exceeded(upstream_factory, sidecar_factory):
    async def limited(_: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "slow"}}, status=429)

    up, sc = await _sidecar(upstream_factory, sidecar_factory, limited)
    _, body = await sc.call(_env())
    assert body["error"]["code"] == "CAPACITY_EXCEEDED"
    assert up.hits == 2
    _, body = await sc.call(_env())
    assert body["error"]["code"] == "CAPACITY_EXCEEDED"
    assert body["error"]["details"]["reason"] == "every_key_resting"
    assert up.hits == 2


def test_pick_takes_the_first_key_not_resting() -> None:
    refs = ["a", "b", "c"]
    assert pick(refs, {}, 10.0) == "a"
    assert pick(refs, {"a": 11.0}, 10.0) == "b"
    assert pick(refs, {"a": 11.0, "b": 10.0}, 10.0) == "b"  # its rest is over
    assert pick(refs, {"a": 11.0, "b": 11.0, "c": 12.0}, 10.0) is None
