"""``env://NAME`` references: the value of an environment variable, read at each call."""

from __future__ import annotations

import os
from typing import Final

from gateway.errors import SecretNotFound
from gateway.policy.refs import SecretRef
from gateway.secrets.base import ResolvedSecret, Secret


class EnvResolver:
    """Reads ``os.environ`` (cheap, so nothing is cached)."""

    #: Reads local state only, never waits (SecretResolvers.is_local).
    local: Final = True

    async def resolve(self, ref: SecretRef) -> ResolvedSecret:
        # A trailing newline is how values often arrive (echo, Kubernetes secrets): cut it,
        # as for file:// refs.
        value = os.environ.get(ref.path, "").removesuffix("\n").removesuffix("\r")
        if not value:
            raise SecretNotFound(
                f"secret reference {ref.raw!r}: environment variable {ref.path} is not set "
                "or empty in the sidecar's environment",
                details={"api_key_ref": ref.raw, "reason": "env_missing"},
            )
        return ResolvedSecret(Secret(value))

    def unchanged(self, ref: SecretRef, resolved: ResolvedSecret) -> bool:
        """True if the variable still holds ``resolved``'s value (what :meth:`resolve`
        would read now), so a caller may keep what it made of it."""
        value = os.environ.get(ref.path, "").removesuffix("\n").removesuffix("\r")
        return bool(value) and value == resolved.secret.reveal()

    def invalidate(self, ref: SecretRef) -> None:
        """Nothing is cached."""

    async def aclose(self) -> None:
        """Nothing to close."""
