"""PostgreSQL through asyncpg (the one module that imports it).

Each connection prepares every statement of its target when it opens (asyncpg's
extended protocol: server-side binding, never the simple-query protocol that runs
``;``-separated text); the pool's first connection does it at start, so a statement
that names a missing table or column, or whose parameter types differ from the policy's,
fails the start. A call runs in a transaction, ``READ ONLY`` for a read, with
``statement_timeout`` and ``lock_timeout`` set by ``set_config(..., true)`` (SET LOCAL),
and reads at most ``max_rows + 1`` rows through a cursor.

asyncpg's errors become the product's codes here:

    pool wait over acquire_timeout_s          CAPACITY_EXCEEDED
    57014 statement timeout, 55P03 lock       AGENT_TIMEOUT
    42501 privilege, 25006 read-only          PERMISSION_DENIED (after one new login)
    28xxx login refused                       a new login, then DEPENDENCY_FAILED
    class 23 constraint violation             UPSTREAM_REJECTED (sqlstate, constraint)
    40001 serialization, 40P01 deadlock       retried in place, then DEPENDENCY_FAILED
    connection failures                       TransportError (the breaker counts them)
    a write over max_affected_rows            UPSTREAM_REJECTED (rolled back)
"""

from __future__ import annotations

import asyncio
import decimal
import json
import time
from typing import Any, Final

import asyncpg

from gateway.database import DbLog, StatementCall, shape_rows
from gateway.database.credentials import CredentialSource, Login
from gateway.errors import (
    CapacityExceeded,
    DeadlineExceeded,
    DependencyFailed,
    GatewayError,
    PermissionDenied,
    UpstreamRejected,
)
from gateway.policy.database import DatabaseSpec, StatementSpec
from gateway.upstream import TransportError, UpstreamResponse

#: Serialization failures and deadlocks are tried this many times in all.
TX_ATTEMPTS: Final = 3
#: How long past the attempt's time a database that stopped answering is waited for
#: (the server's own statement_timeout answers first when it can), seconds.
_ANSWER_MARGIN_S: Final = 1.0
_RETRY_STATES: Final = frozenset({"40001", "40P01"})
_PRIVILEGE_STATES: Final = frozenset({"42501", "25006"})
#: PostgreSQL's types for each parameter type of the policy (asyncpg's type names).
PARAM_TYPES: Final = {
    "string": frozenset({"text", "varchar", "bpchar", "name", "citext", "uuid", "json", "jsonb"}),
    "integer": frozenset({"int2", "int4", "int8", "numeric", "float4", "float8", "oid"}),
    "number": frozenset({"numeric", "float4", "float8"}),
    "boolean": frozenset({"bool"}),
}
_CONNECTION_ERRORS: Final = (
    OSError,
    asyncpg.exceptions.ConnectionDoesNotExistError,
    asyncpg.exceptions.InterfaceError,
    asyncpg.exceptions.ConnectionFailureError,
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.TooManyConnectionsError,
    asyncpg.exceptions.AdminShutdownError,
)


class _Connection(asyncpg.Connection):  # type: ignore[misc]
    """A connection that keeps what preparing its target's statements said when it
    opened: per statement, its parameter types and its columns."""

    prepared: dict[str, tuple[tuple[str, ...], tuple[str, ...]]]


def type_problems(name: str, stmt: StatementSpec, param_types: list[str]) -> list[str]:
    """Where the parameter types PostgreSQL inferred differ from the policy's (pure)."""
    problems = []
    for param, pg_type in zip(stmt.params, param_types, strict=True):
        if pg_type not in PARAM_TYPES[param.type]:
            problems.append(
                f"statement {name!r}: parameter {param.name!r} is {param.type} in the policy "
                f"but PostgreSQL reads ${stmt.params.index(param) + 1} as {pg_type}"
            )
    return problems


class PostgresDatabase:
    """The pool of one database target, rotated when its login changes or ages past
    ``pool.max_lifetime_s``. ``start()`` opens it and prepares the statements (raises
    DependencyFailed or ValueError for a statement PostgreSQL refuses); ``run()`` answers
    one call; ``aclose()`` closes it (idempotent)."""

    def __init__(self, target: str, spec: DatabaseSpec, credentials: CredentialSource) -> None:
        self.target, self.spec, self.credentials = target, spec, credentials
        self._pool: Any = None
        self._pool_login: Login | None = None
        self._pool_born = 0.0
        self._lock = asyncio.Lock()
        self._old: set[asyncio.Task[None]] = set()

    async def check(self) -> list[tuple[str, str]]:
        """Prepare each statement on one connection of its own: ``(statement, problem)``
        for each PostgreSQL refuses (a missing table, a syntax error) or whose parameter
        types differ from the policy's. Raises TransportError or DependencyFailed when
        the database cannot be reached or refuses the login."""
        login = await self.credentials.current()
        try:
            conn = await asyncpg.connect(
                self.spec.dsn,
                user=login.user,
                password=login.password.reveal(),
                timeout=self.spec.pool.acquire_timeout_s,
            )
        except asyncpg.exceptions.InvalidAuthorizationSpecificationError:
            raise DependencyFailed(
                f"the database refused the sidecar's login on target {self.target!r}",
                details={"reason": "login_refused", "target": self.target},
            ) from None
        except (*_CONNECTION_ERRORS, TimeoutError) as exc:
            raise TransportError("connect", sent=False, message=_connect_message(exc)) from None
        problems: list[tuple[str, str]] = []
        try:
            for name, stmt in self.spec.statements.items():
                try:
                    prepared = await conn.prepare(stmt.sql)
                except asyncpg.PostgresError as exc:
                    problems.append((name, f"PostgreSQL refuses it ({exc.sqlstate}): {exc}"))
                    continue
                types = [t.name for t in prepared.get_parameters()]
                problems += [(name, p) for p in type_problems(name, stmt, types)]
        finally:
            await conn.close()
        return problems

    async def start(self) -> None:
        """Open the pool (its first connection prepares every statement)."""
        await self._current_pool()

    async def aclose(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await _close_pool(pool)
        if self._old:
            await asyncio.wait(self._old, timeout=5.0)

    async def _current_pool(self) -> Any:
        login = await self.credentials.current()
        aged = time.monotonic() - self._pool_born > self.spec.pool.max_lifetime_s
        if self._pool is not None and self._pool_login is login and not aged:
            return self._pool
        async with self._lock:
            login = await self.credentials.current()
            aged = time.monotonic() - self._pool_born > self.spec.pool.max_lifetime_s
            if self._pool is None or self._pool_login is not login or aged:
                old = self._pool
                self._pool = await self._open(login)
                self._pool_login, self._pool_born = login, time.monotonic()
                if old is not None:  # calls holding its connections finish on it
                    task = asyncio.create_task(_close_pool(old), name="database-pool-close")
                    self._old.add(task)
                    task.add_done_callback(self._old.discard)
            return self._pool

    async def _open(self, login: Login) -> Any:
        statements = self.spec.statements

        async def prepare(conn: _Connection) -> None:
            for json_type in ("json", "jsonb"):  # answered parsed; bound as their text
                await conn.set_type_codec(
                    json_type, encoder=str, decoder=json.loads, schema="pg_catalog"
                )
            conn.prepared = {}
            for name, stmt in statements.items():
                prepared = await conn.prepare(stmt.sql)
                conn.prepared[name] = (
                    tuple(t.name for t in prepared.get_parameters()),
                    tuple(a.name for a in prepared.get_attributes()),
                )

        try:
            return await asyncpg.create_pool(
                self.spec.dsn,
                user=login.user,
                password=login.password.reveal(),
                min_size=1,
                max_size=self.spec.pool.max_size,
                connection_class=_Connection,
                init=prepare,
                # Each statement is prepared once per connection, then reused from here.
                statement_cache_size=max(len(statements) * 2, 100),
                timeout=self.spec.pool.acquire_timeout_s,
            )
        except asyncpg.exceptions.InvalidAuthorizationSpecificationError as exc:
            raise _LoginRefused(login) from exc
        except _CONNECTION_ERRORS as exc:
            raise TransportError("connect", sent=False, message=_connect_message(exc)) from None
        except TimeoutError:
            raise TransportError("connect", sent=False, message="connecting timed out") from None

    async def run(self, call: StatementCall, *, timeout_s: float, log: DbLog) -> UpstreamResponse:
        """Run ``call`` within ``timeout_s`` seconds; its answer as a JSON 200. Raises a
        GatewayError or a TransportError (module docstring)."""
        started = time.monotonic()
        for attempt in range(TX_ATTEMPTS):
            remaining = timeout_s - (time.monotonic() - started)
            try:
                # The server's statement_timeout ends a slow statement; this bounds a
                # database that stopped answering at all (its outcome is then unknown).
                async with asyncio.timeout(max(remaining, 0.0) + _ANSWER_MARGIN_S):
                    data = await self._run_once(call, remaining, log)
            except TimeoutError:
                raise TransportError(
                    "timeout", sent=True, message="the database did not answer in time"
                ) from None
            except _LoginRefused as exc:
                if attempt == 0 and await self.credentials.refused(exc.login):
                    continue
                raise DependencyFailed(
                    f"the database refused the sidecar's login on target {self.target!r}",
                    details={"reason": "login_refused", "target": self.target},
                ) from None
            except _TooManyAffected as exc:
                raise UpstreamRejected(
                    f"statement {call.name!r} would affect {exc.affected} rows, more than its "
                    f"max_affected_rows ({call.spec.max_affected_rows}); it was rolled back",
                    details={"reason": "max_affected_rows", "statement": call.name},
                ) from None
            except asyncpg.PostgresError as exc:
                state = log.sqlstate = exc.sqlstate
                if state in _RETRY_STATES and attempt + 1 < TX_ATTEMPTS:
                    log.retries.append(state)
                    continue
                if (
                    state in _PRIVILEGE_STATES
                    and attempt == 0
                    and self.credentials.dynamic
                    and self._pool_login is not None
                    and await self.credentials.refused(self._pool_login)
                ):
                    continue  # maybe a revoked lease: once with a new login
                raise self._error(call, exc) from None
            body = json.dumps(data, separators=(",", ":")).encode()
            elapsed = time.monotonic() - started
            return UpstreamResponse(200, "OK", {}, "application/json", body, elapsed)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _run_once(self, call: StatementCall, timeout_s: float, log: DbLog) -> dict[str, Any]:
        pool = await self._current_pool()
        log.user = self._pool_login.user if self._pool_login else None
        waited = time.monotonic()
        try:
            conn = await pool.acquire(timeout=min(self.spec.pool.acquire_timeout_s, timeout_s))
        except TimeoutError:
            log.pool_wait_s = time.monotonic() - waited
            raise CapacityExceeded(
                f"no database connection of target {self.target!r} was free within "
                f"{self.spec.pool.acquire_timeout_s:g} s (pool.max_size "
                f"{self.spec.pool.max_size})",
                details={"reason": "pool_wait", "target": self.target},
                retry_after_s=self.spec.pool.acquire_timeout_s,
            ) from None
        except asyncpg.exceptions.InvalidAuthorizationSpecificationError:
            raise _LoginRefused(self._pool_login) from None  # type: ignore[arg-type]
        except _CONNECTION_ERRORS as exc:
            raise TransportError("connect", sent=False, message=_connect_message(exc)) from None
        log.pool_wait_s = time.monotonic() - waited
        sent = False
        try:
            stmt_timeout = min(call.spec.timeout_s, timeout_s, self._session_timeout())
            async with conn.transaction(readonly=call.spec.mode == "read"):
                await conn.fetchval(
                    "SELECT set_config('statement_timeout', $1, true),"
                    " set_config('lock_timeout', $2, true)",
                    f"{max(int(stmt_timeout * 1000), 1)}ms",
                    f"{int(self.spec.session.lock_timeout_s * 1000)}ms",
                )
                sent = True
                return await _execute(conn, call, log)
        except _CONNECTION_ERRORS as exc:
            raise TransportError(
                "reset" if sent else "connect", sent=sent, message=_connect_message(exc)
            ) from None
        finally:
            await pool.release(conn)

    def _session_timeout(self) -> float:
        return self.spec.session.statement_timeout_s or float("inf")

    def _error(self, call: StatementCall, exc: asyncpg.PostgresError) -> GatewayError:
        state = exc.sqlstate or ""
        details: dict[str, Any] = {"target": self.target, "statement": call.name, "sqlstate": state}
        if state in ("57014", "55P03"):
            what = "statement" if state == "57014" else "lock"
            return DeadlineExceeded(
                f"statement {call.name!r} ran past its {what} timeout",
                details={**details, "reason": f"{what}_timeout"},
            )
        if state in _PRIVILEGE_STATES:
            return PermissionDenied(
                f"the database refused statement {call.name!r} to the sidecar's user "
                f"(SQLSTATE {state})",
                details={**details, "reason": "database_privilege"},
            )
        if state in _RETRY_STATES:
            return DependencyFailed(
                f"statement {call.name!r} met a serialization failure or deadlock "
                f"{TX_ATTEMPTS} times (SQLSTATE {state})",
                details={**details, "reason": "transaction_conflict"},
            )
        constraint = getattr(exc, "constraint_name", None)
        if constraint:
            details["constraint"] = constraint
        kind = "a constraint" if state.startswith("23") else "the statement"
        return UpstreamRejected(
            f"the database rejected {kind} of statement {call.name!r} (SQLSTATE {state})",
            details={**details, "reason": "database_rejected"},
        )


class _LoginRefused(Exception):
    def __init__(self, login: Login) -> None:
        super().__init__("login refused")
        self.login = login


async def _execute(conn: Any, call: StatementCall, log: DbLog) -> dict[str, Any]:
    # asyncpg's statement cache keeps each statement prepared on its connection; its
    # calls with arguments always use the extended protocol (server-side binding).
    spec, (types, names) = call.spec, conn.prepared[call.name]
    values = [_coerce(v, t) for v, t in zip(call.values, types, strict=True)]
    columns, affected = list(names), None
    if spec.mode == "read":
        cursor = await conn.cursor(spec.sql, *values)
        rows = await cursor.fetch(spec.max_rows + 1)
    elif columns:  # RETURNING: the rows are the affected ones
        rows = await conn.fetch(spec.sql, *values)
        affected = len(rows)
    else:
        rows = []
        if values:
            status = await conn.execute(spec.sql, *values)
            last = status.rsplit(" ", 1)[-1]
            affected = int(last) if last.isdigit() else None
        else:  # execute() without arguments would use the simple-query protocol
            await conn.fetch(spec.sql)
        if spec.max_affected_rows is not None and (affected or 0) > spec.max_affected_rows:
            raise _TooManyAffected(affected or 0)
    shaped, truncated = shape_rows(call, columns, [tuple(r) for r in rows], False)
    log.rows = len(shaped)
    return {
        "statement": call.name,
        "columns": columns,
        "rows": shaped,
        "row_count": len(shaped),
        "truncated": truncated,
        "affected_rows": affected,
    }


class _TooManyAffected(Exception):
    """Raised inside the transaction so that it rolls back."""

    def __init__(self, affected: int) -> None:
        super().__init__(f"{affected} rows affected")
        self.affected = affected


def _coerce(value: Any, pg_type: str) -> Any:
    if value is None:
        return None
    if pg_type == "numeric" and not isinstance(value, bool):
        return decimal.Decimal(str(value))
    if pg_type in ("float4", "float8") and isinstance(value, int):
        return float(value)
    return value


async def _close_pool(pool: Any) -> None:
    try:
        async with asyncio.timeout(10.0):
            await pool.close()
    except (TimeoutError, *_CONNECTION_ERRORS):
        pool.terminate()


def _connect_message(exc: BaseException) -> str:
    # The exception's text may name the user; its class says enough.
    return f"the database could not be reached ({type(exc).__name__})"
