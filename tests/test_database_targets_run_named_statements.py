"""Database targets against the PostgreSQL on this machine (127.0.0.1:5432, trust auth,
database ``test``): statements by name, server-side binding, limits, errors, records.

The sidecar connects as a role made for the test (``egw_app_*``) that may read and write
its own tables only; a schema per test session keeps the tables apart.
"""

# ruff: noqa: S608 - the SQL here is the test's own (schema names it made), never an input
from __future__ import annotations

import asyncio
import io
import json
import os
import random
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
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
from gateway.secrets.factory import build_secret_resolvers

pytest.importorskip("asyncpg")

PG = ["psql", "-h", "127.0.0.1", "-U", "postgres", "-d", "test", "-v", "ON_ERROR_STOP=1", "-qAt"]


def psql(sql: str) -> str:
    try:
        done = subprocess.run([*PG, "-c", sql], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("psql is not installed")
    if done.returncode != 0:
        raise RuntimeError(done.stderr)
    return done.stdout.strip()


@pytest.fixture(scope="module")
def schema() -> Iterator[str]:
    try:
        psql("SELECT 1")
    except RuntimeError:
        pytest.skip("no PostgreSQL on 127.0.0.1:5432")
    suffix = secrets.token_hex(4)
    name, role = f"egw_{suffix}", f"egw_app_{suffix}"
    psql(
        f"CREATE ROLE {role} LOGIN; ALTER ROLE {role} SET deadlock_timeout = '50ms';"
        f"CREATE SCHEMA {name};"
        f"CREATE TABLE {name}.items (id int PRIMARY KEY, sku text UNIQUE, price numeric(10,2),"
        f" made timestamptz, blob bytea, doc jsonb);"
        f"CREATE TABLE {name}.secret (v text);"
        f"INSERT INTO {name}.items SELECT g, 'sku-' || g, g * 1.25, '2026-01-02T03:04:05Z',"
        f" '\\x0001ff', '{{\"k\": [1, 2]}}' FROM generate_series(1, 30) g;"
        f"GRANT USAGE ON SCHEMA {name} TO {role};"
        f"GRANT SELECT, INSERT, UPDATE, DELETE ON {name}.items TO {role};"
    )
    yield name
    psql(f"DROP SCHEMA {name} CASCADE; DROP OWNED BY {role}; DROP ROLE {role}")


def policy_text(schema: str) -> str:
    role = schema.replace("egw_", "egw_app_")
    return f"""
version: 1
agent_id: db-agent
egress: {{allow_cidrs: ["127.0.0.0/8"]}}
rate_limit_groups:
  one-a-minute: {{requests_per_second: 0.017, burst: 1, max_queue_s: 0}}
  watched: {{requests_per_second: 0.017, burst: 1, max_queue_s: 0, mode: shadow}}
targets:
  shadowed:
    rate_limit_group: watched
    database:
      engine: postgresql
      dsn: postgresql://127.0.0.1:5432/test
      credential: {{user_ref: "env://EGW_TEST_DB_USER", password_ref: "env://EGW_TEST_DB_PW"}}
      statements:
        count: {{mode: read, sql: SELECT count(*) FROM {schema}.items}}
  limited:
    rate_limit_group: one-a-minute
    database:
      engine: postgresql
      dsn: postgresql://127.0.0.1:5432/test
      credential: {{user_ref: "env://EGW_TEST_DB_USER", password_ref: "env://EGW_TEST_DB_PW"}}
      statements:
        count: {{mode: read, sql: SELECT count(*) FROM {schema}.items}}
        wide:
          mode: read
          sql: SELECT repeat('x', 400) AS pad, id FROM {schema}.items ORDER BY id
          max_bytes: 2048
  shop:
    timeout_s: 10
    retry: {{max_retries: 0}}
    idempotency: {{methods: [POST]}}
    database:
      engine: postgresql
      dsn: postgresql://127.0.0.1:5432/test
      credential: {{user_ref: "env://EGW_TEST_DB_USER", password_ref: "env://EGW_TEST_DB_PW"}}
      pool: {{max_size: 2, acquire_timeout_s: 0.5}}
      session: {{statement_timeout_s: 5, lock_timeout_s: 5}}
      statements:
        item:
          mode: read
          sql: SELECT id, sku, price, made, blob, doc FROM {schema}.items WHERE sku = $1
          params: [{{name: sku, type: string}}]
        items_from:
          mode: read
          sql: SELECT id FROM {schema}.items WHERE id >= $1 ORDER BY id
          params: [{{name: first, type: integer, minimum: 1, maximum: 1000}}]
          max_rows: 5
        items_all_or_error:
          mode: read
          sql: SELECT id FROM {schema}.items ORDER BY id
          max_rows: 5
          on_limit: error
        count:
          mode: read
          sql: SELECT count(*) AS n FROM {schema}.items
        by_pattern:
          mode: read
          sql: SELECT id FROM {schema}.items WHERE sku = $1
          params: [{{name: sku, type: string, pattern: "sku-[0-9]{{1,4}}"}}]
        sleep:
          mode: read
          sql: SELECT pg_sleep($1)
          params: [{{name: s, type: number}}]
          timeout_s: 0.3
        secret:
          mode: read
          sql: SELECT v FROM {schema}.secret
        add:
          mode: write
          sql: INSERT INTO {schema}.items (id, sku) VALUES ($1, $2)
          params: [{{name: id, type: integer}}, {{name: sku, type: string}}]
        bump_both:
          mode: write
          sql: UPDATE {schema}.items SET price = price + 1 WHERE id = $1 OR id = $2
          params: [{{name: a, type: integer}}, {{name: b, type: integer}}]
        lock_one:
          mode: write
          sql: UPDATE {schema}.items SET price = price + 1 WHERE id = $1
          params: [{{name: id, type: integer}}]
        reprice_all:
          mode: write
          sql: UPDATE {schema}.items SET price = price WHERE id > $1
          params: [{{name: above, type: integer}}]
          max_affected_rows: 3
""" + (f"# role {role}\n")


@pytest.fixture
async def lab(schema: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Any]:
    monkeypatch.setenv("EGW_TEST_DB_USER", schema.replace("egw_", "egw_app_"))
    monkeypatch.setenv("EGW_TEST_DB_PW", "unused-TEST-password")
    policy = PolicySet.compile(parse_policy(policy_text(schema)))
    resolvers = build_secret_resolvers(policy.policy)
    databases = Databases(resolvers)
    databases.apply(policy)
    await databases.start()
    stream = io.StringIO()
    store = MemoryIdempotencyStore()
    metrics = Metrics()
    pipeline = Pipeline(
        policy,
        resolvers=resolvers,
        upstream=None,  # type: ignore[arg-type]  # a database target never uses it
        audit=audit.AuditLog(policy.policy.audit, stream, agent_id="db-agent"),
        metrics=metrics,
        groups=RateLimitGroups(policy.policy.rate_limit_groups),
        breakers=CircuitBreakers(breaker_specs(policy.policy.targets)),
        idempotency=store,
        rng=random.Random(0),
        databases=databases,
    )

    class Lab:
        records: list[dict[str, Any]] = []
        series = metrics

        async def call_target(self, target: str, statement: str) -> Any:
            return (await self.call(statement, target_system=target))[1]

        async def call(self, statement: str, method: str = "GET", **extra: Any) -> Any:
            envelope = {
                "trace_id": "t-" + secrets.token_hex(4),
                "correlation_id": "c-1",
                "target_system": "shop",
                "endpoint": f"/{statement}",
                "method": method,
                **extra,
            }
            status, answer = await pipeline.handle(json.dumps(envelope).encode())
            lines = [json.loads(x) for x in stream.getvalue().splitlines() if x.strip()]
            self.records = [r for r in lines if r.get("event") != "gateway_started"]
            return status, answer

    try:
        yield Lab()
    finally:
        await databases.aclose()
        await store.aclose()


async def test_a_read_by_name_answers_json_safe_rows_and_one_record(lab: Any) -> None:
    status, answer = await lab.call("item", parameters={"sku": "sku-3"})
    assert status == 200, answer.error
    assert answer.success
    data = answer.data
    assert data["statement"] == "item"
    assert data["columns"] == ["id", "sku", "price", "made", "blob", "doc"]
    assert data["rows"] == [
        [3, "sku-3", "3.75", "2026-01-02T03:04:05+00:00", "AAH/", {"k": [1, 2]}]
    ]
    assert (data["row_count"], data["truncated"], data["affected_rows"]) == (1, False, None)
    record = lab.records[-1]
    assert record["api"] == "database"
    assert record["db_statement"] == "item"
    # The user came through a secret reference: the redaction hides it like any secret.
    assert record["db_rows"] == 1
    assert record["db_user"] == "[REDACTED]"
    assert len(record["db_sql_sha256"]) == 64
    assert len(record["db_params_sha256"]) == 64
    assert "sku-3" not in json.dumps(record)  # the parameter's value is never recorded
    assert "unused-TEST-password" not in json.dumps(lab.records)
    assert record["db_pool_wait_ms"] >= 0
    assert record["decision"] == "allowed"


async def test_injection_in_every_parameter_is_only_a_value(lab: Any) -> None:
    attacks = [
        "x' OR '1'='1",
        "sku-1'; DELETE FROM items; --",
        "sku-1; DELETE FROM items",
        "$1",
        "') UNION SELECT v FROM secret --",
    ]
    for attack in attacks:
        status, answer = await lab.call("item", parameters={"sku": attack})
        assert status == 200, attack
        assert answer.data["rows"] == [], attack
        status, answer = await lab.call("add", "POST", parameters={"id": 900, "sku": attack})
        assert answer.success, attack
        assert psql(f"SELECT sku FROM {_schema(lab)}.items WHERE id = 900") == attack
        psql(f"DELETE FROM {_schema(lab)}.items WHERE id = 900")
    assert psql(f"SELECT count(*) FROM {_schema(lab)}.items") == "30"


async def test_no_sql_of_the_agents_own_gets_run(lab: Any) -> None:
    tries = [
        ("/count; DELETE FROM items", "GET"),
        ("/SELECT 1; DELETE FROM items", "GET"),
        ("/add", "GET"),  # a write is POST only
        ("/count", "POST"),  # a read is GET only
        ("/nope", "GET"),
    ]
    for endpoint, method in tries:
        _, answer = await lab.call(endpoint.lstrip("/"), method)
        assert answer.error.code == "PERMISSION_DENIED", endpoint
    _, answer = await lab.call("count", body={"content_type": "text/plain", "base64": ""})
    assert answer.error.code == "INVALID_PAYLOAD"
    _, answer = await lab.call("count", query={"sql": "DELETE FROM items"})
    assert answer.error.code == "INVALID_PAYLOAD"
    _status, answer = await lab.call("count", parameters={"sql": "DELETE FROM items"})
    assert answer.error.details["reason"] == "unknown_parameter"
    assert psql(f"SELECT count(*) FROM {_schema(lab)}.items") == "30"


async def test_parameters_are_checked_by_their_rules(lab: Any) -> None:
    _, answer = await lab.call("by_pattern", parameters={"sku": "sku-1' OR 1=1"})
    assert (answer.error.code, answer.error.details["reason"]) == (
        "PERMISSION_DENIED",
        "parameter_refused",
    )
    _, answer = await lab.call("items_from", parameters={"first": 5000})
    assert answer.error.code == "PERMISSION_DENIED"
    _, answer = await lab.call("items_from", parameters={"first": "5"})
    assert answer.error.code == "INVALID_PAYLOAD"
    _, answer = await lab.call("items_from", parameters={"first": True})
    assert answer.error.code == "INVALID_PAYLOAD"
    _, answer = await lab.call("items_from")
    assert answer.error.details["reason"] == "missing_parameter"


async def test_a_rate_limit_group_holds_a_database_target(lab: Any) -> None:
    first = await lab.call_target("limited", "count")
    second = await lab.call_target("limited", "count")
    assert first.success, first.error
    assert second.error.code == "CAPACITY_EXCEEDED"
    assert lab.records[-1]["rate_limit_group"] == "one-a-minute"
    assert lab.records[-1]["db_statement"] == "count"
    assert lab.records[-1]["db_pool_wait_ms"] is None  # refused before it ran


async def test_a_shadow_mode_group_records_what_it_would_refuse(lab: Any) -> None:
    first = await lab.call_target("shadowed", "count")
    second = await lab.call_target("shadowed", "count")
    assert first.success, first.error
    assert second.success, second.error  # shadow mode: recorded, never refused
    assert lab.records[-1]["shadow_denied"] == ["rate_limit_group:watched"]
    assert lab.records[-1]["decision"] == "shadow_denied"
    assert lab.records[-1]["db_rows"] == 1


async def test_max_bytes_truncates_rows(lab: Any) -> None:
    answer = await lab.call_target("limited", "wide")
    assert answer.success, answer.error
    assert answer.data["truncated"] is True
    assert answer.data["row_count"] == len(answer.data["rows"])
    assert 1 <= answer.data["row_count"] < 30
    assert len(json.dumps(answer.data["rows"])) <= 2048 + 64


async def test_limits_truncate_or_refuse(lab: Any) -> None:
    _, answer = await lab.call("items_from", parameters={"first": 1})
    assert answer.data["rows"] == [[1], [2], [3], [4], [5]]
    assert answer.data["truncated"] is True
    _, answer = await lab.call("items_all_or_error")
    assert answer.error.code == "RESPONSE_TOO_LARGE"
    _, answer = await lab.call("reprice_all", "POST", parameters={"above": 10})
    assert answer.error.code == "UPSTREAM_REJECTED"
    assert answer.error.details["reason"] == "max_affected_rows"
    _, answer = await lab.call("reprice_all", "POST", parameters={"above": 28})
    assert answer.success
    assert answer.data["affected_rows"] == 2


async def test_database_errors_in_the_products_codes(lab: Any) -> None:
    _, answer = await lab.call("sleep", parameters={"s": 5})
    assert answer.error.code == "AGENT_TIMEOUT"
    assert answer.error.details["sqlstate"] == "57014"
    assert lab.records[-1]["db_sqlstate"] == "57014"
    _, answer = await lab.call("secret")
    assert answer.error.code == "PERMISSION_DENIED"
    assert answer.error.details["sqlstate"] == "42501"
    _, answer = await lab.call("add", "POST", parameters={"id": 1, "sku": "dup"})
    error = answer.error
    assert (error.code, error.details["sqlstate"]) == ("UPSTREAM_REJECTED", "23505")
    assert error.details["constraint"] == "items_pkey"


async def test_a_deadlock_is_retried_and_the_write_lands(lab: Any) -> None:
    import asyncpg

    schema = _schema(lab)
    blocker = await asyncpg.connect("postgresql://postgres@127.0.0.1:5432/test")
    watcher = await asyncpg.connect("postgresql://postgres@127.0.0.1:5432/test")
    try:
        tx = blocker.transaction()
        await tx.start()
        await blocker.execute("SET LOCAL deadlock_timeout = '10s'")
        await blocker.execute(f"UPDATE {schema}.items SET price = 100 WHERE id = 2")
        call = asyncio.create_task(lab.call("bump_both", "POST", parameters={"a": 1, "b": 2}))
        for _ in range(500):  # until the sidecar's UPDATE waits on row 2 (bounded)
            # Outside the blocker's transaction, which would see one snapshot of it.
            # This session's schema only: another run of the suite may share the server.
            waiting = await watcher.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND query LIKE $1",
                f"%{schema}.items SET price = price + 1%",
            )
            if waiting or call.done():
                break
            await asyncio.sleep(0.01)
        assert waiting, call.done() and call.result()[1]
        await blocker.execute(f"UPDATE {schema}.items SET price = 200 WHERE id = 1")
        await tx.commit()
        _status, answer = await call
    finally:
        await blocker.close()
        await watcher.close()
    assert answer.success, answer.error
    assert answer.data["affected_rows"] == 2
    # At least the one deadlock, and only deadlocks: when the sidecar's transaction is
    # rolled back, its retry and the blocker race for row 1 (a waiter on a row lock
    # retries the lock when its holder ends; a newcomer can win), and a retry that wins
    # deadlocks once more against the blocker before the blocker commits.
    retries = lab.records[-1]["db_retries"]
    assert retries, "the deadlock was retried"
    assert set(retries) == {"40P01"}, retries
    assert psql(f"SELECT price FROM {schema}.items WHERE id IN (1, 2) ORDER BY id") == (
        "201.00\n101.00"
    )


def _schema(lab: Any) -> str:
    return os.environ["EGW_TEST_DB_USER"].replace("egw_app_", "egw_")


def test_validate_check_database_prepares_each_statement_against_the_database(
    schema: str, tmp_path: Any
) -> None:
    text = policy_text(schema) + (
        "        missing:\n"
        "          mode: read\n"
        f"          sql: SELECT nothing FROM {schema}.no_such_table\n"
        "        mistyped:\n"
        "          mode: read\n"
        f"          sql: SELECT id FROM {schema}.items WHERE id = $1\n"
        "          params: [{name: id, type: string}]\n"
    )
    path = tmp_path / "db.yaml"
    path.write_text(text)
    env = {
        **os.environ,
        "PYTHONPATH": os.getcwd(),
        "EGW_TEST_DB_USER": schema.replace("egw_", "egw_app_"),
        "EGW_TEST_DB_PW": "unused",
    }
    plain = subprocess.run(
        [sys.executable, "-m", "gateway", "validate", str(path)],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr
    checked = subprocess.run(
        [sys.executable, "-m", "gateway", "validate", "--check-database", str(path)],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert checked.returncode == 1
    lines = text.splitlines()
    missing = lines.index("        missing:") + 1
    mistyped = lines.index("        mistyped:") + 1
    assert checked.stderr.splitlines() == [
        f"{path}:{missing}: targets.shop.database.statements.missing: PostgreSQL refuses it "
        f'(42P01): relation "{schema}.no_such_table" does not exist',
        f"{path}:{mistyped}: targets.shop.database.statements.mistyped: statement 'mistyped': "
        "parameter 'id' is string in the policy but PostgreSQL reads $1 as int4",
    ]


async def test_a_sidecar_serves_statements_on_the_envelope_route_only(
    schema: str, monkeypatch: pytest.MonkeyPatch, sidecar_factory: Any
) -> None:
    monkeypatch.setenv("EGW_TEST_DB_USER", schema.replace("egw_", "egw_app_"))
    monkeypatch.setenv("EGW_TEST_DB_PW", "unused-TEST-password")
    sidecar = await sidecar_factory(PolicySet.compile(parse_policy(policy_text(schema))))
    envelope = {
        "trace_id": "t-http",
        "correlation_id": "c-http",
        "target_system": "shop",
        "endpoint": "/count",
        "method": "GET",
    }
    status, answer = await sidecar.call(envelope)
    assert status == 200, answer
    assert answer["data"]["rows"] == [[30]]
    async with sidecar.session.get(sidecar.url + "/proxy/shop/count") as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["code"] == "INVALID_PAYLOAD"
    rpc = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "count"}}
    async with sidecar.session.post(sidecar.url + "/mcp/shop", json=rpc) as resp:
        error = (await resp.json())["error"]
    assert error["data"]["egress_code"] == "PERMISSION_DENIED"
    assert error["data"]["reason"] == "not_an_mcp_target"
    assert psql(f"SELECT count(*) FROM {schema}.items") == "30"
    [record, proxied, *_] = sidecar.audit_records()
    assert record["api"] == "database"
    assert record["db_rows"] == 1
    assert proxied["api"] == "proxy"
    assert proxied["error_code"] == "INVALID_PAYLOAD"
    assert proxied["db_statement"] is None


async def _waiting_on_a_lock(
    watcher: Any, calls: list[asyncio.Task[Any]], count: int, schema: str
) -> None:
    """Until ``count`` statements of the sidecar wait on a lock (bounded); this session's
    schema only, since another run of the suite may share the server."""
    for _ in range(500):
        waiting = await watcher.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND query LIKE $1",
            f"%{schema}.items SET price = price + 1 WHERE id = $1",
        )
        if waiting >= count or any(c.done() for c in calls):
            break
        await asyncio.sleep(0.01)
    assert waiting == count, [c.result()[1] for c in calls if c.done()]


async def test_a_full_pool_answers_capacity_exceeded(lab: Any) -> None:
    import asyncpg

    schema = _schema(lab)
    blocker = await asyncpg.connect("postgresql://postgres@127.0.0.1:5432/test")
    watcher = await asyncpg.connect("postgresql://postgres@127.0.0.1:5432/test")
    try:
        tx = blocker.transaction()
        await tx.start()
        await blocker.execute(f"UPDATE {schema}.items SET price = price WHERE id = 7")
        calls = [
            asyncio.create_task(lab.call("lock_one", "POST", parameters={"id": 7}))
            for _ in range(2)  # the pool's two connections, each waiting on the row
        ]
        await _waiting_on_a_lock(watcher, calls, 2, schema)
        _, answer = await lab.call("count")
        record = lab.records[-1]
        await tx.rollback()
        done = await asyncio.gather(*calls)
    finally:
        await blocker.close()
        await watcher.close()
    assert answer.error.code == "CAPACITY_EXCEEDED"
    assert answer.error.details["reason"] == "pool_wait"
    assert record["db_pool_wait_ms"] >= 500  # acquire_timeout_s: it waited that long
    assert all(a.success for _, a in done)


async def test_a_write_lost_after_it_was_sent_is_outcome_unknown(lab: Any) -> None:
    import asyncpg

    schema = _schema(lab)
    blocker = await asyncpg.connect("postgresql://postgres@127.0.0.1:5432/test")
    watcher = await asyncpg.connect("postgresql://postgres@127.0.0.1:5432/test")
    try:
        tx = blocker.transaction()
        await tx.start()
        await blocker.execute(f"UPDATE {schema}.items SET price = price WHERE id = 8")
        call = asyncio.create_task(lab.call("lock_one", "POST", parameters={"id": 8}))
        await _waiting_on_a_lock(watcher, [call], 1, schema)
        await watcher.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE wait_event_type = 'Lock' AND query LIKE $1",
            f"%{schema}.items SET price = price + 1 WHERE id = $1",
        )
        _, answer = await call
        await tx.rollback()
    finally:
        await blocker.close()
        await watcher.close()
    assert answer.error.code == "OUTCOME_UNKNOWN"
    assert lab.records[-1]["db_statement"] == "lock_one"
    _, again = await lab.call("count")  # the pool replaced the lost connection
    assert again.success


async def test_a_write_with_an_idempotency_key_runs_once(lab: Any) -> None:
    extra = {"idempotency_key": "note-" + secrets.token_hex(4)}
    _, first = await lab.call("add", "POST", parameters={"id": 950, "sku": "once"}, **extra)
    _, again = await lab.call("add", "POST", parameters={"id": 950, "sku": "once"}, **extra)
    assert first.success
    assert again.success
    assert again.replayed
    assert again.data == first.data
    assert psql(f"SELECT count(*) FROM {_schema(lab)}.items WHERE id = 950") == "1"
    psql(f"DELETE FROM {_schema(lab)}.items WHERE id = 950")


async def test_an_unreachable_database_is_dependency_failed_and_opens_the_breaker(
    schema: str, monkeypatch: pytest.MonkeyPatch, sidecar_factory: Any
) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed once the block ends: nobody listens there
    monkeypatch.setenv("EGW_TEST_DB_USER", "nobody")
    monkeypatch.setenv("EGW_TEST_DB_PW", "unused-TEST-password")
    text = policy_text(schema).replace("127.0.0.1:5432/test", f"127.0.0.1:{port}/test")
    text = text.replace("timeout_s: 10\n", "timeout_s: 10\n    circuit_breaker: {fail_max: 2}\n")
    sidecar = await sidecar_factory(PolicySet.compile(parse_policy(text)))
    envelope = {"trace_id": "t", "correlation_id": "c", "target_system": "shop",
                "endpoint": "/count", "method": "GET"}  # fmt: skip
    codes = [(await sidecar.call(envelope))[1]["error"]["code"] for _ in range(3)]
    assert codes == ["DEPENDENCY_FAILED", "DEPENDENCY_FAILED", "CIRCUIT_OPEN"]


def test_asyncpg_is_loaded_only_for_a_policy_with_a_database_target() -> None:
    program = (
        "import sys\n"
        "import gateway.server.components, gateway.call.pipeline, gateway.database.registry\n"
        "assert 'asyncpg' not in sys.modules, 'loaded without a database target'\n"
        "sys.modules['asyncpg'] = None  # as if the database extra were not installed\n"
        "from gateway.database.registry import engine_class\n"
        "try:\n"
        "    engine_class()\n"
        "except ValueError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        "the policy has a database target but asyncpg is not installed: "
        "pip install 'egress-gateway[database]'"
    )


async def test_a_reload_replaces_only_a_changed_database_section(
    schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    role = schema.replace("egw_", "egw_app_")
    monkeypatch.setenv("EGW_TEST_DB_USER", role)
    monkeypatch.setenv("EGW_TEST_DB_PW", "unused-TEST-password")
    text = policy_text(schema)
    first = PolicySet.compile(parse_policy(text))
    changed = PolicySet.compile(parse_policy(text.replace("max_rows: 5\n", "max_rows: 6\n", 1)))
    databases = Databases(build_secret_resolvers(first.policy))
    databases.apply(first)
    await databases.start()

    async def connections(expected: int) -> int:
        """The role's connections once they number ``expected`` (closing ones linger a
        moment in pg_stat_activity), or what they number after a bounded wait."""
        for _ in range(200):
            found = int(psql(f"SELECT count(*) FROM pg_stat_activity WHERE usename = '{role}'"))
            if found == expected:
                break
            await asyncio.sleep(0.02)
        return found

    try:
        shop, limited = databases.get("shop"), databases.get("limited")
        pools = len([t for t in first.targets.values() if t.spec.database is not None])
        assert await connections(pools) == pools  # each pool's first connection
        databases.apply(changed)  # shop's statements changed, limited's did not
        assert databases.get("limited") is limited
        assert databases.get("shop") is not shop
        # The old pool closed (its calls were done); the new one opens at its first call.
        assert await connections(pools - 1) == pools - 1
    finally:
        await databases.aclose()
    assert await connections(0) == 0
