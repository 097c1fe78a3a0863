"""The ``database:`` section of a target: a database reached by named statements only
(docs/api/databases.md; design.md, "Database targets").

::

    orders-db:
      database:
        engine: postgresql
        dsn: postgresql://db.internal:5432/shop     # no user, no password
        credential: {vault_database_role: agent-readonly, mount: database}
        pool: {max_size: 4, acquire_timeout_s: 2, max_lifetime_s: 300}
        session: {statement_timeout_s: 5, lock_timeout_s: 1}
        statements:
          orders_by_customer:
            mode: read
            sql: SELECT id, amount FROM orders WHERE customer = $1 ORDER BY id
            params: [{name: customer, type: string, pattern: "[a-z0-9-]{1,64}"}]
            max_rows: 100
            on_limit: truncate

An envelope names a statement as its endpoint (``/orders_by_customer``) and gives its
parameters by name; the agent never sends SQL. The checks here are pure and read the SQL
text only (:func:`sql_problems`): one statement, ``$1..$N`` matching ``params``, and a
``read`` statement that does not begin with (or hold, in a ``WITH``) a writing keyword.
``egress-gateway validate --check-database`` also prepares each against a live database.
"""

from __future__ import annotations

import re
from typing import Any, Final, Literal

from pydantic import Field, field_validator, model_validator

from gateway.policy import defaults as d
from gateway.policy.mcp import ArgumentRule
from gateway.policy.refs import check_ref
from gateway.policy.stores import StrictModel
from gateway.urls import URL

#: The engines a ``database:`` section may name, and the DSN schemes each takes.
ENGINES: Final = {"postgresql": ("postgresql", "postgres")}
#: First keywords of a statement that only reads (PostgreSQL's grammar).
READ_KEYWORDS: Final = frozenset({"select", "with", "values", "table", "show", "explain"})
#: Keywords that make a statement write wherever they stand outside strings and comments
#: (a data-modifying ``WITH``, ``SELECT ... INTO``, ``FOR UPDATE`` locks).
WRITE_KEYWORDS: Final = frozenset(
    {"insert", "update", "delete", "merge", "truncate", "into", "copy", "call", "do", "lock"}
)
ParamType = Literal["string", "integer", "number", "boolean"]
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_$]*")
_PARAM = re.compile(r"\$([0-9]+)")


class DbCredential(StrictModel):
    """Who the sidecar connects as: dynamic credentials from Vault's database secrets
    engine (``vault_database_role`` on ``mount``), or a user and a password read through
    secret references (``user_ref``, ``password_ref``)."""

    vault_database_role: str | None = Field(None, min_length=1, max_length=128)
    mount: str = "database"
    user_ref: str | None = None
    password_ref: str | None = None

    @field_validator("user_ref", "password_ref")
    @classmethod
    def _ref(cls, v: str | None) -> str | None:
        if v is not None:
            check_ref(v)
        return v

    @model_validator(mode="after")
    def _one_source(self) -> DbCredential:
        static = self.user_ref is not None or self.password_ref is not None
        if (self.vault_database_role is not None) == static:
            raise ValueError(
                "set either 'vault_database_role' (Vault's database secrets engine) or "
                "both 'user_ref' and 'password_ref'"
            )
        if static and (self.user_ref is None or self.password_ref is None):
            raise ValueError("'user_ref' and 'password_ref' go together")
        return self


class PoolSpec(StrictModel):
    """The connection pool: ``max_size`` connections, a wait of at most
    ``acquire_timeout_s`` for one (then CAPACITY_EXCEEDED), and a connection's life of at
    most ``max_lifetime_s`` (keep it shorter than the Vault lease)."""

    max_size: int = Field(d.DEFAULT_DB_POOL_SIZE, ge=1, le=d.MAX_DB_POOL_SIZE)
    acquire_timeout_s: float = Field(d.DEFAULT_DB_ACQUIRE_TIMEOUT_S, gt=0, le=d.MAX_WAIT_S)
    max_lifetime_s: float = Field(d.DEFAULT_DB_MAX_LIFETIME_S, gt=0, le=d.MAX_WAIT_S)


class SessionSpec(StrictModel):
    """Limits set on each transaction with ``SET LOCAL`` (seconds; 0: none)."""

    statement_timeout_s: float = Field(d.DEFAULT_DB_STATEMENT_TIMEOUT_S, ge=0, le=d.MAX_WAIT_S)
    lock_timeout_s: float = Field(d.DEFAULT_DB_LOCK_TIMEOUT_S, ge=0, le=d.MAX_WAIT_S)


class ParamSpec(ArgumentRule):
    """One positional parameter (``$1`` is the first): its name in the envelope's
    ``parameters``, its JSON type, and the MCP argument rules (pattern, enum, bounds).
    Parameters are required unless ``required: false`` (then an absent one is NULL)."""

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
    type: ParamType  # narrower than an MCP argument's
    required: bool = True


class StatementSpec(StrictModel):
    """A named statement. ``max_rows`` / ``max_bytes``: the most rows and bytes of JSON
    answered, beyond which ``on_limit`` truncates or answers RESPONSE_TOO_LARGE;
    ``max_affected_rows``: a write touching more is rolled back (UPSTREAM_REJECTED);
    ``idempotent``: a write that may be sent again when its outcome was lost."""

    mode: Literal["read", "write"]
    sql: str = Field(min_length=1, max_length=65536)
    params: list[ParamSpec] = Field(default_factory=list, max_length=100)
    max_rows: int = Field(d.DEFAULT_DB_MAX_ROWS, ge=1, le=d.MAX_DB_MAX_ROWS)
    max_bytes: int = Field(d.DEFAULT_DB_MAX_BYTES, ge=d.MIN_DB_MAX_BYTES, le=d.MAX_BODY_BYTES)
    on_limit: Literal["truncate", "error"] = "truncate"
    timeout_s: float = Field(d.DEFAULT_DB_STATEMENT_TIMEOUT_S, gt=0, le=d.MAX_WAIT_S)
    max_affected_rows: int | None = Field(None, ge=0, le=d.MAX_DB_AFFECTED_ROWS)
    idempotent: bool = False

    @model_validator(mode="after")
    def _sql(self) -> StatementSpec:
        problem = sql_problems(self.sql, len(self.params), self.mode)
        if problem is not None:
            raise ValueError(problem)
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ValueError("two params share a name")
        return self


class DatabaseSpec(StrictModel):
    engine: Literal["postgresql"]
    dsn: str
    credential: DbCredential
    pool: PoolSpec = Field(default_factory=PoolSpec)
    session: SessionSpec = Field(default_factory=SessionSpec)
    statements: dict[str, StatementSpec] = Field(min_length=1)

    @field_validator("dsn")
    @classmethod
    def _dsn(cls, v: str) -> str:
        # The messages never echo the DSN: it may hold the password being refused.
        try:
            url = URL(v)
        except ValueError:
            raise ValueError("not a DSN URL such as postgresql://host:5432/dbname") from None
        if url.user or url.password or "password" in url.query or "user" in url.query:
            raise ValueError(
                "a DSN holds no user or password: the credential comes from 'credential' "
                "(Vault's database secrets engine or secret references)"
            )
        if url.scheme not in ENGINES["postgresql"] or not url.host:
            raise ValueError("must be postgresql://HOST[:PORT]/DBNAME")
        return v

    @field_validator("statements")
    @classmethod
    def _names(cls, v: dict[str, Any]) -> dict[str, Any]:
        for name in v:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", name):
                raise ValueError(f"{name[:64]!r} is not a statement name ([A-Za-z_][A-Za-z0-9_]*)")
        return v

    def host(self) -> str:
        return URL(self.dsn).host or ""


def sql_tokens(sql: str) -> tuple[list[str], list[int], int]:
    """Lex ``sql`` outside strings, quoted names, dollar-quoted bodies and comments (pure):
    its lower-cased words, the numbers of its ``$N`` parameters, and how many statements
    it holds (text after a top-level ``;``). Raises ValueError for an unterminated quote
    or comment."""
    words: list[str] = []
    params: list[int] = []
    statements, pending, i, n = 0, False, 0, len(sql)
    while i < n:
        c = sql[i]
        if c in "'\"":
            end = sql.find(c, i + 1)
            while end != -1 and end + 1 < n and sql[end + 1] == c:
                end = sql.find(c, end + 2)  # a doubled quote stays inside
            if end == -1:
                raise ValueError("an unterminated quote")
            i, pending = end + 1, True
        elif sql.startswith("--", i):
            end = sql.find("\n", i)
            i = n if end == -1 else end + 1
        elif sql.startswith("/*", i):
            end = sql.find("*/", i + 2)
            if end == -1:
                raise ValueError("an unterminated comment")
            i = end + 2
        elif c == "$" and (tag := re.match(r"\$([A-Za-z_][A-Za-z0-9_]*)?\$", sql[i:])):
            end = sql.find(tag.group(0), i + len(tag.group(0)))
            if end == -1:
                raise ValueError("an unterminated dollar-quoted string")
            i, pending = end + len(tag.group(0)), True
        elif c == "$" and (num := _PARAM.match(sql, i)):
            params.append(int(num.group(1)))
            i, pending = num.end(), True
        elif c == ";":
            statements += pending
            pending, i = False, i + 1
        elif word := _WORD.match(sql, i):
            words.append(word.group(0).lower())
            i, pending = word.end(), True
        else:
            pending = pending or not c.isspace()
            i += 1
    return words, params, statements + pending


def sql_problems(sql: str, param_count: int, mode: str) -> str | None:
    """What is wrong with a statement's SQL for its ``params`` and ``mode`` (pure), or
    None: several statements, parameters not ``$1..$N`` for N ``params``, a ``read``
    statement that does not start with a reading keyword or holds a writing one."""
    try:
        words, params, statements = sql_tokens(sql)
    except ValueError as exc:
        return f"the SQL has {exc}"
    if statements != 1:
        return f"the SQL holds {statements} statements; a named statement is exactly one"
    used = set(params)
    if used != set(range(1, param_count + 1)):
        shown = ", ".join(f"${p}" for p in sorted(used)) or "none"
        return f"the SQL uses parameters {shown} but 'params' lists {param_count}"
    if mode == "read":
        if not words or words[0] not in READ_KEYWORDS:
            first = words[0].upper() if words else "nothing"
            return f"a 'read' statement begins with {first}, not SELECT, WITH, VALUES or TABLE"
        writing = sorted(WRITE_KEYWORDS.intersection(words))
        if writing:
            return (
                f"a 'read' statement holds {', '.join(w.upper() for w in writing)}: mark it write"
            )
    return None


def check_target(spec: Any) -> Any:
    """A ``TargetSpec`` validator (after): a database target has no ``base_url``,
    ``endpoints``, ``credential``, headers or ``mcp`` (its statements are its endpoints);
    any other target needs a ``base_url``."""
    if spec.database is None:
        if spec.base_url is None:
            raise ValueError("a target needs 'base_url' (or 'database' for a database)")
        return spec
    extra = [
        key
        for key in ("base_url", "endpoints", "credential", "mcp")
        if getattr(spec, key) is not None
    ] + [key for key in ("forward_headers", "static_headers") if getattr(spec, key)]
    if extra:
        raise ValueError(
            f"a database target has no {', '.join(repr(k) for k in extra)}: its statements "
            "are its endpoints and its credential is database.credential"
        )
    return spec


def database_problems(
    target: str, spec: DatabaseSpec, has_vault: bool
) -> list[tuple[tuple[str, ...], str]]:
    """Keys of a ``database:`` section that need another section: Vault credentials
    (a role, or ``vault://`` references) need ``secrets.vault``."""
    credential = spec.credential
    refs = [r for r in (credential.user_ref, credential.password_ref) if r is not None]
    if has_vault or not (
        credential.vault_database_role is not None or any(r.startswith("vault://") for r in refs)
    ):
        return []
    return [(("targets", target, "database", "credential"), "needs a secrets.vault section")]
