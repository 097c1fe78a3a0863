"""Policy hot reload: watch the policy file, validate the new one, swap it in whole.

Kubernetes updates a mounted ConfigMap by swapping a symlink (``..data``), which
changes neither the mounted path nor, reliably, its mtime as seen through the link; so
the watcher compares what ``os.stat`` reports for the resolved file (device, inode,
size, mtime) on a short interval. Polling is the robust choice here: inotify on
ConfigMap mounts misses symlink swaps unless the directory is watched.

An invalid new policy is refused with a log line naming every problem, and the old one
stays in force. SIGHUP triggers a reload at once. Applied or refused, a reload is an
audit record of its own (``policy_reload``): :func:`applied_fields`, :func:`refused_fields`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from gateway.audit import get_logger
from gateway.policy import PolicySet

_log = get_logger("gateway.reload")


def applied_fields(old: PolicySet, new: PolicySet, restart_needed: list[str]) -> dict[str, Any]:
    """The ``policy_reload`` record of ``new`` replacing ``old``: both digests, the
    top-level keys that changed, the targets, those changed, and the keys whose change
    needs a restart."""
    changed = [k for k in type(new.policy).model_fields if _differs(old, new, k)]
    changed_targets = sorted(
        n
        for n in set(old.targets) | set(new.targets)
        if (old.targets.get(n) and old.targets[n].spec)
        != (new.targets.get(n) and new.targets[n].spec)
    )
    return {
        "policy": new.source,
        "applied": True,
        "policy_sha256": new.sha256,
        "previous_policy_sha256": old.sha256,
        "changed": changed,
        "targets": sorted(new.targets),
        "changed_targets": changed_targets,
        "restart_needed_for": restart_needed,
    }


def refused_fields(source: str, problems: list[str], in_force: PolicySet) -> dict[str, Any]:
    """The ``policy_reload`` record of a refused file: its digest as it is now (None if
    unreadable; reads the file), the digest still in force, and the problems."""
    return {
        "policy": source,
        "applied": False,
        "policy_sha256": _file_sha256(source),
        "previous_policy_sha256": in_force.sha256,
        "problems": problems,
    }


def _differs(old: PolicySet, new: PolicySet, key: str) -> bool:
    return bool(getattr(old.policy, key) != getattr(new.policy, key))


def _file_sha256(path: str) -> str | None:
    try:
        with open(path, "rb") as file:
            return hashlib.file_digest(file, "sha256").hexdigest()
    except OSError:
        return None


def _fingerprint(path: Path) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)  # follows the symlink to the file in force
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class PolicyWatcher:
    """Calls ``on_change()`` when the file at ``path`` changes. Start, then ``aclose()``."""

    def __init__(
        self, path: str, on_change: Callable[[], Awaitable[object]], *, interval_s: float
    ) -> None:
        self.path = Path(path)
        self.interval_s = interval_s
        self._on_change = on_change
        self._seen = _fingerprint(self.path)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.interval_s > 0 and self._task is None:
            self._task = asyncio.create_task(self._run(), name="policy-watcher")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            now = await asyncio.to_thread(_fingerprint, self.path)
            if now is not None and now != self._seen:
                self._seen = now
                try:
                    await self._on_change()
                except Exception:  # noqa: BLE001 - the watcher must outlive a bad reload
                    _log.exception("policy_reload_crashed", policy=str(self.path))

    def mark_seen(self) -> None:
        """Record the file as it is now (after a reload triggered another way)."""
        self._seen = _fingerprint(self.path)

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
