"""A secret lives no longer than the policy and the sidecar that used it: the memo of
each target's credential (which holds its secret) is rebuilt on reload and dropped on
close, so after either the old secret object is gone (weak references)."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
from aiohttp import web

from gateway.secrets import Secret
from tests.conftest import compile_policy, envelope, openai_target, policy_yaml

KEY = "sk-memo-lifetime-0123456789abcdef"


def _secrets() -> list[weakref.ref[Secret]]:
    """Weak references to every live Secret holding :data:`KEY`."""
    gc.collect()
    return [weakref.ref(o) for o in gc.get_objects() if isinstance(o, Secret) and o.reveal() == KEY]


async def _ok(_: web.Request) -> web.Response:
    return web.json_response({"choices": [], "usage": {"total_tokens": 1}})


pytestmark = pytest.mark.usefixtures("frozen_heap")


async def _used_once(upstream_factory: Any, sidecar_factory: Any, monkeypatch: Any) -> Any:
    monkeypatch.setenv("TEST_OPENAI_KEY", KEY)
    up = await upstream_factory(_ok)
    sc = await sidecar_factory(compile_policy({"fake-openai": openai_target(up.url)}))
    status, answer = await sc.call(envelope())
    assert status == 200, answer
    held = _secrets()
    assert held  # the call's credential is kept for the next call: what must not outlive
    return sc, up, held


async def test_a_reload_lets_the_old_secret_go(
    upstream_factory, sidecar_factory, monkeypatch, tmp_path
) -> None:
    sc, up, held = await _used_once(upstream_factory, sidecar_factory, monkeypatch)
    path = tmp_path / "policy.yaml"
    path.write_text(policy_yaml({"fake-openai": openai_target(up.url)}))
    assert await sc.gateway.reload(str(path)) is True
    gc.collect()
    assert [ref for ref in held if ref() is not None] == []


async def test_a_close_lets_the_secret_go(upstream_factory, sidecar_factory, monkeypatch) -> None:
    sc, _, held = await _used_once(upstream_factory, sidecar_factory, monkeypatch)
    await sc.gateway.aclose()
    gc.collect()
    assert [ref for ref in held if ref() is not None] == []
