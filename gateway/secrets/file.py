"""``file:///path`` references: a mounted Kubernetes secret or any file holding one value.

The file is read at each call, so a secret rotated by the kubelet (an atomic symlink
swap) is picked up without a restart. One trailing newline is removed.
"""

from __future__ import annotations

from pathlib import Path

from gateway.errors import SecretAccessDenied, SecretNotFound
from gateway.secrets.base import ResolvedSecret, Secret
from gateway.secrets.refs import SecretRef

#: A credential file larger than this is a mistake (a mounted directory, a log file).
MAX_SECRET_FILE_BYTES = 64 * 1024


class FileResolver:
    async def resolve(self, ref: SecretRef) -> ResolvedSecret:
        path = Path(ref.path)
        try:
            # A small read from tmpfs: cheaper than a thread hop.
            with path.open("rb") as fh:  # noqa: ASYNC230 - a few bytes from tmpfs
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

    def invalidate(self, ref: SecretRef) -> None:
        """Nothing is cached."""

    async def aclose(self) -> None:
        """Nothing to close."""
