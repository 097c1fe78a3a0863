"""``validate`` refuses an agent's ``rate_limit_group`` that names no group of the
policy, at its file:line:key, and accepts one that does."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main

POLICY = """\
version: 1
agent_id: a
rate_limit_groups:
  planner-pace: {requests_per_second: 1, burst: 5}
targets:
  llm:
    base_url: https://llm.example.com
    endpoints: [{path: /v1/chat/completions, methods: [POST]}]
agents:
  planner: {uid: 1001, rate_limit_group: planner-pace}
  coder:
    uid: 1002
    rate_limit_group: {group}
"""


def _validate(tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    code = main(["validate", "--no-env-check", str(path)])
    return code, capsys.readouterr().err.replace(str(path), "P")


def test_an_unknown_group_is_an_error_at_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _validate(tmp_path, POLICY.replace("{group}", "coder-pace"), capsys)
    assert code == 1
    assert (
        "P:13: agents.coder.rate_limit_group: no rate-limit group 'coder-pace' "
        "(known: planner-pace)"
    ) in err, err
    assert "agents.planner" not in err


def test_a_known_group_validates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _validate(tmp_path, POLICY.replace("{group}", "planner-pace"), capsys)
    assert code == 0, err
