"""What a serving process imports: only what its policy needs (docs/performance.md, "Memory").

redis-py (6.7 MiB of RSS) is imported only with a ``redis:`` section, although pybreaker
would import it whenever it is installed; rich (3 MiB, the audit CLI's tables) never in
``serve``, although structlog would import it whenever it is installed. The processes are
real ``python -v -m gateway serve``; the import log is their stderr, where ``import 'name'``
lines name the modules actually loaded (an import blocked on purpose loads nothing).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis

from tests.conftest import FakeUpstream, envelope, policy_yaml, wait_for
from tests.processes import ROOT, Process
from tests.processes import item_target as lifecycle_target
from tests.redis_fixtures import SHARED_URL

#: Top-level packages a sidecar without a ``redis:`` section and without Vault must not load.
NOT_NEEDED = {"redis", "rich", "pygments", "hvac", "requests"}

Serve = Callable[[Path], Awaitable[tuple[Process, Path]]]


_LOADED = re.compile(r"^import '([\w.]+)' # ", re.MULTILINE)


def imported(log: Path) -> set[str]:
    """The modules loaded, from a ``python -v`` log."""
    return set(_LOADED.findall(log.read_text()))


def packages(names: set[str]) -> set[str]:
    return {name.partition(".")[0] for name in names}


@pytest.fixture
async def serve_traced(tmp_path: Path) -> AsyncIterator[Serve]:
    """``await serve_traced(policy_path)``: a sidecar process and its import log."""
    started: list[Process] = []

    async def start(policy: Path) -> tuple[Process, Path]:
        log = tmp_path / f"imports-{len(started)}.log"
        with log.open("wb") as stderr:
            process = await Process.start(
                policy, python_flags=["-v"], stderr=stderr, drop_env={"REDIS_URL"}, timeout_s=30
            )
        started.append(process)
        assert process.calls_url, f"the sidecar did not start: {log.read_text()[-2000:]}"
        return process, log

    yield start
    for process in started:
        await process.kill()


def _target(url: str, **extra: Any) -> dict[str, Any]:
    defaults = {
        "retry": {"max_retries": 0},
        "circuit_breaker": {"fail_max": 3, "reset_timeout_s": 30},
        "rate_limit_group": "g",
    }
    return lifecycle_target(url, **{**defaults, **extra})


def _post_item(target: str, name: str, key: str) -> dict[str, Any]:
    return envelope(
        target_system=target,
        endpoint=f"/items/{name}",
        method="POST",
        api_key_ref=...,
        parameters={"n": name},
        idempotency_key=key,
    )


async def _post(session: aiohttp.ClientSession, sidecar: Process, env: dict[str, Any]) -> int:
    async with session.post(sidecar.calls_url + "/v1/calls", json=env) as resp:
        answer = await resp.json()
        assert answer["success"] is True, answer
        return resp.status


GROUPS = {"g": {"requests_per_second": 100, "burst": 10}}


async def test_serve_without_redis_section_imports_neither_redis_nor_rich(
    upstream: FakeUpstream, serve_traced: Serve, tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    idempotency = {"scope": "local", "methods": ["POST"]}
    policy.write_text(
        policy_yaml({"t": _target(upstream.url, idempotency=idempotency)}, rate_limit_groups=GROUPS)
    )
    sidecar, log = await serve_traced(policy)
    async with aiohttp.ClientSession() as session:  # the whole call path has run
        assert await _post(session, sidecar, _post_item("t", "a", "k-1")) == 200
    assert await sidecar.stop() == 0
    assert upstream.hits == 1
    loaded = imported(log)
    # The log does list the serve path (breaker, audit, rate limit, HTTP) ...
    assert {"pybreaker", "structlog", "aiolimiter", "aiohttp.web", "gateway.breaker"} <= loaded
    # ... and none of the packages this policy does not need.
    assert packages(loaded) & NOT_NEEDED == set()


async def test_redis_section_then_cluster_scope_by_reload(
    upstream: FakeUpstream, serve_traced: Serve, tmp_path: Path, redis_prefix: str
) -> None:
    def policy_text(scope: str) -> str:
        idempotency = {"scope": scope, "methods": ["POST"]}
        return policy_yaml(
            {"t": _target(upstream.url, idempotency=idempotency)},
            rate_limit_groups=GROUPS,
            redis={"url": SHARED_URL, "key_prefix": redis_prefix},
            server={"reload_interval_s": 0},
        )

    def keys() -> set[str]:
        with redis.Redis.from_url(SHARED_URL) as client:
            return {k.decode() for k in client.scan_iter(match=f"{redis_prefix}:*")}

    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_text("local"))
    sidecar, log = await serve_traced(policy)
    async with aiohttp.ClientSession() as session:
        assert await _post(session, sidecar, _post_item("t", "a", "k-1")) == 200
        assert keys() == set()  # local scope: nothing in Redis yet

        policy.write_text(policy_text("cluster"))
        sidecar.proc.send_signal(signal.SIGHUP)
        await wait_for(lambda: bool(sidecar.events("policy_reload")), 10)
        assert sidecar.events("policy_reload")[0]["restart_needed_for"] == []
        assert await _post(session, sidecar, _post_item("t", "b", "k-2")) == 200
        assert keys() == {f"{redis_prefix}:idem:t:k-2"}
        async with session.get(sidecar.ops_url + "/readyz") as resp:
            assert (await resp.json())["checks"]["redis"] == "ok"
    assert await sidecar.stop() == 0
    assert upstream.hits == 2
    assert {"redis", "redis.asyncio", "gateway.stores.redis"} <= imported(log)
    assert "rich" not in packages(imported(log))


def _python(code: str) -> list[Any]:
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    result: list[Any] = json.loads(done.stdout)
    return result


def test_without_hides_a_package_only_during_the_import() -> None:
    code = """if True:
        import json, sys
        from gateway.imports import without
        with without("redis"):
            import pybreaker
        hidden = "redis" in sys.modules
        import redis
        print(json.dumps([pybreaker.HAS_REDIS_SUPPORT, hidden, redis.Redis.__name__]))
    """
    assert _python(code) == [False, False, "Redis"]


def test_without_leaves_an_imported_package_alone() -> None:
    code = """if True:
        import json, sys
        import redis
        from gateway.imports import without
        with without("redis"):
            import pybreaker
        print(json.dumps([pybreaker.HAS_REDIS_SUPPORT, sys.modules["redis"] is redis]))
    """
    assert _python(code) == [True, True]
