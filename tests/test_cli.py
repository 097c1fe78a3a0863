"""The command line: demo, call, validate, serve arguments."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from rich.console import Console

from gateway.audit.schema import AuditRecord
from gateway.cli import main
from gateway.demo import run_demo
from tests.conftest import compile_policy, envelope, openai_target

ROOT = Path(__file__).resolve().parent.parent


async def test_demo_runs_every_example_as_expected(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    console = Console(record=True, width=250, force_terminal=False)
    audit = tmp_path / "audit.jsonl"
    code = await run_demo(upstream_port=0, audit_path=str(audit), console=console)
    text = console.export_text()
    assert code == 0, text
    examples = sorted(p.stem for p in (ROOT / "examples").glob("*.json"))
    for name in examples:
        assert name in text
    assert "unexpected" not in text
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    calls = [r for r in records if r["event"] == "egress_call"]
    # Every example once, and the streamed one again as a stream, token by token.
    assert len(calls) == len(examples) + 1
    streamed = [r for r in calls if r["stream"]]
    assert [r["correlation_id"] for r in streamed] == ["corr-demo-0004-streamed"]
    assert streamed[0]["success"] is True
    assert streamed[0]["stream_events"] >= 4
    assert "egress.response" in text
    for record in calls:  # every record the sidecar wrote matches the documented schema
        AuditRecord.model_validate(record)
    assert {r["decision"] for r in calls} == {"allowed", "denied", "invalid"}
    from gateway.audit.query.verify import verify

    assert verify([str(audit)]).ok  # the demo's policy turns the hash chain on
    assert str(audit) in text
    for secret in ("sk-demo-0001", "ak-demo-0002", "xoxb-demo-0003"):
        assert secret not in audit.read_text()


async def test_call_sends_an_envelope_and_prints_the_answer(
    upstream, sidecar_factory, tmp_path, capsys
):
    sc = await sidecar_factory(compile_policy({"fake-openai": openai_target(upstream.url)}))
    path = tmp_path / "env.json"
    path.write_text(json.dumps(envelope()))
    code = await asyncio.to_thread(main, ["call", str(path), "--url", sc.url])
    out = capsys.readouterr().out
    assert code == 0
    assert json.loads(out)["success"] is True
    path.write_text(json.dumps(envelope(target_system="nope")))
    code = await asyncio.to_thread(main, ["call", str(path), "--url", sc.url])
    assert code == 1
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "PERMISSION_DENIED"


def test_call_reports_an_unreachable_sidecar(tmp_path, capsys, unused_tcp_port):
    path = tmp_path / "env.json"
    path.write_text(json.dumps(envelope()))
    code = main(["call", str(path), "--url", f"http://127.0.0.1:{unused_tcp_port}"])
    assert code == 1
    assert "cannot reach the sidecar" in capsys.readouterr().err


def test_serve_refuses_a_bad_policy(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nagent_id: a\ntargets: {x: {base_url: ftp://h, endpoints: []}}\n")
    assert main(["serve", "--policy", str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:3: targets.x.base_url" in err


def test_serve_and_validate_name_a_vault_login_the_environment_cannot_make(
    tmp_path, capsys, monkeypatch
):
    """A policy whose Vault login needs VAULT_TOKEN, without it: serve says so in one line
    and exits 1 (no traceback from the sidecar's startup); validate warns."""
    monkeypatch.delenv("VAULT_TOKEN", raising=False)
    path = tmp_path / "vault.yaml"
    path.write_text(
        "version: 1\nagent_id: a\n"
        "secrets: {vault: {address: 'http://127.0.0.1:1', auth: {method: token}}}\n"
        "targets: {x: {base_url: 'https://h.example',"
        " endpoints: [{path: /v1/a, methods: [GET]}]}}\n"
    )
    assert main(["serve", "--policy", str(path), "--port", "0", "--ops-port", "0"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == (
        f"{path}: secrets.vault.auth: method 'token' needs VAULT_TOKEN in the sidecar's "
        "environment or auth.token_file"
    )
    assert main(["validate", str(path)]) == 0
    assert f"{path}: warning: secrets.vault.auth: method 'token' needs VAULT_TOKEN" in (
        capsys.readouterr().err
    )
    monkeypatch.setenv("VAULT_TOKEN", "root-token-for-the-check")
    assert main(["validate", str(path)]) == 0
    assert "VAULT_TOKEN" not in capsys.readouterr().err


def test_demo_falls_back_to_env_refs_without_openbao():
    from gateway.demo.vault import without_vault
    from gateway.policy import load_policy

    policy = without_vault(
        load_policy(ROOT / "policies" / "demo.yaml"), {"openai": "env://DEMO_OPENAI_KEY"}
    )
    assert policy.policy.secrets.vault is None
    credential = policy.policy.targets["openai"].credential
    assert credential is not None
    assert credential.default_ref == "env://DEMO_OPENAI_KEY"
    assert policy.targets["openai"].permitted_refs == {"env://DEMO_OPENAI_KEY"}
