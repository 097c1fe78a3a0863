"""Gateway's resources: one owner, opened in order, closed in reverse, also on a failed start.

Real objects only: the real outbound client (aiohttp), the real secret resolvers; a start
is made to fail the way an operator makes it fail (a Vault section without a token).
"""

from __future__ import annotations

import asyncio
import gc
import io
import warnings
from typing import Any

import pytest

from gateway.server.runtime import Gateway
from tests.conftest import compile_policy, openai_target

_VAULT_WITHOUT_TOKEN: dict[str, Any] = {
    "secrets": {"vault": {"address": "http://127.0.0.1:1", "auth": {"method": "token"}}}
}


def _unclosed_sessions_after_gc() -> list[str]:
    """aiohttp warns (ResourceWarning) for every ClientSession collected while open."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        gc.collect()
    return [str(w.message) for w in seen if "Unclosed client session" in str(w.message)]


@pytest.mark.usefixtures("frozen_heap")  # the sessions looked for are made in the test
async def test_a_start_whose_vault_resolver_fails_leaves_no_open_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("VAULT_TOKEN", raising=False)
    policy = compile_policy(
        {"fake-openai": openai_target("http://127.0.0.1:9")}, **_VAULT_WITHOUT_TOKEN
    )
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: reported.append(context))
    gateway = Gateway(policy, log_stream=io.StringIO())
    with pytest.raises(ValueError, match="VAULT_TOKEN"):
        await gateway.start()
    assert gateway.pipeline is None
    assert gateway.ready()[0] is False
    del gateway
    assert _unclosed_sessions_after_gc() == []
    assert [c for c in reported if "Unclosed" in str(c.get("message"))] == []


@pytest.mark.usefixtures("frozen_heap")
async def test_a_close_that_fails_in_one_part_still_closes_the_rest() -> None:
    policy = compile_policy({"fake-openai": openai_target("http://127.0.0.1:9")})
    gateway = Gateway(policy, log_stream=io.StringIO())
    await gateway.start()
    assert gateway.pipeline is not None
    upstream = gateway.pipeline.upstream
    closed: list[str] = []

    class _FailsToClose:
        async def resolve(self, ref: Any) -> Any:  # pragma: no cover - never called
            raise AssertionError

        async def aclose(self) -> None:
            closed.append("broken")
            raise OSError("this resolver cannot close")

    gateway.pipeline.resolvers.register("broken", _FailsToClose())
    with pytest.raises(OSError, match="cannot close"):
        await gateway.aclose()
    assert closed == ["broken"]
    assert upstream.closed  # opened before the resolvers, closed after them all the same
    await gateway.aclose()  # idempotent
    assert _unclosed_sessions_after_gc() == []


async def test_start_then_aclose_opens_and_closes_each_resource_once() -> None:
    policy = compile_policy({"fake-openai": openai_target("http://127.0.0.1:9")})
    gateway = Gateway(policy, log_stream=io.StringIO())
    await gateway.start()
    assert gateway.pipeline is not None
    upstream = gateway.pipeline.upstream
    assert not upstream.closed
    await gateway.aclose()
    assert upstream.closed
    assert gateway.pipeline is None
