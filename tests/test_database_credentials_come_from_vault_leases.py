"""A database target's credentials from OpenBao's database secrets engine, against a
private PostgreSQL cluster with password authentication: one lease per role, a lease
revoked mid-traffic replaced on the next call, the lease revoked at close, and the
password nowhere in a record or an answer."""

# ruff: noqa: S608 - the SQL here is the test's own, never an input
from __future__ import annotations

import asyncio
import contextlib
import io
import json
import random
import secrets
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway import audit
from gateway.breaker import CircuitBreakers, breaker_specs
from gateway.call.pipeline import Pipeline
from gateway.database.registry import Databases
from gateway.idempotency.memory import MemoryIdempotencyStore
from gateway.metrics import Metrics
from gateway.policy import PolicySet, parse_policy
from gateway.ratelimit import RateLimitGroups
from gateway.secrets.factory import build_secret_resolvers, start_secret_resolvers
from tests.postgres_fixtures import ADMIN_PASSWORD, ADMIN_USER, PrivatePostgres, private_postgres
from tests.vault_fixtures import VaultLab

pytest.importorskip("asyncpg")

__all__ = ["private_postgres"]  # the fixture, used by name

ROLE = "agent-rw"


def setup_engine(lab: VaultLab, pg: PrivatePostgres) -> tuple[str, str]:
    """A database secrets engine on a mount of its own, a role, and a token that may read
    its credentials and renew and revoke its leases. Returns (mount, token)."""
    root = lab.bao.root()
    mount = f"database-{secrets.token_hex(3)}"
    root.sys.enable_secrets_engine("database", path=mount)
    root.secrets.database.configure(
        name="shop",
        plugin_name="postgresql-database-plugin",
        mount_point=mount,
        allowed_roles=[ROLE],
        connection_url=f"postgresql://{{{{username}}}}:{{{{password}}}}@127.0.0.1:{pg.port}/shop"
        "?sslmode=disable",
        username=ADMIN_USER,
        password=ADMIN_PASSWORD,
    )
    root.secrets.database.create_role(
        name=ROLE,
        db_name="shop",
        mount_point=mount,
        creation_statements=[
            "CREATE ROLE \"{{name}}\" WITH LOGIN PASSWORD '{{password}}' "
            "VALID UNTIL '{{expiration}}';",
            'GRANT SELECT, INSERT ON orders TO "{{name}}";',
            'GRANT USAGE ON SEQUENCE orders_id_seq TO "{{name}}";',
        ],
        default_ttl="1h",
        max_ttl="2h",
    )
    policy = f"""
path "{mount}/creds/{ROLE}" {{ capabilities = ["read"] }}
path "sys/leases/renew" {{ capabilities = ["update"] }}
path "sys/leases/revoke" {{ capabilities = ["update"] }}
path "sys/leases/lookup" {{ capabilities = ["update"] }}
"""
    root.sys.create_or_update_policy(name=f"{mount}-reader", policy=policy)
    return mount, lab.token([f"{mount}-reader"])


@pytest.fixture
async def shop(vault_lab: VaultLab, private_postgres: PrivatePostgres) -> AsyncIterator[Any]:
    mount, token = setup_engine(vault_lab, private_postgres)
    async with open_shop(vault_lab, private_postgres, mount, "{method: token}", token) as opened:
        yield opened


@contextlib.asynccontextmanager
async def open_shop(
    vault_lab: VaultLab, pg: PrivatePostgres, mount: str, auth: str, token: str | None
) -> AsyncIterator[Any]:
    """A pipeline whose target ``orders`` reads and writes ``orders`` of the private
    cluster with credentials of ``mount``'s role, the sidecar logging in with ``auth``."""
    pg.psql(
        "CREATE TABLE IF NOT EXISTS orders (id serial PRIMARY KEY, customer text NOT NULL);"
        "TRUNCATE orders RESTART IDENTITY;"
        "INSERT INTO orders (customer) VALUES ('acme'), ('acme'), ('zeta');"
    )
    text = f"""
version: 1
agent_id: db-agent
egress: {{allow_cidrs: ["127.0.0.0/8"]}}
secrets:
  vault: {{address: "{vault_lab.address}", auth: {auth}}}
targets:
  orders:
    retry: {{max_retries: 0}}
    database:
      engine: postgresql
      dsn: {pg.dsn}
      credential: {{vault_database_role: {ROLE}, mount: {mount}}}
      statements:
        by_customer:
          mode: read
          sql: SELECT id FROM orders WHERE customer = $1 ORDER BY id
          params: [{{name: customer, type: string, pattern: "[a-z]{{1,16}}"}}]
        add:
          mode: write
          sql: INSERT INTO orders (customer) VALUES ($1) RETURNING id
          params: [{{name: customer, type: string}}]
"""
    policy = PolicySet.compile(parse_policy(text))
    environ = {"VAULT_TOKEN": token} if token else {}
    resolvers = build_secret_resolvers(policy.policy, environ=environ)
    await start_secret_resolvers(resolvers)
    databases = Databases(resolvers)
    databases.apply(policy)
    stream = io.StringIO()
    store = MemoryIdempotencyStore()
    pipeline = Pipeline(
        policy,
        resolvers=resolvers,
        upstream=None,  # type: ignore[arg-type]  # a database target never uses it
        audit=audit.AuditLog(policy.policy.audit, stream, agent_id="db-agent"),
        metrics=Metrics(),
        groups=RateLimitGroups(policy.policy.rate_limit_groups),
        breakers=CircuitBreakers(breaker_specs(policy.policy.targets)),
        idempotency=store,
        rng=random.Random(0),
        databases=databases,
    )

    class Shop:
        vault = vault_lab.bao.root()
        lease_prefix = f"{mount}/creds/{ROLE}/"
        output = stream

        async def start(self) -> None:
            assert await databases.start() is None

        async def call(self, statement: str, method: str, **parameters: Any) -> Any:
            envelope = {
                "trace_id": "t-" + secrets.token_hex(4),
                "correlation_id": "c-1",
                "target_system": "orders",
                "endpoint": f"/{statement}",
                "method": method,
                "parameters": parameters,
            }
            _, answer = await pipeline.handle(json.dumps(envelope).encode())
            return answer

        def records(self) -> list[dict[str, Any]]:
            return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]

        def leases(self) -> list[str]:
            try:
                keys = self.vault.sys.list_leases(self.lease_prefix)["data"]["keys"]
            except Exception:
                return []
            return [self.lease_prefix + k for k in keys]

        async def close(self) -> None:
            await databases.aclose()

    try:
        yield Shop()
    finally:
        await databases.aclose()
        await resolvers.aclose()
        await store.aclose()


def role_exists(pg: PrivatePostgres, user: str) -> bool:
    return pg.psql(f"SELECT count(*) FROM pg_roles WHERE rolname = '{user}'") == "1"


async def test_a_revoked_lease_is_replaced_on_the_next_call(
    shop: Any, private_postgres: PrivatePostgres
) -> None:
    await shop.start()
    answer = await shop.call("by_customer", "GET", customer="acme")
    assert answer.success, answer.error
    assert answer.data["rows"] == [[1], [2]]
    first_user = shop.records()[-1]["db_user"]
    assert first_user.startswith("v-")
    assert role_exists(private_postgres, first_user)
    leases = shop.leases()
    assert len(leases) == 1  # one lease for the role, whatever the number of calls
    for lease in leases:
        shop.vault.sys.revoke_lease(lease)
    assert not role_exists(private_postgres, first_user)  # the database refuses it now

    answer = await shop.call("add", "POST", customer="newco")
    assert answer.success, answer.error
    assert answer.data["affected_rows"] == 1
    second_user = shop.records()[-1]["db_user"]
    assert second_user.startswith("v-")
    assert second_user != first_user
    assert private_postgres.psql("SELECT count(*) FROM orders WHERE customer = 'newco'") == "1"
    assert len(shop.leases()) == 1

    await shop.close()  # the drain revokes the lease: Vault drops the user
    assert shop.leases() == []
    assert not role_exists(private_postgres, second_user)
    text = shop.output.getvalue()
    assert "password" not in text.lower()
    assert ADMIN_PASSWORD not in text


async def test_a_parameter_outside_its_pattern_never_reaches_the_database(shop: Any) -> None:
    answer = await shop.call("by_customer", "GET", customer="Robert'); DROP TABLE orders;--")
    assert answer.error.code == "PERMISSION_DENIED"
    assert answer.error.details["reason"] == "parameter_refused"
    records = shop.records()
    assert records[-1]["db_statement"] is None  # refused before anything ran
    assert records[-1]["api"] == "database"


async def test_a_lease_is_renewed_then_replaced_before_its_max_ttl(
    vault_lab: VaultLab, private_postgres: PrivatePostgres
) -> None:
    from gateway.database.credentials import VaultCredentials
    from gateway.policy.stores import VaultSpec
    from gateway.secrets.vault import VaultResolver

    mount, token = setup_engine(vault_lab, private_postgres)
    root = vault_lab.bao.root()
    root.secrets.database.create_role(
        name=ROLE,
        db_name="shop",
        mount_point=mount,
        creation_statements=[
            "CREATE ROLE \"{{name}}\" WITH LOGIN PASSWORD '{{password}}' "
            "VALID UNTIL '{{expiration}}';"
        ],
        default_ttl="3s",
        max_ttl="5s",
    )
    vault = VaultResolver(VaultSpec(address=vault_lab.address), environ={"VAULT_TOKEN": token})
    await vault.start()
    credentials = VaultCredentials(vault, mount, ROLE)
    try:
        first = await credentials.current()
        assert first.user.startswith("v-")
        prefix = f"{mount}/creds/{ROLE}/"
        [lease_id] = [prefix + k for k in root.sys.list_leases(prefix)["data"]["keys"]]
        renewed = False
        for _ in range(300):  # bounded: the renewal is due at 2 s, the max_ttl at 5 s
            await asyncio.sleep(0.05)
            now = await credentials.current()
            if now is not first:
                break
            renewed = renewed or root.sys.read_lease(lease_id)["data"]["last_renewal"] is not None
        assert renewed  # Vault saw the lease renewed before it was replaced
        assert now is not first
        assert now.user != first.user
        for _ in range(200):  # the old lease is revoked in the background (bounded)
            if not role_exists(private_postgres, first.user):
                break
            await asyncio.sleep(0.05)
        assert not role_exists(private_postgres, first.user)  # the old lease was revoked
        assert role_exists(private_postgres, now.user)
    finally:
        await credentials.aclose()
        await vault.aclose()
    assert not role_exists(private_postgres, now.user)  # revoked at close


async def test_a_lease_that_dies_with_the_vault_token_is_replaced_after_a_relogin(
    vault_lab: VaultLab, private_postgres: PrivatePostgres
) -> None:
    mount, _ = setup_engine(vault_lab, private_postgres)
    root = vault_lab.bao.root()
    approle = f"{mount}-sidecar"
    root.auth.approle.create_or_update_approle(
        approle, token_policies=[f"{mount}-reader"], token_ttl="60s", token_max_ttl="600s"
    )
    role_id = vault_lab.write(
        f"{approle}.role", root.auth.approle.read_role_id(approle)["data"]["role_id"]
    )
    secret_id = vault_lab.write(f"{approle}.secret", vault_lab.secret_id(approle))
    auth = f"{{method: approle, role_id_file: {role_id}, secret_id_file: {secret_id}}}"
    async with open_shop(vault_lab, private_postgres, mount, auth, None) as shop:
        answer = await shop.call("by_customer", "GET", customer="acme")
        assert answer.success, answer.error
        first_user = shop.records()[-1]["db_user"]
        # Revoking the sidecar's token revokes the leases it made: Vault drops the user.
        assert vault_lab.revoke_tokens_of_role(approle) == 1
        # OpenBao revokes a token's leases in its expiration manager, after the token
        # itself: the user goes a moment later (bounded wait, as for the renewal above).
        for _ in range(200):
            if not role_exists(private_postgres, first_user):
                break
            await asyncio.sleep(0.05)
        assert not role_exists(private_postgres, first_user)
        answer = await shop.call("by_customer", "GET", customer="zeta")
        assert answer.success, answer.error
        assert answer.data["rows"] == [[3]]
        second_user = shop.records()[-1]["db_user"]
        assert second_user != first_user
        assert role_exists(private_postgres, second_user)
