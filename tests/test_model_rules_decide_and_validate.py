"""The ``models:`` rules as a pure decision (pins, allow globs, shadow, drift), and what
``validate`` says of them: pin cycles and pins outside ``allow`` are errors naming the
file, line and key; an ``allow`` glob that matches no priced model is a warning."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.call.models import as_sent, drift
from gateway.cli import main
from gateway.envelope import ExternalCallRequest
from gateway.policy.modelrules import ModelsSpec, choose, pinned
from tests.conftest import envelope

POLICY = """\
version: 1
agent_id: a
targets:
  openai:
    base_url: https://api.openai.com
    usage: openai
    endpoints: [{path: "/v1/**", methods: [POST]}]
    models:
      allow: [gpt-4o-2024-08-06, "gpt-4o-mini*", "gtp-4o*"]
      pin:
        gpt-4o: gpt-4o-2024-08-06
        loop-a: loop-b
        loop-b: loop-a
        o1: o1-preview
agents:
  planner:
    uid: 1001
    models:
      allow: [gpt-4o-mini]
      pin: {fast: gpt-4o}
"""


def test_pins_are_followed_to_their_end_and_stop_at_a_cycle() -> None:
    assert pinned({"a": "b", "b": "c"}, "a") == "c"
    assert pinned({"a": "b", "b": "a"}, "a") == "b"
    assert pinned({}, "x") == "x"


def test_the_agents_pins_come_first_and_every_allow_applies() -> None:
    agent = ModelsSpec(allow=["gpt-4o-2024-*"], pin={"fast": "gpt-4o"})
    target = ModelsSpec(allow=["gpt-4o-*"], pin={"gpt-4o": "gpt-4o-2024-08-06"}, on_drift="refuse")
    choice = choose([("agent:p", agent), ("target:t", target)], "fast")
    assert (choice.requested, choice.sent, choice.refuse_drift) == (
        "fast",
        "gpt-4o-2024-08-06",
        True,
    )
    assert choice.denied_by == ()
    refused = choose([("agent:p", agent), ("target:t", target)], "gpt-4o-mini")
    assert refused.denied_by == ("agent:p",)  # the target's glob allows it, the agent's not


def test_a_shadow_rule_only_records() -> None:
    spec = ModelsSpec(allow=["a"], mode="shadow")
    choice = choose([("target:t", spec)], "b")
    assert (choice.denied_by, choice.shadow_by) == ((), ("target:t",))


def test_drift_is_refused_only_under_refuse_and_only_when_the_models_differ() -> None:
    refuse = choose([("target:t", ModelsSpec(on_drift="refuse"))], "m-1")
    assert drift(refuse, "m-1", "t") is None
    assert drift(refuse, None, "t") is None  # an answer that names no model
    error = drift(refuse, "m-2", "t")
    assert error is not None
    assert error.details == {"reason": "model_drift", "sent": "m-1", "answered": "m-2"}
    assert error.retryable is False
    record = choose([("target:t", ModelsSpec())], "m-1")
    assert drift(record, "m-2", "t") is None


def test_validate_names_the_file_line_and_key_of_each_bad_pin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY)
    assert main(["validate", "--no-env-check", str(path)]) == 1
    _, err = capsys.readouterr()
    assert err.splitlines() == [
        f"{path}:12: targets.openai.models.pin.loop-a: pin cycle: loop-a -> loop-b -> loop-a",
        f"{path}:14: targets.openai.models.pin.o1: pins 'o1' to 'o1-preview', which 'allow' "
        "does not allow",
        f"{path}:20: agents.planner.models.pin.fast: pins 'fast' to 'gpt-4o', which 'allow' "
        "does not allow",
    ]


def test_validate_warns_of_a_glob_no_priced_model_matches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = POLICY.replace("        loop-a: loop-b\n        loop-b: loop-a\n", "")
    good = good.replace("        o1: o1-preview\n", "").replace("pin: {fast: gpt-4o}", "pin: {}")
    # Said, so that validate's call-chain warning for a provider target stays out.
    good = good.replace(
        "    usage: openai\n", "    usage: openai\n    call_chain: {propagate: false}\n"
    )
    path = tmp_path / "policy.yaml"
    path.write_text(good)
    assert main(["validate", "--no-env-check", str(path)]) == 0
    _, err = capsys.readouterr()
    assert err.splitlines() == [
        f"{path}: targets.openai.models.allow.2: warning: 'gtp-4o*' matches no model the "
        "price table knows"
    ]


def test_models_on_a_target_without_a_dialect_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY.replace("usage: openai", "usage: none").split("agents:")[0])
    assert main(["validate", "--no-env-check", str(path)]) == 1
    _, err = capsys.readouterr()
    assert f"{path}:8: targets.openai.models: needs 'usage'" in err


def test_drift_is_judged_against_the_model_the_request_sends() -> None:
    choice = choose([("target:t", ModelsSpec(on_drift="refuse"))], "gpt-4o")
    # A fallback that names another model: its answer is judged against that model.
    request = ExternalCallRequest.model_validate(
        envelope(parameters={"model": "claude-x", "messages": []})
    )
    moved = as_sent(choice, "anthropic", request)
    assert (moved.requested, moved.sent, moved.refuse_drift) == ("gpt-4o", "claude-x", True)
    assert drift(moved, "claude-x", "t") is None
    assert as_sent(choice, "none", request) is choice  # no dialect: nothing read
