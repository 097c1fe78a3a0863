"""``validate`` refuses fallbacks that cannot work (an unknown target, another dialect,
a cycle, the target itself with its own model), each at its file:line:key, and warns of
a ``first_byte_timeout_s`` that can never act."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main

HEAD = """\
version: 1
agent_id: a
targets:
"""


#: Said, so that validate's warning about a provider target's call chain stays out of
#: the tests that expect no other output.
NO_CHAIN = "    call_chain: {propagate: false}\n"


def _target(name: str, usage: str, fallbacks: str = "", extra: str = "") -> str:
    return f"""\
  {name}:
    base_url: https://{name}.example.com
    endpoints: [{{path: /v1/chat/completions, methods: [POST]}}]
    usage: {usage}
{extra}{fallbacks}"""


def _validate(tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    code = main(["validate", "--no-env-check", str(path)])
    return code, capsys.readouterr().err.replace(str(path), "P")


def test_an_unknown_target_another_dialect_and_a_cycle_are_errors_at_their_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = (
        HEAD
        + _target(
            "a", "openai", "    fallbacks:\n      - {target: b, model: m}\n      - {target: nope}\n"
        )
        + _target("b", "openai", "    fallbacks:\n      - {target: a}\n")
        + _target("c", "anthropic", "    fallbacks:\n      - {target: a, model: m}\n")
        + _target("d", "openai", "    fallbacks:\n      - {target: d}\n")
    )
    code, err = _validate(tmp_path, text, capsys)
    assert code == 1
    lines = err.splitlines()
    assert any(
        line.startswith("P:10: targets.a.fallbacks.1.target:") and "no target 'nope'" in line
        for line in lines
    ), err
    assert any("targets.a.fallbacks:" in ln and "cycle: a -> b -> a" in ln for ln in lines), err
    assert any(
        line.startswith("P:22: targets.c.fallbacks.0.target:") and "'openai' dialect" in line
        for line in lines
    ), err
    assert any("targets.d.fallbacks.0.target:" in ln and "itself" in ln for ln in lines), err


def test_mcp_targets_neither_have_nor_are_fallbacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = (
        HEAD
        + _target("a", "none", "    fallbacks:\n      - {target: tools}\n")
        + "  tools:\n    base_url: https://tools.example.com/mcp\n"
        + "    mcp: {tools: {allow: ['*']}}\n"
    )
    code, err = _validate(tmp_path, text, capsys)
    assert code == 1, err
    assert "targets.a.fallbacks.0.target: an MCP target neither has nor is a fallback" in err


def test_the_same_target_with_another_model_is_allowed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = HEAD + _target(
        "a", "openai", "    fallbacks:\n      - {target: a, model: small}\n", NO_CHAIN
    )
    code, err = _validate(tmp_path, text, capsys)
    assert (code, err) == (0, "")


def test_a_first_byte_timeout_above_the_timeout_is_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = HEAD + _target(
        "a", "openai", extra="    timeout_s: 10\n    first_byte_timeout_s: 20\n" + NO_CHAIN
    )
    code, err = _validate(tmp_path, text, capsys)
    assert code == 0
    assert err == (
        "P: targets.a.first_byte_timeout_s: warning: 20 s is not below timeout_s (10 s): "
        "it never acts\n"
    )


def test_a_fallback_model_outside_an_allow_rule_is_an_error_at_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = (
        HEAD
        + _target(
            "a",
            "openai",
            "    fallbacks:\n      - {target: b, model: gpt-4o-mini}\n"
            "      - {target: b, model: gpt-4o}\n",
        )
        + _target("b", "openai", extra="    models: {allow: ['gpt-4o', 'gpt-4o-2024-*']}\n")
        + _target("c", "openai", "    fallbacks:\n      - {target: c, model: big}\n")
        + "agents:\n"
        + "  planner:\n    uid: 1001\n    targets: [c]\n    models: {allow: [small*]}\n"
        + "  other:\n    uid: 1002\n    targets: [a]\n    models: {allow: ['*']}\n"
    )
    code, err = _validate(tmp_path, text, capsys)
    assert code == 1, err
    lines = err.splitlines()
    # The fallback target's own rule: its line, its key, the rule named.
    assert any(
        line.startswith("P:9: targets.a.fallbacks.0.model:")
        and "'gpt-4o-mini' is not in the 'allow' of targets.b.models" in line
        for line in lines
    ), err
    # The agent that may call c: its rule applies to the fallback's model too.
    assert any(
        line.startswith("P:21: targets.c.fallbacks.0.model:")
        and "'big' is not in the 'allow' of agents.planner.models" in line
        for line in lines
    ), err
    assert "targets.a.fallbacks.1" not in err  # gpt-4o is allowed by b and by every agent
    assert len([ln for ln in lines if "is not in the 'allow'" in ln]) == 2, err


def test_a_fallback_that_holds_calls_for_approval_behind_a_target_that_does_not_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    held = "    approval: {endpoints: [{path: /v1/chat/completions, methods: [POST]}]}\n" + NO_CHAIN
    operators = "operators:\n  alice: {token_ref: env://ALICE_TOKEN}\ntargets:\n"
    text = (
        HEAD.replace("targets:\n", operators)
        + _target("a", "openai", "    fallbacks:\n      - {target: b}\n", NO_CHAIN)
        + _target("b", "openai", "", held)
        + _target("c", "openai", "    fallbacks:\n      - {target: b}\n", held)
    )
    code, err = _validate(tmp_path, text, capsys)
    assert code == 1, err
    lines = err.splitlines()
    assert len(lines) == 1, err  # c asks for approval itself: its fallback to b is fine
    assert "targets.a.fallbacks.0.target:" in lines[0], err
    assert "unapproved" in lines[0], err
