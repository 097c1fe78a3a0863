"""``file:///path`` references: a mounted Kubernetes secret or any file holding one value.

The file is checked at each call, so a secret rotated by the kubelet (an atomic symlink
swap) or rewritten in place is picked up without a restart. One trailing newline is
removed.

Each call ``stat``s the file (one system call) and reads it again only when what stat
reports changed (device, inode, size, mtime, ctime; ctime also moves on a chmod, so a
revoked permission is noticed). Like git's "racy" index entries, a file modified within
:data:`RACY_S` of being read is not trusted to the cache: file timestamps tick at the
kernel's clock granularity, so a same-size rewrite in the same tick would look unchanged.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Final

from gateway.errors import SecretAccessDenied, SecretNotFound
from gateway.policy.refs import SecretRef
from gateway.secrets.base import ResolvedSecret, Secret

#: A credential file larger than this is a mistake (a mounted directory, a log file).
MAX_SECRET_FILE_BYTES = 64 * 1024
#: A file changed less than this many seconds before it was read is read again next time.
RACY_S: Final = 2.0
#: Distinct files cached at most (refs are bounded by the policy; this bounds reloads).
MAX_CACHED_FILES: Final = 256

_Stamp = tuple[int, int, int, int, int]


def _stamp(st: os.stat_result) -> _Stamp:
    """What tells a file's content changed: another file, size, write or inode change."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class FileResolver:
    #: Reads local state only, never waits (SecretResolvers.is_local).
    local: Final = True

    def __init__(self) -> None:
        self._cache: dict[str, tuple[_Stamp, ResolvedSecret]] = {}

    async def resolve(self, ref: SecretRef) -> ResolvedSecret:
        try:
            st = os.stat(ref.path)
        except OSError:
            st = None  # reading reports why, with the usual errors
        if st is not None:
            stamp = _stamp(st)
            cached = self._cache.get(ref.path)
            if cached is not None and cached[0] == stamp:
                return cached[1]
        resolved = self._read(ref)
        if st is not None and time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > RACY_S * 1e9:
            if len(self._cache) >= MAX_CACHED_FILES:
                self._cache.clear()
            self._cache[ref.path] = (stamp, resolved)
        return resolved

    def _read(self, ref: SecretRef) -> ResolvedSecret:
        path = Path(ref.path)
        try:
            # A small read from tmpfs: cheaper than a thread hop.
            with path.open("rb") as fh:
                raw = fh.read(MAX_SECRET_FILE_BYTES + 1)
        except FileNotFoundError:
            raise SecretNotFound(
                f"secret reference {ref.raw!r}: file {ref.path} does not exist",
                details={"api_key_ref": ref.raw, "reason": "file_missing"},
            ) from None
        except PermissionError:
            raise SecretAccessDenied(
                f"secret reference {ref.raw!r}: the sidecar may not read {ref.path}",
                details={"api_key_ref": ref.raw, "reason": "file_forbidden"},
            ) from None
        except OSError as exc:
            raise SecretNotFound(
                f"secret reference {ref.raw!r}: cannot read {ref.path} ({exc.strerror})",
                details={"api_key_ref": ref.raw, "reason": "file_unreadable"},
            ) from None
        if len(raw) > MAX_SECRET_FILE_BYTES:
            raise SecretNotFound(
                f"secret reference {ref.raw!r}: {ref.path} is larger than "
                f"{MAX_SECRET_FILE_BYTES} bytes; it does not look like a credential",
                details={"api_key_ref": ref.raw, "reason": "file_too_large"},
            )
        try:
            value = raw.decode("utf-8").removesuffix("\n").removesuffix("\r")
        except UnicodeDecodeError:
            raise SecretNotFound(
                f"secret reference {ref.raw!r}: {ref.path} is not UTF-8 text",
                details={"api_key_ref": ref.raw, "reason": "file_not_text"},
            ) from None
        if not value:
            raise SecretNotFound(
                f"secret reference {ref.raw!r}: {ref.path} is empty",
                details={"api_key_ref": ref.raw, "reason": "file_empty"},
            )
        return ResolvedSecret(Secret(value))

    def unchanged(self, ref: SecretRef, resolved: ResolvedSecret) -> bool:
        """True if :meth:`resolve` would answer ``resolved`` from its cache now: the file's
        ``stat`` is the one cached with it (the same test, so a rewritten, swapped or
        re-permissioned file, or an invalidated entry, is read again)."""
        cached = self._cache.get(ref.path)
        if cached is None or cached[1] is not resolved:
            return False
        try:
            st = os.stat(ref.path)
        except OSError:
            return False
        return cached[0] == _stamp(st)

    def invalidate(self, ref: SecretRef) -> None:
        self._cache.pop(ref.path, None)

    async def aclose(self) -> None:
        self._cache.clear()
