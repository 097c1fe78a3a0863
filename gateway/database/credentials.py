"""Who a database target connects as: a :class:`Login` from secret references
(:class:`StaticCredentials`) or from Vault's database secrets engine
(:class:`VaultCredentials`: one lease per sidecar per role).

A Vault lease is renewed in the background at two thirds of its time; a new lease is
taken (and the pool using the old one rotated by its owner, which sees a new
``generation``) when a renewal grants less than two thirds of the role's TTL (Vault
capped it: the role's ``max_ttl`` is near), when the sidecar logged in to Vault again
(a lease dies with the token that made it), and when the database refused the login or
a privilege and Vault no longer holds the lease (it was revoked). The old lease is
revoked once the new one is in use; every lease is revoked at close.
Passwords stay :class:`gateway.secrets.base.Secret`\\ s: never in a log or record.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Final, Protocol

from gateway.audit import get_logger
from gateway.errors import SecretError
from gateway.policy.refs import parse_ref
from gateway.secrets import SecretResolvers
from gateway.secrets.base import Secret

if TYPE_CHECKING:
    from gateway.secrets.vault import DatabaseLease, VaultResolver

#: A static login refused sooner than this after it was read is not read again, and a
#: lease Vault confirmed alive is not asked about again for this long (seconds): a real
#: denial must not make each call cost a Vault request.
MIN_ROTATE_AGE_S: Final = 1.0
#: After a failed renewal, the renewer tries again this soon (seconds).
RENEW_RETRY_S: Final = 2.0
_RENEW_AT: Final = 2 / 3

_log = get_logger("gateway.database")


@dataclass(frozen=True, slots=True)
class Login:
    """A database user and password; ``generation`` changes with every new credential."""

    user: str
    password: Secret
    generation: int
    issued_at: float


class CredentialSource(Protocol):
    #: True when a privilege error may mean the credential was revoked (a lease).
    dynamic: bool

    async def current(self) -> Login:
        """The login to connect with. Raises a SecretError."""

    async def refused(self, login: Login) -> bool:
        """The database refused ``login``: True when a new one is now current."""

    async def aclose(self) -> None: ...


class StaticCredentials:
    """A user and password read through secret references (``user_ref``, ``password_ref``),
    read again when the database refuses them (rotated)."""

    dynamic = False

    def __init__(self, resolvers: SecretResolvers, user_ref: str, password_ref: str) -> None:
        self._resolvers = resolvers
        self._refs = (parse_ref(user_ref), parse_ref(password_ref))
        self._login: Login | None = None
        self._generation = 0

    async def current(self) -> Login:
        if self._login is None:
            user = await self._resolvers.resolve(self._refs[0])
            password = await self._resolvers.resolve(self._refs[1])
            self._generation += 1
            self._login = Login(
                user.secret.reveal(), password.secret, self._generation, time.monotonic()
            )
        return self._login

    async def refused(self, login: Login) -> bool:
        if self._login is not login or time.monotonic() - login.issued_at < MIN_ROTATE_AGE_S:
            return self._login is not login
        for ref in self._refs:
            self._resolvers.invalidate(ref)
        self._login = None
        return True

    async def aclose(self) -> None:
        self._login = None


class VaultCredentials:
    """One lease of ``role`` on ``mount`` for the whole sidecar (module docstring)."""

    dynamic = True

    def __init__(self, vault: VaultResolver, mount: str, role: str) -> None:
        self._vault, self._mount, self._role = vault, mount, role
        self._lease: DatabaseLease | None = None
        self._login: Login | None = None
        self._lock = asyncio.Lock()
        self._generation = 0
        self._renewer: asyncio.Task[None] | None = None
        self._revoking: set[asyncio.Task[None]] = set()
        self._alive_until = 0.0
        self._ttl_s = 0.0  # the role's TTL, as the first lease of this rotation stated it
        self._closed = False

    async def current(self) -> Login:
        login = self._login
        if login is not None and self._usable():
            return login
        async with self._lock:
            if self._login is None or not self._usable():
                await self._rotate_locked("expired" if self._login else "first")
            assert self._login is not None
            return self._login

    async def refused(self, login: Login) -> bool:
        """True after taking a new lease because Vault no longer holds the one ``login``
        came from (revoked: its user was dropped); False when it does (a real denial,
        remembered for :data:`MIN_ROTATE_AGE_S` so that denials do not each ask Vault)."""
        async with self._lock:
            if self._login is not login:
                return True  # already rotated by another call
            lease = self._lease
            if lease is None or time.monotonic() < self._alive_until:
                return False
            if await self._vault.lease_alive(lease.lease_id):
                self._alive_until = time.monotonic() + MIN_ROTATE_AGE_S
                return False
            await self._rotate_locked("revoked")
            return True

    async def aclose(self) -> None:
        """Stop renewing and revoke the lease (idempotent); Vault drops the user."""
        if self._closed:
            return
        self._closed = True
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
        lease, self._lease, self._login = self._lease, None, None
        if lease is not None:
            self._revoke(lease)
        if self._revoking:
            await asyncio.wait(self._revoking, timeout=5.0)

    def _usable(self) -> bool:
        lease = self._lease
        if lease is None or lease.login_generation != self._vault.login_generation:
            return False  # a lease dies with the Vault token that made it
        # A little before its end (a tenth of it, at most a second): a call's connection
        # must not be opened with credentials that die while it runs.
        margin = min(1.0, lease.lease_s / 10)
        return lease.lease_s <= 0 or time.monotonic() < lease.obtained_at + lease.lease_s - margin

    async def _rotate_locked(self, why: str) -> None:
        if self._closed:
            raise SecretError("the database credentials are closed", details={"reason": "closed"})
        lease = await self._vault.database_credentials(self._mount, self._role)
        old, self._lease, self._ttl_s = self._lease, lease, lease.lease_s
        self._generation += 1
        self._login = Login(lease.user, lease.password, self._generation, lease.obtained_at)
        _log.info(
            "database_lease_issued",
            mount=self._mount,
            role=self._role,
            reason=why,
            lease_s=lease.lease_s,
            database_user=lease.user,
        )
        if old is not None:
            self._revoke(old)
        if self._renewer is None and lease.renewable and lease.lease_s > 0:
            self._renewer = asyncio.create_task(self._renew_forever(), name="database-lease")

    def _revoke(self, lease: DatabaseLease) -> None:
        async def revoke() -> None:
            try:
                await self._vault.revoke_lease(lease.lease_id)
            except SecretError as exc:  # it ends at its TTL anyway
                _log.warning("database_lease_revoke_failed", role=self._role, error=exc.message)

        if lease.lease_id:
            task = asyncio.create_task(revoke(), name="database-lease-revoke")
            self._revoking.add(task)
            task.add_done_callback(self._revoking.discard)

    async def _renew_forever(self) -> None:
        while not self._closed:
            lease = self._lease
            if lease is None:
                return
            due = lease.obtained_at + lease.lease_s * _RENEW_AT - time.monotonic()
            await asyncio.sleep(max(due, 0.05))
            try:
                await self._renew_once(lease)
            except SecretError as exc:
                _log.warning("database_lease_renew_failed", role=self._role, error=exc.message)
                await asyncio.sleep(RENEW_RETRY_S)

    async def _renew_once(self, lease: DatabaseLease) -> None:
        async with self._lock:
            if self._lease is not lease:
                return  # rotated meanwhile
            if lease.login_generation != self._vault.login_generation:
                await self._rotate_locked("vault_relogin")
                return
            granted = await self._vault.renew_lease(lease.lease_id, self._ttl_s)
            if granted < self._ttl_s * _RENEW_AT:  # Vault capped it: the max_ttl is near
                await self._rotate_locked("max_ttl")
                return
            self._lease = _renewed(lease, granted)


def _renewed(lease: DatabaseLease, granted_s: float) -> DatabaseLease:
    return replace(lease, lease_s=granted_s, obtained_at=time.monotonic())
