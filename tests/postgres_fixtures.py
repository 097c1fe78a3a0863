"""A private PostgreSQL cluster with password authentication, for the tests where a
revoked credential must really be refused (the machine's own server trusts everyone).

:func:`private_postgres` (session scope) runs ``initdb`` and ``postgres`` as the
``postgres`` user (initdb refuses root) on a free loopback port, with ``scram-sha-256``
for every TCP connection and a superuser ``vaultadmin`` that OpenBao's database secrets
engine uses to create and drop roles. Skipped where initdb or the user is missing.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ADMIN_USER = "vaultadmin"
ADMIN_PASSWORD = "admin-TEST-not-a-secret"


@dataclass
class PrivatePostgres:
    port: int
    datadir: Path

    @property
    def dsn(self) -> str:
        return f"postgresql://127.0.0.1:{self.port}/shop"

    def psql(self, sql: str, *, user: str = ADMIN_USER, password: str = ADMIN_PASSWORD) -> str:
        env = {**os.environ, "PGPASSWORD": password}
        done = subprocess.run(
            ["psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", user, "-d", "shop",
             "-v", "ON_ERROR_STOP=1", "-qAt", "-c", sql],
            capture_output=True, text=True, timeout=30, env=env,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip())
        return done.stdout.strip()


def _as_postgres(args: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["runuser", "-u", "postgres", "--", *args], **kwargs)  # type: ignore[call-overload, no-any-return]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _stop(server: subprocess.Popen[bytes], datadir: Path) -> None:
    """Fast shutdown (SIGINT: clients such as OpenBao's connections are disconnected) sent
    to the postmaster itself: runuser, signalled, would wait 2 s before killing it."""
    try:
        pid = int((datadir / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):  # not started (or gone): runuser is what is left
        server.terminate()
    else:
        os.kill(pid, signal.SIGINT)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()


@pytest.fixture(scope="session")
def private_postgres() -> Iterator[PrivatePostgres]:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found or shutil.which("runuser") is None or shutil.which("psql") is None:
        pytest.skip("initdb, runuser or psql is not installed")
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        pytest.skip("no postgres user to run initdb as")
    bindir = Path(found[-1]).parent
    root = Path(tempfile.mkdtemp(prefix="egw-pg-"))
    os.chmod(root, 0o755)  # noqa: S103 - postgres must reach its data directory
    datadir = root / "data"
    pwfile = root / "pw"
    pwfile.write_text(ADMIN_PASSWORD + "\n")
    shutil.chown(root, "postgres")
    shutil.chown(pwfile, "postgres")
    init = _as_postgres(
        [str(bindir / "initdb"), "-D", str(datadir), "-U", ADMIN_USER, f"--pwfile={pwfile}",
         "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8", "--no-sync"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    _, err = init.communicate(timeout=120)
    if init.returncode != 0:
        pytest.skip(f"initdb failed: {err.decode(errors='replace')[:300]}")
    port = _free_port()
    server = _as_postgres(
        [str(bindir / "postgres"), "-D", str(datadir), "-p", str(port), "-h", "127.0.0.1",
         "-k", str(root), "-c", "fsync=off", "-c", "max_connections=40"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    cluster = PrivatePostgres(port, datadir)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                subprocess.run(
                    ["psql", "-h", "127.0.0.1", "-p", str(port), "-U", ADMIN_USER, "-d",
                     "postgres", "-c", "CREATE DATABASE shop"],
                    check=True, capture_output=True, timeout=10,
                    env={**os.environ, "PGPASSWORD": ADMIN_PASSWORD},
                )  # fmt: skip
                break
            except subprocess.CalledProcessError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        yield cluster
    finally:
        _stop(server, datadir)
        shutil.rmtree(root, ignore_errors=True)
