"""The vault:// resolver against a real OpenBao dev server (no mocks of hvac).

Request counts and paths come from OpenBao's file audit device, i.e. what Vault really
received. Case B12 of ../shared/cases.md is ``test_b12_*``.
"""

from __future__ import annotations

import asyncio
import io
import json
import socket
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import hvac
import hvac.exceptions
import pytest

from gateway.audit import log as audit
from gateway.envelope import ErrorCode
from gateway.errors import (
    SecretAccessDenied,
    SecretBackendUnavailable,
    SecretError,
    SecretNotFound,
)
from gateway.policy import VaultSpec, parse_policy
from gateway.secrets import parse_ref
from gateway.secrets.factory import (
    build_secret_resolvers,
    secrets_ready,
    start_secret_resolvers,
)
from gateway.secrets.vault import KvLocation, VaultResolver, locate, select_field
from gateway.secrets.vault_auth import DEFAULT_VAULT_ADDR, VaultSettings
from tests.conftest import CountWaits
from tests.vault_fixtures import (
    B12_OPENAI,
    KV1_LEGACY,
    KV1_SHORT,
    KV2_OPENAI,
    KV2_PASSWORD,
    ROOT_TOKEN,
    BaoServer,
    VaultLab,
    free_port,
    make_jwt,
)

ref = parse_ref


def make_spec(lab: VaultLab | None = None, **overrides: Any) -> VaultSpec:
    data: dict[str, Any] = {"kv_mount": "kv2", "kv_version": 2, "timeout_s": 2}
    if lab is not None:
        data["address"] = lab.address
    data.update(overrides)
    return VaultSpec.model_validate(data)


@asynccontextmanager
async def running(
    spec: VaultSpec, environ: dict[str, str], *, start: bool = True
) -> AsyncIterator[VaultResolver]:
    resolver = VaultResolver(spec, environ=environ)
    if start:
        await resolver.start()
    try:
        yield resolver
    finally:
        await resolver.aclose()


def reader_env(lab: VaultLab) -> dict[str, str]:
    return {"VAULT_TOKEN": lab.token(["gw-reader"])}


async def poll(condition: Callable[[], bool], timeout_s: float = 8.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.05)


async def resolve_error(resolver: VaultResolver, raw: str) -> SecretError:
    with pytest.raises(SecretError) as info:
        await resolver.resolve(ref(raw))
    return info.value


# --- pure parts ------------------------------------------------------------------------


def test_settings_environment_overrides_policy() -> None:
    spec = make_spec(address="https://vault.policy:8200", namespace="ns-policy", ca_cert="/p.pem")
    env = {"VAULT_TOKEN": "hvs.TEST", "VAULT_ADDR": "https://vault.env:8200/"}
    s = VaultSettings.from_spec(spec, env)
    assert (s.address, s.namespace, s.verify) == ("https://vault.env:8200", "ns-policy", "/p.pem")
    assert s.token is not None
    assert s.token.reveal() == "hvs.TEST"
    assert "hvs.TEST" not in repr(s)
    s = VaultSettings.from_spec(
        spec, {**env, "VAULT_NAMESPACE": "ns-env", "VAULT_CACERT": "/env.pem"}
    )
    assert (s.namespace, s.verify) == ("ns-env", "/env.pem")
    assert VaultSettings.from_spec(spec, {**env, "VAULT_SKIP_VERIFY": "true"}).verify is False
    skip = make_spec(skip_verify=True)
    assert VaultSettings.from_spec(skip, {**env, "VAULT_SKIP_VERIFY": "0"}).verify is True
    with pytest.raises(ValueError, match="VAULT_SKIP_VERIFY='maybe'"):
        VaultSettings.from_spec(spec, {**env, "VAULT_SKIP_VERIFY": "maybe"})
    assert VaultSettings.from_spec(make_spec(), env).address == "https://vault.env:8200"
    assert VaultSettings.from_spec(make_spec(), {"VAULT_TOKEN": "x"}).address == DEFAULT_VAULT_ADDR
    with pytest.raises(ValueError, match="needs VAULT_TOKEN"):
        VaultSettings.from_spec(make_spec(), {})
    s = VaultSettings.from_spec(make_spec(auth={"method": "token", "token_file": "/t"}), {})
    assert (s.token, s.token_file) == (None, "/t")
    approle = make_spec(auth={"method": "approle", "role_id_file": "/r", "secret_id_file": "/s"})
    s = VaultSettings.from_spec(approle, {})
    assert (s.role_id_file, s.secret_id_file, s.mount_path) == ("/r", "/s", "approle")
    s = VaultSettings.from_spec(approle, {"VAULT_ROLE_ID": "rid", "VAULT_SECRET_ID": "sid"})
    assert (s.role_id_file, s.secret_id_file) == (None, None)
    assert s.secret_id is not None
    assert s.secret_id.reveal() == "sid"
    with pytest.raises(ValueError, match=r"VAULT_ROLE_ID or auth\.role_id_file"):
        VaultSettings.from_spec(make_spec(auth={"method": "approle"}), {})
    k8s = make_spec(auth={"method": "kubernetes", "role": "planner", "mount_path": "/k8s-a/"})
    s = VaultSettings.from_spec(k8s, {})
    assert (s.role, s.mount_path) == ("planner", "k8s-a")
    assert s.jwt_path == "/var/run/secrets/kubernetes.io/serviceaccount/token"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("vault://openai-key", KvLocation("kv2", 2, "openai-key", None)),
        ("vault://agents/openai#api_key", KvLocation("kv2", 2, "agents/openai", "api_key")),
        ("vault://mapped", KvLocation("agents-kv", 2, "llm/openai", "api_key")),
        ("vault://mapped#other", KvLocation("agents-kv", 2, "llm/openai", "other")),
        ("vault://by-path", KvLocation("old", 1, "a/b", None)),
        ("vault://by-raw#f", KvLocation("kv2", 1, "c", "f")),
    ],
)
def test_locate(raw: str, expected: KvLocation) -> None:
    spec = make_spec(
        refs={
            "vault://mapped": {"mount": "/agents-kv/", "path": "llm/openai", "field": "api_key"},
            "by-path": {"mount": "old", "kv_version": 1, "path": "/a/b/"},
            "vault://by-raw#f": {"kv_version": 1, "path": "c"},
        }
    )
    assert locate(spec, ref(raw)) == expected


@pytest.mark.parametrize(
    ("raw", "version", "data", "result"),
    [
        ("vault://s", 2, {"k": "v-value-1"}, "v-value-1"),
        ("vault://s", 1, {"k": "v-value-1", "ttl": "1h"}, "v-value-1"),  # ttl: a lease hint
        ("vault://s#ttl", 1, {"k": "v-value-1", "ttl": "1h"}, "1h"),
        ("vault://s#b", 2, {"a": "x-value-1", "b": "y-value-1"}, "y-value-1"),
        ("vault://s", 2, {"a": "x-value-1", "b": "y-value-1"}, "field_required"),
        ("vault://s", 2, {}, "field_required"),
        ("vault://s#c", 2, {"a": "x-value-1", "b": "y-value-1"}, "field_missing"),
        ("vault://s#a", 2, {"a": 12345678}, "field_not_text"),
        ("vault://s#a", 2, {"a": ""}, "field_not_text"),
    ],
)
def test_select_field(raw: str, version: int, data: dict[str, Any], result: str) -> None:
    parsed = ref(raw)
    loc = KvLocation("m", version, "s", parsed.field)
    if result.startswith(("field_", "secret_")):
        with pytest.raises(SecretNotFound) as info:
            select_field(parsed, loc, data)
        assert info.value.details["reason"] == result
        assert raw in info.value.message
        for value in data.values():
            assert str(value) not in info.value.message or value == ""
        if result == "field_missing":
            assert info.value.details["available_fields"] == ["a", "b"]
            assert "its fields are: a, b" in info.value.message
    else:
        assert select_field(parsed, loc, data) == result


# --- reads, errors, cache ----------------------------------------------------------------


async def test_kv2_and_kv1_reads_with_field_selection(vault_lab: VaultLab) -> None:
    spec = make_spec(
        vault_lab,
        refs={
            "vault://legacy": {"mount": "kv1", "kv_version": 1, "path": "app/legacy"},
            "vault://short": {"mount": "kv1", "kv_version": 1, "path": "app/short"},
        },
    )
    async with running(spec, reader_env(vault_lab)) as resolver:
        assert resolver.ready()
        got = await resolver.resolve(ref("vault://app/openai"))
        assert got.secret.reveal() == KV2_OPENAI
        assert (got.from_cache, got.warnings) == (False, ())
        multi = await resolver.resolve(ref("vault://app/multi#password"))
        assert multi.secret.reveal() == KV2_PASSWORD
        assert (await resolver.resolve(ref("vault://legacy"))).secret.reveal() == KV1_LEGACY
        # KV v1's "ttl" is a lease hint, not a second field: no #FIELD needed.
        assert (await resolver.resolve(ref("vault://short"))).secret.reveal() == KV1_SHORT


async def test_missing_forbidden_and_deleted_are_distinct(vault_lab: VaultLab) -> None:
    spec = make_spec(vault_lab, refs={"vault://v1-on-v2": {"kv_version": 1, "path": "app/openai"}})
    async with running(spec, reader_env(vault_lab)) as resolver:
        missing = await resolve_error(resolver, "vault://app/nope")
        field = await resolve_error(resolver, "vault://app/multi#api_key")
        required = await resolve_error(resolver, "vault://app/multi")
        deleted = await resolve_error(resolver, "vault://app/deleted")
        destroyed = await resolve_error(resolver, "vault://app/destroyed")
        denied = await resolve_error(resolver, "vault://forbidden/x")
        mismatch = await resolve_error(resolver, "vault://v1-on-v2")

    for err, cls, reason in [
        (missing, SecretNotFound, "secret_missing"),
        (field, SecretNotFound, "field_missing"),
        (required, SecretNotFound, "field_required"),
        (deleted, SecretNotFound, "version_deleted"),
        (destroyed, SecretNotFound, "version_deleted"),
        (denied, SecretAccessDenied, "vault_forbidden"),
        (mismatch, SecretNotFound, "kv_version_mismatch"),
    ]:
        assert type(err) is cls, (reason, err)
        assert err.details["reason"] == reason
        assert err.retryable is False
        assert err.details["api_key_ref"] in err.message
        assert KV2_PASSWORD not in err.message
        assert KV2_OPENAI not in err.message
    assert missing.code is ErrorCode.SECRET_NOT_FOUND
    assert denied.code is ErrorCode.SECRET_ACCESS_DENIED
    assert "GET /v1/kv2/data/app/nope" in missing.message
    assert "its fields are: password, user" in field.message
    assert deleted.details["state"] == "deleted"
    assert destroyed.details["state"] == "destroyed"
    assert "GET /v1/kv2/data/forbidden/x" in denied.message


async def test_cache_hot_path_and_lease_bound(vault_lab: VaultLab) -> None:
    spec = make_spec(
        vault_lab,
        cache_ttl_s=300,
        refs={"vault://short": {"mount": "kv1", "kv_version": 1, "path": "app/short"}},
    )
    async with running(spec, reader_env(vault_lab)) as resolver:
        mark = vault_lab.bao.audit_mark()
        first = await resolver.resolve(ref("vault://app/openai"))
        for _ in range(20):
            again = await resolver.resolve(ref("vault://app/openai"))
            assert again.from_cache
            assert again.secret == first.secret
        assert len(vault_lab.bao.requests(mark, "kv2/data/app/openai")) == 1

        # KV v1 states a 1 s lease ("ttl": "1s"): the 300 s cache TTL must not outlive it.
        started = time.monotonic()
        assert not (await resolver.resolve(ref("vault://short"))).from_cache
        assert (await resolver.resolve(ref("vault://short"))).from_cache
        fresh: list[bool] = []

        async def refetched() -> bool:
            fresh.append(not (await resolver.resolve(ref("vault://short"))).from_cache)
            return fresh[-1]

        deadline = started + 5
        while not await refetched():
            assert time.monotonic() < deadline, "cached value outlived its 1 s lease"
            await asyncio.sleep(0.05)
        assert time.monotonic() - started >= 0.9
        assert len(vault_lab.bao.requests(mark, "kv1/app/short")) == 2


async def test_single_flight_100_concurrent_first_reads(vault_lab: VaultLab) -> None:
    path = f"flight/{uuid.uuid4().hex}"
    value = f"fl-TEST-{uuid.uuid4().hex}"
    vault_lab.bao.root().secrets.kv.v2.create_or_update_secret(
        path, {"api_key": value}, mount_point="kv2"
    )
    async with running(make_spec(vault_lab), reader_env(vault_lab)) as resolver:
        mark = vault_lab.bao.audit_mark()
        results = await asyncio.gather(
            *(resolver.resolve(ref(f"vault://{path}")) for _ in range(100))
        )
        assert {r.secret.reveal() for r in results} == {value}
        assert len(vault_lab.bao.requests(mark, f"kv2/data/{path}")) == 1


async def test_invalidate_then_resolve_picks_up_rotated_value(vault_lab: VaultLab) -> None:
    path = f"rotate/{uuid.uuid4().hex}"
    kv2 = vault_lab.bao.root().secrets.kv.v2
    kv2.create_or_update_secret(path, {"api_key": "old-TEST-key-0001"}, mount_point="kv2")
    async with running(make_spec(vault_lab), reader_env(vault_lab)) as resolver:
        secret_ref = ref(f"vault://{path}")
        assert (await resolver.resolve(secret_ref)).secret.reveal() == "old-TEST-key-0001"
        kv2.create_or_update_secret(path, {"api_key": "new-TEST-key-0002"}, mount_point="kv2")
        cached = await resolver.resolve(secret_ref)
        assert cached.from_cache
        assert cached.secret.reveal() == "old-TEST-key-0001"
        # What the pipeline does when the upstream answers 401 to a cached credential:
        resolver.invalidate(secret_ref)
        rotated = await resolver.resolve(secret_ref)
        assert not rotated.from_cache
        assert rotated.secret.reveal() == "new-TEST-key-0002"


async def test_stale_if_error_while_vault_is_stopped(tmp_path: Path) -> None:
    bao = BaoServer(tmp_path / "bao").start()
    try:
        bao.root().secrets.kv.v2.create_or_update_secret(
            "app/key", {"api_key": "st-TEST-stale-0001"}, mount_point="secret"
        )
        env = {"VAULT_TOKEN": ROOT_TOKEN}
        base = {"address": bao.address, "kv_mount": "secret", "cache_ttl_s": 0, "timeout_s": 1}
        async with (
            running(make_spec(**base, stale_if_error_s=60), env) as tolerant,
            running(make_spec(**base, stale_if_error_s=0), env) as strict,
        ):
            key = ref("vault://app/key")
            assert not (await tolerant.resolve(key)).from_cache
            assert not (await strict.resolve(key)).from_cache
            bao.root().sys.seal()  # a sealed Vault answers 503
            sealed = await resolve_error(strict, "vault://app/key")
            assert isinstance(sealed, SecretBackendUnavailable)
            assert "VaultDown" in sealed.message
            bao.stop()

            stale = await tolerant.resolve(key)
            assert stale.secret.reveal() == "st-TEST-stale-0001"
            assert stale.from_cache
            assert len(stale.warnings) == 1
            assert "vault://app/key" in stale.warnings[0]
            assert "st-TEST-stale-0001" not in stale.warnings[0]
            # Within the hold-down window the stale value is served without waiting on Vault.
            assert (await tolerant.resolve(key)).warnings

            counted = CountWaits(resolve_error(tolerant, "vault://app/never"))
            err = await counted
            assert isinstance(err, SecretBackendUnavailable)
            assert err.code is ErrorCode.DEPENDENCY_FAILED
            assert err.retryable
            assert err.details["reason"] == "vault_unavailable"
            assert counted.waits == 0  # fails fast: no wait on a dead Vault
    finally:
        bao.stop()


async def test_unreachable_vault_at_start(vault_lab: VaultLab) -> None:
    spec = make_spec(address=f"http://127.0.0.1:{free_port()}", timeout_s=1)
    async with running(spec, {"VAULT_TOKEN": "s.not-used-TEST"}) as resolver:
        assert not resolver.ready()  # start() logged the failure, did not raise
        err = await resolve_error(resolver, "vault://app/openai")
        assert isinstance(err, SecretBackendUnavailable)
        assert err.retryable


async def test_silent_vault_times_out_without_blocking_the_loop() -> None:
    with socket.socket() as silent:  # accepts connections (backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        address = f"http://127.0.0.1:{silent.getsockname()[1]}"
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        spec = make_spec(address=address, timeout_s=0.3)
        async with running(spec, {"VAULT_TOKEN": "s.unused-TEST"}, start=False) as resolver:
            task = asyncio.create_task(ticker())
            started = time.monotonic()
            err = await resolve_error(resolver, "vault://app/openai")
            elapsed = time.monotonic() - started
            task.cancel()
            await asyncio.wait([task])
    assert isinstance(err, SecretBackendUnavailable)
    assert 0.25 <= elapsed < 2.0
    assert ticks >= 5  # the event loop kept running while hvac waited in its thread


async def test_missing_credential_file(vault_lab: VaultLab, tmp_path: Path) -> None:
    spec = make_spec(vault_lab, auth={"method": "token", "token_file": str(tmp_path / "none")})
    async with running(spec, {}) as resolver:
        assert not resolver.ready()
        err = await resolve_error(resolver, "vault://app/openai")
    assert isinstance(err, SecretAccessDenied)
    assert err.details["reason"] == "credential_file_missing"
    assert str(tmp_path / "none") in err.message


# --- auth methods, renewal, re-login ---------------------------------------------------


async def test_token_file_login_and_relogin_after_revocation(vault_lab: VaultLab) -> None:
    first = vault_lab.token(["gw-reader"])
    token_file = vault_lab.write(f"token-{uuid.uuid4().hex}", first)
    spec = make_spec(vault_lab, auth={"method": "token", "token_file": token_file})
    async with running(spec, {}) as resolver:
        assert resolver.ready()
        assert (await resolver.resolve(ref("vault://app/openai"))).secret.reveal() == KV2_OPENAI
        vault_lab.bao.root().auth.token.revoke(first)
        Path(token_file).write_text(vault_lab.token(["gw-reader"]))  # Vault Agent rotated it

        mark = vault_lab.bao.audit_mark()
        got = await resolver.resolve(ref("vault://app/multi#user"))
        assert got.secret.reveal() == "svc-agent"
        assert len(vault_lab.bao.requests(mark, "kv2/data/app/multi")) == 2  # 403, then retry
        assert resolver.ready()

        # A real denial (the token is fine) costs one lookup-self and no new login.
        mark = vault_lab.bao.audit_mark()
        err = await resolve_error(resolver, "vault://forbidden/x")
        assert isinstance(err, SecretAccessDenied)
        assert len(vault_lab.bao.requests(mark, "auth/token/lookup-self")) == 1
        assert len(vault_lab.bao.requests(mark, "kv2/data/forbidden/x")) == 1


async def test_kubernetes_login(vault_lab: VaultLab, tmp_path: Path) -> None:
    jwt = make_jwt()
    vault_lab.kube.approved.add(jwt)
    jwt_path = tmp_path / "token"
    jwt_path.write_text(jwt)
    spec = make_spec(
        vault_lab, auth={"method": "kubernetes", "role": "planner", "jwt_path": str(jwt_path)}
    )
    reviews = vault_lab.kube.reviews
    async with running(spec, {}) as resolver:
        assert resolver.ready()
        assert vault_lab.kube.reviews == reviews + 1
        assert (await resolver.resolve(ref("vault://app/openai"))).secret.reveal() == KV2_OPENAI

    jwt_path.write_text(make_jwt())  # a JWT the API server does not know
    async with running(spec, {}) as resolver:
        assert not resolver.ready()
        err = await resolve_error(resolver, "vault://app/openai")
        assert isinstance(err, SecretAccessDenied)
        assert err.details["reason"] == "vault_login_rejected"
        assert "kubernetes login at auth/kubernetes" in err.message


async def test_approle_login_from_files_and_environment(vault_lab: VaultLab) -> None:
    role_id = vault_lab.role_ids["gw"]
    files = make_spec(
        vault_lab,
        auth={
            "method": "approle",
            "role_id_file": vault_lab.write("role_id", role_id),
            "secret_id_file": vault_lab.write("secret_id", vault_lab.secret_id("gw")),
        },
    )
    async with running(files, {}) as resolver:
        assert (await resolver.resolve(ref("vault://app/openai"))).secret.reveal() == KV2_OPENAI
    env = {"VAULT_ROLE_ID": role_id, "VAULT_SECRET_ID": vault_lab.secret_id("gw")}
    async with running(make_spec(vault_lab, auth={"method": "approle"}), env) as resolver:
        assert (await resolver.resolve(ref("vault://app/openai"))).secret.reveal() == KV2_OPENAI
    bad = {"VAULT_ROLE_ID": role_id, "VAULT_SECRET_ID": "00000000-0000-0000-0000-000000000000"}
    async with running(make_spec(vault_lab, auth={"method": "approle"}), bad) as resolver:
        assert not resolver.ready()
        mark = vault_lab.bao.audit_mark()
        # 20 calls during the login backoff: they fail fast, not with 20 logins.
        errors = await asyncio.gather(
            *(resolver.resolve(ref(f"vault://app/n{i}")) for i in range(20)),
            return_exceptions=True,
        )
        assert len(vault_lab.bao.requests(mark, "auth/approle/login")) <= 1
    for err in errors:
        assert isinstance(err, SecretAccessDenied)
        assert err.details["reason"] == "vault_login_rejected"


async def test_approle_relogin_after_token_revocation(vault_lab: VaultLab) -> None:
    env = {"VAULT_ROLE_ID": vault_lab.role_ids["gw"], "VAULT_SECRET_ID": vault_lab.secret_id("gw")}
    async with running(make_spec(vault_lab, auth={"method": "approle"}), env) as resolver:
        await resolver.resolve(ref("vault://app/openai"))
        paths = [f"relogin/{uuid.uuid4().hex}" for _ in range(5)]
        for path in paths:
            vault_lab.bao.root().secrets.kv.v2.create_or_update_secret(
                path, {"api_key": f"rl-TEST-{path[-8:]}"}, mount_point="kv2"
            )
        assert vault_lab.revoke_tokens_of_role("gw") >= 1
        mark = vault_lab.bao.audit_mark()
        # Five reads meet the revoked token at once: one re-login, five retries.
        got = await asyncio.gather(*(resolver.resolve(ref(f"vault://{p}")) for p in paths))
        assert [g.secret.reveal() for g in got] == [f"rl-TEST-{p[-8:]}" for p in paths]
        assert len(vault_lab.bao.requests(mark, "auth/approle/login")) == 1
        assert resolver.ready()


async def test_token_renewed_before_expiry(vault_lab: VaultLab) -> None:
    # 4 s leaves the renewer slack on a loaded machine (2 s proved tight under load).
    token = vault_lab.token(["gw-reader"], ttl="4s", explicit_max_ttl="60s", renewable=True)
    created = time.monotonic()
    mark = vault_lab.bao.audit_mark()
    async with running(make_spec(vault_lab), {"VAULT_TOKEN": token}) as resolver:
        await poll(
            lambda: (
                time.monotonic() - created > 4.5  # past the token's original expiry
                and len(vault_lab.bao.requests(mark, "auth/token/renew-self")) >= 2
            )
        )
        ttl = vault_lab.bao.root().auth.token.lookup(token)["data"]["ttl"]
        assert ttl >= 1  # still alive: renewed in time
        assert resolver.ready()
        assert (await resolver.resolve(ref("vault://app/openai"))).secret.reveal() == KV2_OPENAI


async def test_relogin_when_renewal_reaches_max_ttl(vault_lab: VaultLab) -> None:
    env = {
        "VAULT_ROLE_ID": vault_lab.role_ids["gw-short"],
        "VAULT_SECRET_ID": vault_lab.secret_id("gw-short"),
    }
    mark = vault_lab.bao.audit_mark()
    async with running(make_spec(vault_lab, auth={"method": "approle"}), env) as resolver:
        await poll(lambda: len(vault_lab.bao.requests(mark, "auth/approle/login")) >= 2)
        assert len(vault_lab.bao.requests(mark, "auth/token/renew-self")) >= 1
        assert resolver.ready()
        assert (await resolver.resolve(ref("vault://app/openai"))).secret.reveal() == KV2_OPENAI


async def test_lifecycle_renewer_task_is_named_and_stopped(vault_lab: VaultLab) -> None:
    resolver = VaultResolver(make_spec(vault_lab), environ=reader_env(vault_lab))
    await resolver.start()
    tasks = [t for t in asyncio.all_tasks() if t.get_name() == "vault-token-renewer"]
    assert len(tasks) == 1
    assert not tasks[0].done()
    await resolver.aclose()
    await resolver.aclose()  # idempotent
    assert tasks[0].done()


# --- B12 and the factory -------------------------------------------------------------

B12_POLICY_YAML = """
version: 1
agent_id: planner-01
targets:
  fake-openai:
    base_url: https://api.openai.example
    credential:
      header: Authorization
      format: "Bearer {secret}"
      default_ref: vault://fake-openai-key
      allowed_refs: [vault://fake-openai-key, vault://fake-missing-key, vault://fake-other-key]
    endpoints:
      - {path: /v1/chat/completions, methods: [POST]}
secrets:
  vault:
    address: ADDRESS
    auth: {method: token}
    kv_mount: secret
    kv_version: 2
    refs:
      vault://fake-openai-key: {mount: agents-kv, kv_version: 2, path: llm/openai, field: api_key}
      vault://fake-missing-key: {mount: agents-kv, kv_version: 2, path: llm/missing, field: api_key}
      vault://fake-other-key: {mount: agents-kv, kv_version: 2, path: other/thing}
"""


async def test_b12_explicit_mount_mapping_without_sys_mounts(vault_lab: VaultLab) -> None:
    policy = parse_policy(B12_POLICY_YAML.replace("ADDRESS", vault_lab.address))
    token = vault_lab.token(["b12-reader"])
    agent_client = hvac.Client(url=vault_lab.address, token=token)
    with pytest.raises(hvac.exceptions.Forbidden):  # the premise: no sys/mounts for this token
        agent_client.sys.list_mounted_secrets_engines()
    agent_client.adapter.close()
    resolvers = build_secret_resolvers(policy, environ={"VAULT_TOKEN": token})
    mark = vault_lab.bao.audit_mark()
    try:
        await start_secret_resolvers(resolvers)
        assert secrets_ready(resolvers)
        got = await resolvers.resolve(ref("vault://fake-openai-key"))
        assert f"Bearer {got.secret.reveal()}" == f"Bearer {B12_OPENAI}"
        with pytest.raises(SecretNotFound) as not_found:
            await resolvers.resolve(ref("vault://fake-missing-key"))
        with pytest.raises(SecretAccessDenied) as denied:
            await resolvers.resolve(ref("vault://fake-other-key"))
    finally:
        await resolvers.aclose()
    assert not_found.value.code is ErrorCode.SECRET_NOT_FOUND
    assert not not_found.value.retryable
    assert denied.value.code is ErrorCode.SECRET_ACCESS_DENIED
    assert not denied.value.retryable
    seen = vault_lab.bao.requests(mark)
    reads = [(r["operation"], r["path"]) for r in seen if r["path"].startswith("agents-kv/")]
    assert ("read", "agents-kv/data/llm/openai") in reads
    assert not [r for r in seen if r["path"].startswith(("secret/", "sys/mounts"))]

    dead = f"http://127.0.0.1:{free_port()}"
    unreachable = parse_policy(B12_POLICY_YAML.replace("ADDRESS", dead))
    resolvers = build_secret_resolvers(unreachable, environ={"VAULT_TOKEN": token})
    try:
        with pytest.raises(SecretBackendUnavailable) as down:
            await resolvers.resolve(ref("vault://fake-openai-key"))
    finally:
        await resolvers.aclose()
    assert down.value.retryable
    assert down.value.code is ErrorCode.DEPENDENCY_FAILED


async def test_factory_without_vault_section(monkeypatch: pytest.MonkeyPatch) -> None:
    policy = parse_policy(
        B12_POLICY_YAML.split("secrets:")[0]
        .replace("vault://fake-openai-key", "env://FAKE_OPENAI_KEY")
        .replace(", vault://fake-missing-key, vault://fake-other-key", "")
    )
    resolvers = build_secret_resolvers(policy, environ={})
    monkeypatch.setenv("FAKE_OPENAI_KEY", "env-TEST-value-0001")
    await start_secret_resolvers(resolvers)
    assert secrets_ready(resolvers)
    assert resolvers.get("vault") is None
    assert (
        (await resolvers.resolve(ref("env://FAKE_OPENAI_KEY"))).secret.reveal().startswith("env-")
    )
    with pytest.raises(SecretNotFound, match="no vault:// resolver"):
        await resolvers.resolve(ref("vault://x"))
    await resolvers.aclose()


# --- no leaks ---------------------------------------------------------------------------


def _texts_of(exc: BaseException) -> list[str]:
    texts = ["".join(traceback.format_exception(exc))]
    while exc is not None:
        texts += [str(exc), repr(exc), json.dumps(getattr(exc, "details", {}), default=str)]
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return texts


async def test_canary_values_appear_nowhere(vault_lab: VaultLab, tmp_path: Path) -> None:
    stream = io.StringIO()
    audit.configure_logging(stream, level="debug")
    token = vault_lab.token(["gw-reader"], ttl="4s", explicit_max_ttl="60s", renewable=True)
    jwt = make_jwt()
    vault_lab.kube.approved.add(jwt)
    jwt_path = tmp_path / "jwt"
    jwt_path.write_text(jwt)
    canaries = [KV2_OPENAI, KV2_PASSWORD, KV1_LEGACY, token, jwt, ROOT_TOKEN]
    texts: list[str] = []
    log = audit.get_logger("test")
    mark = vault_lab.bao.audit_mark()
    try:
        spec = make_spec(vault_lab)
        async with running(spec, {"VAULT_TOKEN": token}) as resolver:
            for raw in ("vault://app/openai", "vault://app/multi#password"):
                got = await resolver.resolve(ref(raw))
                texts += [repr(got), str(got), repr(got.secret), str(got.secret), repr(resolver)]
                log.info("resolved", api_key_ref=raw, resolved=got, secret=got.secret)
            for raw in ("vault://app/multi#nope", "vault://app/multi", "vault://forbidden/x"):
                try:
                    await resolver.resolve(ref(raw))
                except SecretError as exc:
                    texts += _texts_of(exc)
                    log.exception("resolve_failed", api_key_ref=raw, error=exc.to_payload())
            await poll(lambda: len(vault_lab.bao.requests(mark, "auth/token/renew-self")) >= 1)
            # Vault records the request before the sidecar has its answer and logs it:
            # wait for the line itself, or closing the resolver may cancel it (a flake).
            await poll(lambda: '"vault_token_renewed"' in stream.getvalue())
        k8s = make_spec(
            vault_lab, auth={"method": "kubernetes", "role": "planner", "jwt_path": str(jwt_path)}
        )
        async with running(k8s, {}) as resolver:
            texts.append(repr(await resolver.resolve(ref("vault://app/openai"))))
    finally:
        audit.configure_logging()
    lines = stream.getvalue().splitlines()
    assert any('"vault_token_renewed"' in line for line in lines)
    assert any('"resolve_failed"' in line for line in lines)
    for text in texts + lines:
        for canary in canaries:
            assert canary not in text, f"{canary[:6]}... leaked into: {text[:200]}"
    # First line of defence: values never reached a log line at all (so nothing needed
    # scrubbing) apart from the `secret=` key, which the key redactor replaces.
    assert sum("[REDACTED]" in line for line in lines) == 2


# --- the operator docs ----------------------------------------------------------------


def _doc_blocks(language: str) -> list[str]:
    text = (Path(__file__).parent.parent / "docs" / "vault.md").read_text()
    return [block.split("```")[0] for block in text.split(f"```{language}\n")[1:]]


async def test_docs_examples_are_valid(vault_lab: VaultLab) -> None:
    (yaml_block,) = _doc_blocks("yaml")
    policy = parse_policy(yaml_block, "docs/vault.md")
    assert policy.secrets.vault is not None
    resolvers = build_secret_resolvers(policy, environ={})
    assert isinstance(resolvers.get("vault"), VaultResolver)
    await resolvers.aclose()
    vault = policy.secrets.vault
    assert locate(vault, ref("vault://openai-key")) == KvLocation(
        "agents-kv", 2, "llm/openai", "api_key"
    )
    (hcl_block,) = _doc_blocks("hcl")
    vault_lab.bao.root().sys.create_or_update_policy("docs-example", hcl_block)  # Vault parses it
