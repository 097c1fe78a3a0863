"""The resolver interface: a secret reference in, a credential holder out.

Each scheme (``vault``, ``env``, ``file``) has one resolver implementing
:class:`SecretResolver`; :class:`SecretResolvers` dispatches by scheme and owns their
lifecycle. Values travel in :class:`Secret` holders whose ``repr``/``str`` never show the
value; only :mod:`gateway.upstream` calls :meth:`Secret.reveal`, to build the outgoing
request.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from gateway import redaction
from gateway.errors import SecretNotFound
from gateway.policy.refs import SecretRef

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class Secret:
    """A secret value that does not show itself in reprs, logs or tracebacks."""

    # Weak-referenceable, so that a test can show no memo keeps a secret alive.
    __slots__ = ("__weakref__", "_value")

    def __init__(self, value: str) -> None:
        self._value = value
        redaction.register(value)

    def reveal(self) -> str:
        """The plaintext value. Call only where it goes onto the wire."""
        return self._value

    def __repr__(self) -> str:
        return "Secret('**********')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)

    def __reduce__(self) -> str | tuple[object, ...]:
        raise TypeError("Secret values cannot be pickled")


@dataclass(frozen=True, slots=True)
class ResolvedSecret:
    """What a resolver returns.

    ``from_cache`` tells the pipeline that a 401 from the upstream may mean a rotated key
    (drop the entry, resolve again once); ``warnings`` go into the audit record (for
    example a stale value served while Vault is unreachable).
    """

    secret: Secret
    from_cache: bool = False
    warnings: tuple[str, ...] = field(default_factory=tuple)


@runtime_checkable
class SecretResolver(Protocol):
    """Resolves references of one scheme.

    ``resolve`` raises :class:`gateway.errors.SecretError` subclasses: SecretNotFound,
    SecretAccessDenied, SecretBackendUnavailable. Messages name the reference, never the
    value.
    """

    async def resolve(self, ref: SecretRef) -> ResolvedSecret: ...

    def invalidate(self, ref: SecretRef) -> None: ...

    async def aclose(self) -> None: ...


def _never(ref: SecretRef, resolved: ResolvedSecret) -> bool:
    return False


class SecretResolvers:
    """Dispatches references to the resolver registered for their scheme."""

    def __init__(self, resolvers: dict[str, SecretResolver]) -> None:
        self._resolvers = dict(resolvers)
        #: Resolvers registered since construction: a check of :meth:`unchanged_check`
        #: holds while this is the count it was taken at.
        self.registered = 0

    def register(self, scheme: str, resolver: SecretResolver) -> None:
        self._resolvers[scheme] = resolver
        self.registered += 1

    def get(self, scheme: str) -> SecretResolver | None:
        return self._resolvers.get(scheme)

    def is_local(self, scheme: str) -> bool:
        """True if the resolver of ``scheme`` reads only local state (the environment, a
        file) and so never waits: the pipeline then spares it a deadline timer. A
        resolver says so with a class attribute ``local = True``."""
        return getattr(self._resolvers.get(scheme), "local", False) is True

    async def resolve(self, ref: SecretRef) -> ResolvedSecret:
        resolver = self._resolvers.get(ref.scheme)
        if resolver is None:
            raise SecretNotFound(
                f"secret reference {ref.raw!r}: no {ref.scheme}:// resolver is configured "
                "(for vault:// refs, add secrets.vault to the policy)",
                details={"api_key_ref": ref.raw, "reason": "no_resolver"},
            )
        resolved = await resolver.resolve(ref)
        if _CONTROL.search(resolved.secret.reveal()):
            raise SecretNotFound(
                f"secret reference {ref.raw!r}: the value contains control characters (a "
                "newline inside it?) and cannot be sent in a header or URL; fix the secret",
                details={"api_key_ref": ref.raw, "reason": "invalid_value"},
            )
        return resolved

    def unchanged(self, ref: SecretRef, resolved: ResolvedSecret) -> bool:
        """True if resolving ``ref`` now would give ``resolved`` again (the very object a
        previous :meth:`resolve` returned), as its resolver can tell at once without
        waiting (a file's ``stat``, the environment): a caller that keeps what it made
        of ``resolved`` (the chain's signing keys) may use it again, and a rotated or
        invalidated secret is resolved anew. False when the resolver cannot tell (Vault:
        its own cache decides, in :meth:`resolve`). A resolver says so with a method
        ``unchanged(ref, resolved) -> bool``."""
        return self.unchanged_check(ref)(ref, resolved) is True

    def unchanged_check(self, ref: SecretRef) -> Callable[[SecretRef, ResolvedSecret], object]:
        """The check :meth:`unchanged` makes for ``ref`` (its resolver's ``unchanged``, or
        one that always answers False), for a caller that checks the same reference on
        every call without looking up its resolver and method each time, while
        :attr:`registered` is unchanged. Its answer counts only when it is ``True``."""
        resolver = self._resolvers.get(ref.scheme)
        check: Callable[[SecretRef, ResolvedSecret], object] = getattr(
            resolver, "unchanged", _never
        )
        return check

    def invalidate(self, ref: SecretRef) -> None:
        resolver = self._resolvers.get(ref.scheme)
        if resolver is not None:
            resolver.invalidate(ref)

    async def aclose(self) -> None:
        for resolver in reversed(list(self._resolvers.values())):
            await resolver.aclose()
