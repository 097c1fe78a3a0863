"""The database targets of the policy in force: one engine per target, one credential
source per Vault role (or per pair of secret references), built at start and on reload.

The engine (asyncpg) is imported only when the policy has a database target; without
the ``database`` extra installed such a policy is refused with a clear error.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from gateway.audit import get_logger
from gateway.database import DbLog, StatementCall
from gateway.database.credentials import CredentialSource, StaticCredentials, VaultCredentials
from gateway.errors import GatewayError
from gateway.policy import PolicySet
from gateway.policy.database import DatabaseSpec
from gateway.policy.extras import install_hint
from gateway.secrets import SecretResolvers
from gateway.upstream import TransportError, UpstreamResponse

if TYPE_CHECKING:
    from gateway.database.postgres import PostgresDatabase

_log = get_logger("gateway.database")


def engine_class() -> type[PostgresDatabase]:
    """asyncpg's engine. Raises ValueError when the ``database`` extra is missing."""
    try:
        from gateway.database.postgres import PostgresDatabase
    except ImportError as exc:
        raise ValueError(
            "the policy has a database target but asyncpg is not installed: "
            f"{install_hint('database')}"
        ) from exc
    return PostgresDatabase


class Databases:
    """The engines of the database targets, by target name (``get``). ``apply`` takes a
    new policy (a changed ``database:`` section gets a new engine; the old one closes
    once its calls finished); ``start`` prepares every statement; ``aclose`` closes the
    pools and revokes the leases."""

    def __init__(self, resolvers: SecretResolvers) -> None:
        self._resolvers = resolvers
        self._engines: dict[str, tuple[DatabaseSpec, PostgresDatabase]] = {}
        self._credentials: dict[tuple[str, ...], CredentialSource] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def get(self, target: str) -> PostgresDatabase | None:
        entry = self._engines.get(target)
        return entry[1] if entry is not None else None

    def apply(self, policy: PolicySet) -> None:
        specs = {n: t.spec.database for n, t in policy.targets.items() if t.spec.database}
        engine = engine_class() if specs else None
        old = self._engines
        self._engines = {}
        for name, spec in specs.items():
            kept = old.get(name)
            if kept is not None and kept[0] == spec:
                self._engines[name] = old.pop(name)
            else:
                assert engine is not None
                self._engines[name] = (spec, engine(name, spec, self._source(spec)))
        for _, stale in old.values():
            task = asyncio.get_running_loop().create_task(stale.aclose())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def check(self) -> list[tuple[tuple[str, ...], str]]:
        """Each statement prepared against its live database (``validate
        --check-database``): ``(key path, problem)`` for each refused or mistyped, and
        for each database that cannot be reached."""
        problems: list[tuple[tuple[str, ...], str]] = []
        for name, (_, engine) in self._engines.items():
            where = ("targets", name, "database")
            try:
                found = await engine.check()
            except (GatewayError, TransportError) as exc:
                problems.append((where, f"cannot check the statements: {_message(exc)}"))
                continue
            problems += [((*where, "statements", s), message) for s, message in found]
        return problems

    async def start(self) -> None:
        """Prepare every statement (:meth:`check`) and open each pool. A database that
        cannot be reached is logged (its calls answer DEPENDENCY_FAILED until it can); a
        statement PostgreSQL refuses or whose parameter types differ from the policy's
        raises ValueError."""
        for name, (_, engine) in self._engines.items():
            try:
                found = await engine.check()
                await engine.start()
            except (GatewayError, TransportError) as exc:
                _log.warning("database_not_ready", target=name, error=_message(exc))
                continue
            if found:
                raise ValueError("; ".join(f"{name}.{s}: {m}" for s, m in found))

    async def run(
        self, target: str, call: StatementCall, *, timeout_s: float, log: DbLog
    ) -> UpstreamResponse:
        """The "send" of a database target's attempt (:class:`gateway.call.attempts.
        Attempts`): ``call`` run on ``target``'s engine."""
        engine = self.get(target)
        assert engine is not None
        return await engine.run(call, timeout_s=timeout_s, log=log)

    async def aclose(self) -> None:
        engines, self._engines = self._engines, {}
        for _, engine in engines.values():
            await engine.aclose()
        if self._closing:
            await asyncio.wait(self._closing, timeout=10.0)
        for source in self._credentials.values():
            await source.aclose()
        self._credentials.clear()

    def _source(self, spec: DatabaseSpec) -> CredentialSource:
        credential = spec.credential
        if credential.vault_database_role is not None:
            key: tuple[str, ...] = ("vault", credential.mount, credential.vault_database_role)
        else:
            key = ("refs", credential.user_ref or "", credential.password_ref or "")
        source = self._credentials.get(key)
        if source is None:
            source = self._credentials[key] = self._new_source(key)
        return source

    def _new_source(self, key: tuple[str, ...]) -> CredentialSource:
        if key[0] == "refs":
            return StaticCredentials(self._resolvers, key[1], key[2])
        vault: Any = self._resolvers.get("vault")
        if vault is None or not hasattr(vault, "database_credentials"):
            raise ValueError("a vault_database_role needs secrets.vault in the policy")
        return VaultCredentials(vault, key[1], key[2])


def _message(exc: GatewayError | TransportError) -> str:
    return exc.message


async def check_statements(policy: PolicySet) -> list[tuple[tuple[str, ...], str]]:
    """Every database statement of ``policy`` prepared against its live database, with
    the policy's own secret resolvers (a Vault lease is taken and revoked):
    :meth:`Databases.check`'s problems. Raises ValueError as :meth:`Databases.apply`."""
    from gateway.secrets.factory import build_secret_resolvers, start_secret_resolvers

    resolvers = build_secret_resolvers(policy.policy)
    try:
        await start_secret_resolvers(resolvers)
        databases = Databases(resolvers)
        try:
            databases.apply(policy)
            return await databases.check()
        finally:
            await databases.aclose()
    finally:
        await resolvers.aclose()
