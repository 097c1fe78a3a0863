"""A real provider in one step: the shipped policies/openai.yaml, anthropic.yaml and
gemini.yaml need only the key in an environment variable, and ``egress-gateway init``
writes the same starters for the providers named (validated, never over a file unless
--force)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main
from gateway.policy import load_policy
from gateway.policy.starters import PROVIDERS, UnknownProvider, starter_policy

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = {name: ROOT / "policies" / f"{name}.yaml" for name in ("openai", "anthropic", "gemini")}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_each_shipped_provider_policy_loads_and_needs_only_an_env_key(name: str) -> None:
    policy = load_policy(SHIPPED[name])
    assert list(policy.targets) == [name]
    spec = policy.targets[name].spec
    assert spec.credential is not None
    assert spec.credential.default_ref == f"env://{PROVIDERS[name][0]}"
    assert spec.base_url.startswith("https://")
    assert spec.usage == name
    assert policy.policy.secrets.vault is None
    assert not policy.policy.egress.allow_cidrs  # a real provider is a public address
    # A provider is no agent of the fleet: the call chain (agent ids) is not sent to it.
    assert spec.call_chain.propagate is False


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_each_shipped_provider_policy_is_what_init_writes(name: str) -> None:
    assert SHIPPED[name].read_text() == starter_policy([name])


def test_init_writes_a_valid_policy_for_the_named_providers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "policy.yaml"
    assert main(["init", "anthropic", "gemini", "openai", "gemini", "-o", str(out)]) == 0
    policy = load_policy(out)
    assert list(policy.targets) == ["anthropic", "gemini", "openai"]
    assert set(policy.policy.rate_limit_groups) == {"anthropic", "gemini", "openai"}
    assert f"serve --policy {out}" in capsys.readouterr().err


def test_init_refuses_to_overwrite_without_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "policy.yaml"
    out.write_text("mine\n")
    assert main(["init", "openai", "-o", str(out)]) == 1
    assert out.read_text() == "mine\n"
    assert "exists (--force replaces it)" in capsys.readouterr().err
    assert main(["init", "openai", "-o", str(out), "--force"]) == 0
    assert list(load_policy(out).targets) == ["openai"]


def test_init_defaults_to_openai_and_prints_with_dash(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["init", "-o", "-", "--agent-id", "planner-01"]) == 0
    text = capsys.readouterr().out
    assert text == starter_policy(["openai"], agent_id="planner-01")
    assert "agent_id: planner-01\n" in text


def test_init_names_the_known_providers_for_an_unknown_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "policy.yaml"
    assert main(["init", "openai", "mistral", "-o", str(out)]) == 2
    assert not out.exists()
    err = capsys.readouterr().err
    assert "unknown provider: mistral (known: openai, anthropic, gemini)" in err
    with pytest.raises(UnknownProvider):
        starter_policy([])
