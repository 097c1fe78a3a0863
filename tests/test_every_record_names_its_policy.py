"""Every audit record names the policy that decided it (``policy_sha256``, the SHA-256 of
the policy file), and a start and a reload, applied or refused, are records of their own;
the audit tool selects by policy digest. Also: who called, as the sidecar established it,
without ``agents:`` (the policy's agent_id, ``agent_auth: policy``), and a claim of
another id refused."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from gateway.audit.query.cli import main as audit_main
from gateway.policy import load_policy
from tests.conftest import compile_policy, envelope, openai_target, policy_yaml


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _events(sc: Any, name: str) -> list[dict[str, Any]]:
    return [line for line in sc.lines() if line.get("event") == name]


async def test_records_carry_the_digest_of_the_policy_that_decided_them(
    tmp_path: Path, upstream: Any, sidecar_factory: Any, capsys: Any
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(policy_yaml({"fake-openai": openai_target(upstream.url)}))
    first = _digest(path)
    sc = await sidecar_factory(load_policy(path))
    status, _ = await sc.call(envelope(trace_id="tr-before"))
    assert status == 200
    [start] = _events(sc, "policy_start")
    assert (start["policy_sha256"], start["targets"], start["agents"]) == (
        first, ["fake-openai"], [],
    )  # fmt: skip

    spec = openai_target(upstream.url, timeout_s=7)
    path.write_text(policy_yaml({"fake-openai": spec}, agent_id="test-agent"))
    second = _digest(path)
    assert await sc.gateway.reload() is True
    status, _ = await sc.call(envelope(trace_id="tr-after"))
    assert status == 200

    path.write_text(policy_yaml({"fake-openai": spec}, agents={"x": {}}))
    refused_digest = _digest(path)
    assert await sc.gateway.reload() is False
    status, _ = await sc.call(envelope(trace_id="tr-still"))
    assert status == 200

    records = {r["trace_id"]: r for r in sc.audit_records()}
    assert records["tr-before"]["policy_sha256"] == first
    assert records["tr-after"]["policy_sha256"] == second
    assert records["tr-still"]["policy_sha256"] == second  # the refused one never decided
    applied, refused = _events(sc, "policy_reload")
    assert applied["applied"] is True
    assert (applied["policy_sha256"], applied["previous_policy_sha256"]) == (second, first)
    assert applied["changed"] == ["targets"]
    assert applied["changed_targets"] == ["fake-openai"]
    assert refused["applied"] is False
    assert (refused["policy_sha256"], refused["previous_policy_sha256"]) == (refused_digest, second)
    assert refused["problems"] == [
        f"{path}:1: agents.x: set 'uid' or 'token_ref' (how the sidecar recognises this agent)"
    ]

    log = tmp_path / "audit.log"
    log.write_text(sc.log.getvalue())
    assert audit_main(["show", str(log), "--format", "json", "--policy", second[:8] + "*"]) == 0
    shown = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]
    assert [r.get("trace_id") for r in shown if r["event"] == "egress_call"] == [
        "tr-after", "tr-still",
    ]  # fmt: skip


async def test_without_agents_the_caller_is_the_policys_agent(
    upstream: Any, sidecar_factory: Any
) -> None:
    sc = await sidecar_factory(compile_policy({"fake-openai": openai_target(upstream.url)}))
    assert (await sc.call(envelope(trace_id="tr-plain")))[0] == 200
    assert (await sc.call(envelope(trace_id="tr-same", agent_id="test-agent")))[0] == 200
    status, body = await sc.call(envelope(trace_id="tr-other", agent_id="other-agent"))
    assert status == 403
    assert body["error"]["code"] == "PERMISSION_DENIED"
    assert body["error"]["details"] == {
        "reason": "agent_mismatch",
        "claimed": "other-agent",
        "agent_id": "test-agent",
        "agent_auth": "policy",
    }
    async with sc.session.post(
        sc.url + "/v1/calls",
        json=envelope(trace_id="tr-header"),
        headers={"x-egress-agent": "other-agent"},
    ) as resp:
        assert resp.status == 403
        assert (await resp.json())["error"]["details"]["reason"] == "agent_mismatch"
    records = {r["trace_id"]: r for r in sc.audit_records()}
    seen = {
        t: (r["agent_id"], r["agent_auth"], r["agent_claimed"], r["error_code"])
        for t, r in records.items()
    }
    assert seen == {
        "tr-plain": ("test-agent", "policy", None, None),
        "tr-same": ("test-agent", "policy", None, None),
        "tr-other": ("test-agent", "policy", "other-agent", "PERMISSION_DENIED"),
        "tr-header": ("test-agent", "policy", "other-agent", "PERMISSION_DENIED"),
    }
    assert len(upstream.seen) == 2  # the refused calls never left
