"""Vault through the sidecar's HTTP API, against the real OpenBao dev server."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp import web

from tests.conftest import compile_policy, envelope
from tests.vault_fixtures import B12_OPENAI, VaultLab, free_port


@pytest.fixture(autouse=True)
def _no_vault_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "VAULT_ADDR",
        "VAULT_TOKEN",
        "VAULT_NAMESPACE",
        "VAULT_ROLE_ID",
        "VAULT_SECRET_ID",
        "VAULT_CACERT",
        "VAULT_SKIP_VERIFY",
    ):
        monkeypatch.delenv(name, raising=False)


def _vault(lab: VaultLab, token_file: str, address: str | None = None) -> dict[str, Any]:
    return {
        "vault": {
            "address": address or lab.address,
            "auth": {"method": "token", "token_file": token_file},
            "kv_mount": "kv2",
            "refs": {
                "vault://fake-openai-key": {
                    "mount": "agents-kv",
                    "kv_version": 2,
                    "path": "llm/openai",
                    "field": "api_key",
                },
                "vault://fake-missing-key": {"mount": "agents-kv", "path": "llm/missing"},
                "vault://fake-other-key": {
                    "mount": "kv2",
                    "path": "app/openai",
                    "field": "api_key",
                },
            },
        }
    }


def _target(url: str, refs: list[str]) -> dict[str, Any]:
    return {
        "base_url": url,
        "credential": {
            "header": "Authorization",
            "format": "Bearer {secret}",
            "allowed_refs": refs,
        },
        "endpoints": [{"path": "/v1/chat/completions", "methods": ["POST"]}],
        "retry": {"backoff_base_s": 0.01},
    }


REFS = ["vault://fake-openai-key", "vault://fake-missing-key", "vault://fake-other-key"]


async def test_b12_through_the_sidecar(vault_lab: VaultLab, upstream, sidecar_factory):
    token_file = vault_lab.write("b12.token", vault_lab.token(["b12-reader"]))
    policy = compile_policy(
        {"fake-openai": _target(upstream.url, REFS)}, secrets=_vault(vault_lab, token_file)
    )
    sc = await sidecar_factory(policy)
    async with sc.session.get(sc.url + "/readyz") as resp:
        assert resp.status == 200
        assert (await resp.json())["checks"]["secrets"] is True
    mark = vault_lab.bao.audit_mark()
    status, answer = await sc.call(envelope(api_key_ref="vault://fake-openai-key"))
    assert status == 200, answer
    assert upstream.seen[0].headers["Authorization"] == f"Bearer {B12_OPENAI}"
    reads = [r["path"] for r in vault_lab.bao.requests(mark)]
    assert "agents-kv/data/llm/openai" in reads
    assert not [p for p in reads if p.startswith(("secret/", "sys/mounts"))]

    status, answer = await sc.call(envelope(api_key_ref="vault://fake-missing-key"))
    assert (status, answer["error"]["code"], answer["error"]["retryable"]) == (
        500,
        "SECRET_NOT_FOUND",
        False,
    )
    status, answer = await sc.call(envelope(api_key_ref="vault://fake-other-key"))
    assert (status, answer["error"]["code"], answer["error"]["retryable"]) == (
        403,
        "SECRET_ACCESS_DENIED",
        False,
    )
    assert upstream.hits == 1
    # The secret's value is in no answer and no log line.
    assert B12_OPENAI not in sc.log.getvalue()
    [ok, missing, denied] = sc.audit_records()
    assert ok["api_key_ref"] == "vault://fake-openai-key"
    assert missing["error_code"] == "SECRET_NOT_FOUND"
    assert denied["error_code"] == "SECRET_ACCESS_DENIED"


async def test_vault_unreachable_is_retryable_and_the_sidecar_stays_ready(
    vault_lab: VaultLab, upstream, sidecar_factory
):
    """One Vault is shared by every sidecar: its outage is reported by /readyz but does
    not make the pod NotReady (every agent pod would leave its Services at once); the
    calls that need it answer retryably."""
    token_file = vault_lab.write("b12-dead.token", vault_lab.token(["b12-reader"]))
    dead = f"http://127.0.0.1:{free_port()}"
    policy = compile_policy(
        {"fake-openai": _target(upstream.url, REFS)},
        secrets=_vault(vault_lab, token_file, address=dead),
    )
    sc = await sidecar_factory(policy)
    async with sc.session.get(sc.url + "/readyz") as resp:
        assert resp.status == 200
        body = await resp.json()
    assert body["status"] == "ready"
    assert body["checks"]["secrets"] is False  # reported, not gating
    status, answer = await sc.call(envelope(api_key_ref="vault://fake-openai-key"))
    assert status == 502
    assert answer["error"]["code"] == "DEPENDENCY_FAILED"
    assert answer["error"]["retryable"] is True
    assert upstream.hits == 0


async def test_upstream_401_on_a_cached_key_rotates_it(
    vault_lab: VaultLab, upstream_factory, sidecar_factory
):
    root = vault_lab.bao.root()
    kv = root.secrets.kv.v2
    kv.create_or_update_secret("app/rotating", {"api_key": "rot-TEST-key-0001"}, mount_point="kv2")
    accepted = {"key": "rot-TEST-key-0001"}

    async def provider(request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {accepted['key']}":
            return web.json_response({"error": "invalid api key"}, status=401)
        return web.json_response({"ok": True})

    up = await upstream_factory(provider)
    token_file = vault_lab.write("reader.token", vault_lab.token(["gw-reader"]))
    secrets = {
        "vault": {
            "address": vault_lab.address,
            "auth": {"method": "token", "token_file": token_file},
            "kv_mount": "kv2",
            "cache_ttl_s": 300,
        }
    }
    ref = "vault://app/rotating#api_key"
    sc = await sidecar_factory(
        compile_policy({"fake-openai": _target(up.url, [ref])}, secrets=secrets)
    )
    status, _ = await sc.call(envelope(api_key_ref=ref))
    assert status == 200

    # The key is rotated in Vault and at the provider; the sidecar still caches the old one.
    kv.create_or_update_secret("app/rotating", {"api_key": "rot-TEST-key-0002"}, mount_point="kv2")
    accepted["key"] = "rot-TEST-key-0002"
    status, answer = await sc.call(envelope(api_key_ref=ref, correlation_id="corr-2"))
    assert status == 200, answer
    assert [s.headers["Authorization"] for s in up.seen] == [
        "Bearer rot-TEST-key-0001",
        "Bearer rot-TEST-key-0001",
        "Bearer rot-TEST-key-0002",
    ]
    record = sc.audit_records()[-1]
    assert "credential refreshed after upstream 401" in record["warnings"]
    async with sc.session.get(sc.url + "/metrics") as resp:
        metrics = await resp.text()
    # First call: miss; second: hit, then a miss after the 401 dropped the cached key.
    assert 'egress_gateway_secret_cache_total{result="hit"} 1.0' in metrics
    assert 'egress_gateway_secret_cache_total{result="miss"} 2.0' in metrics
    assert record["attempts"] == 2

    # A key that is simply wrong is refused once more, not looped on.
    accepted["key"] = "something-else-entirely"
    status, answer = await sc.call(envelope(api_key_ref=ref, correlation_id="corr-3"))
    assert status == 403
    assert answer["error"]["code"] == "PERMISSION_DENIED"
    assert up.hits == 5
    assert "rot-TEST-key" not in json.dumps(answer) + sc.log.getvalue()
