"""Running the sidecar as a real process (``python -m gateway serve``), for the tests
that need one: lifecycle (SIGTERM, reload), footprint (RSS, imports), cluster sidecars."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parent.parent


class Process:
    """``python -m gateway serve`` with its stdout collected line by line."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[dict[str, Any]] = []
        self.raw: list[str] = []
        self.calls_url = ""
        self.ops_url = ""
        self.terminated = False
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for raw in self.proc.stdout:
            text = raw.decode().strip()
            if not text:
                continue
            self.raw.append(text)
            record = json.loads(text)  # every stdout line is JSON
            self.lines.append(record)
            if record.get("event") == "listening":
                self.calls_url = "http://" + record["calls"]
                self.ops_url = "http://" + record["ops"]

    @classmethod
    async def start(
        cls,
        policy_path: Path,
        *,
        python_flags: Sequence[str] = (),
        stderr: IO[bytes] | None = None,
        drop_env: Collection[str] = (),
        env: Mapping[str, str] | None = None,
        timeout_s: float = 20,
    ) -> Process:
        """``python [python_flags] -m gateway serve`` on ephemeral ports, without the
        caller's ``GATEWAY_*`` variables (and ``drop_env``) but with ``env``; returned once
        it listens, or once it exited (then ``calls_url`` is empty)."""
        environ = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("GATEWAY_") and k not in drop_env
        } | dict(env or {})
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *python_flags, "-m", "gateway", "serve",
            "--policy", str(policy_path), "--port", "0", "--ops-port", "0",
            cwd=ROOT, env=environ, stdout=asyncio.subprocess.PIPE, stderr=stderr,
        )  # fmt: skip
        process = cls(proc)
        try:
            await wait_for(
                lambda: bool(process.calls_url) or proc.returncode is not None, timeout_s
            )
        except BaseException:  # not listening in time: no sidecar outlives its test
            await process.kill()
            raise
        return process

    @classmethod
    async def start_many(cls, count: int, policy_path: Path, **options: Any) -> list[Process]:
        """``count`` sidecars started at once (``start``'s options); if one fails to
        start, the others are killed before its error is raised."""
        started = await asyncio.gather(
            *(cls.start(policy_path, **options) for _ in range(count)), return_exceptions=True
        )
        failed = [result for result in started if isinstance(result, BaseException)]
        if failed:
            for result in started:
                if isinstance(result, Process):
                    await result.kill()
            raise failed[0]
        return [result for result in started if isinstance(result, Process)]

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()

    def events(self, name: str) -> list[dict[str, Any]]:
        return [line for line in self.lines if line.get("event") == name]

    def terminate(self) -> None:
        self.terminated = True
        self.proc.send_signal(signal.SIGTERM)

    async def stop(self) -> int:
        if self.proc.returncode is None and not self.terminated:
            self.terminate()
        code = await asyncio.wait_for(self.proc.wait(), 15)
        await self._reader
        return code


def item_target(url: str, **extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "base_url": url,
        "endpoints": [{"path": "/items/*", "methods": ["GET", "POST"]}],
    }
    spec.update(extra)
    return spec
