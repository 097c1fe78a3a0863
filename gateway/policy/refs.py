"""Secret references, as agents write them in ``api_key_ref`` (pure parsing, no I/O).

Forms (see docs/secrets.md)::

    vault://PATH[#FIELD]   KV secret PATH on the policy's kv_mount; FIELD optional when
                           the secret holds exactly one field
    env://NAME             environment variable NAME
    file:///ABS/PATH       file content (a mounted Kubernetes secret), trailing newline cut

A reference is not a secret: it may be logged and audited. The value it resolves to may not.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Final

SCHEMES: Final = ("vault", "env", "file")
_SCHEME = re.compile(r"^[a-z][a-z0-9+.\-]{0,15}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_VAULT_PATH = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")


class InvalidSecretRef(ValueError):
    """The text is not a secret reference this sidecar understands."""


@dataclass(frozen=True, slots=True)
class SecretRef:
    """A parsed secret reference. ``raw`` is the text as written (safe to log)."""

    raw: str
    scheme: str
    path: str
    field: str | None = None

    def __str__(self) -> str:
        return self.raw


@functools.lru_cache(maxsize=1024)  # refs are few (bound by the policy); parsing is pure
def parse_ref(raw: str) -> SecretRef:
    """Parse ``raw`` into a :class:`SecretRef`.

    Raises :class:`InvalidSecretRef` with a message naming the reference and what is wrong.
    """
    scheme, sep, rest = raw.partition("://")
    if not sep or scheme not in SCHEMES:
        # The value is not echoed: text with no known scheme is most often a pasted key.
        shown = (
            f"got {scheme + '://'!r}"
            if sep and _SCHEME.match(scheme)
            else ("the value is not shown: it may be a key")
        )
        raise InvalidSecretRef(
            "secret reference must start with one of "
            + ", ".join(f"{s}://" for s in SCHEMES)
            + f" ({shown})"
        )
    if scheme == "env":
        if not _ENV_NAME.match(rest):
            raise InvalidSecretRef(f"secret reference {raw!r}: not an environment variable name")
        return SecretRef(raw, "env", rest)
    if scheme == "file":
        if not rest.startswith("/") or "\x00" in rest or "/../" in rest + "/":
            raise InvalidSecretRef(
                f"secret reference {raw!r}: file refs need an absolute path, e.g. file:///etc/key"
            )
        return SecretRef(raw, "file", rest)
    path, _, field = rest.partition("#")
    path = path.strip("/")
    if not path or not _VAULT_PATH.match(path) or ".." in path.split("/"):
        raise InvalidSecretRef(
            f"secret reference {raw!r}: vault refs look like vault://PATH or vault://PATH#FIELD"
        )
    if "#" in rest and not field:
        raise InvalidSecretRef(f"secret reference {raw!r}: empty field after '#'")
    return SecretRef(raw, "vault", path, field or None)


def check_ref(raw: str) -> None:
    """Raise ValueError (not InvalidSecretRef) when ``raw`` is not a secret reference: the
    form a pydantic validator of the policy reports under the key."""
    try:
        parse_ref(raw)
    except InvalidSecretRef as exc:
        raise ValueError(str(exc)) from None
