"""Real Redis for the cluster-scope tests (no fakes: the wire behaviour is the point).

The fixtures are shared through ``tests/conftest.py``: a test asks for them by name.

- :func:`redis_prefix`: the shared Redis on 127.0.0.1:6379, a key prefix unique to the
  test, and every key under it deleted afterwards.
- :func:`private_redis`: a ``redis-server`` process of the test's own on a free port, which
  the test can stop (SIGKILL) and start again on the same port, and whose
  ``INFO commandstats`` counts only this test's commands.

When Redis (or the ``redis-server`` binary) is missing the tests skip with the reason
shown; with ``REQUIRE_REDIS=1`` (CI) they fail instead.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

SHARED_URL = "redis://127.0.0.1:6379/0"
_START_TIMEOUT_S = 10.0


def require_or_skip(reason: str) -> None:
    """Fail with ``reason`` when REQUIRE_REDIS=1, else skip with it."""
    if os.environ.get("REQUIRE_REDIS") == "1":
        pytest.fail(f"{reason} (REQUIRE_REDIS=1)")
    pytest.skip(f"{reason}; start redis-server, or set REQUIRE_REDIS=1 to make this a failure")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _ping(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def delete_prefix(url: str, prefix: str) -> int:
    """Delete every key under ``prefix:``; how many there were."""
    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=500))
        if keys:
            client.delete(*keys)
        return len(keys)
    finally:
        client.close()


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    """A fresh key prefix on the shared Redis (127.0.0.1:6379); its keys are deleted after."""
    if not _ping(SHARED_URL):
        require_or_skip(f"no Redis answers at {SHARED_URL}")
    prefix = f"egwtest-{uuid.uuid4().hex[:12]}"
    yield prefix
    delete_prefix(SHARED_URL, prefix)


class PrivateRedis:
    """``redis-server`` on a fixed free loopback port, stoppable and restartable."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert self.proc is None, "already running"
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.workdir),
                "--logfile", str(self.workdir / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not _ping(self.url):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
                raise AssertionError(f"redis-server did not start on {self.port}: {log}")
            time.sleep(0.01)

    def kill(self) -> None:
        """SIGKILL, as a crash: no goodbye to the clients."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=2, socket_connect_timeout=2)

    def commandstats(self) -> dict[str, int]:
        """Calls per command since the last :meth:`reset_stats` (``evalsha``, ``hello``...),
        commands run inside scripts included."""
        with self.client() as client:
            info = client.info("commandstats")
        return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in info.items()}

    def reset_stats(self) -> None:
        with self.client() as client:
            client.config_resetstat()


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    binary = shutil.which("redis-server")
    if binary is None:
        require_or_skip("no redis-server binary on PATH")
        raise AssertionError("unreachable")
    server = PrivateRedis(binary, tmp_path)
    server.start()
    yield server
    if server.proc is not None:
        server.kill()
