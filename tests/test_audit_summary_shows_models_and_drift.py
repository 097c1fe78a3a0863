"""``egress-gateway audit summary`` counts calls and spend per model (the model sent,
else the one priced) and the answers that named another model (drift)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.auditlog_helpers import calls_of, read_json, write_log
from tests.test_audit_cli import run


@pytest.fixture(scope="module")
def log_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("audit-models") / "audit.log"
    write_log(path)
    return path


def _model(call: dict[str, Any]) -> str | None:
    return call.get("model_sent") or call.get("cost_model")


def test_the_json_summary_has_calls_spend_and_drift_per_model(log_path: Path) -> None:
    calls = calls_of(read_json(log_path))
    code, out, _ = run("summary", str(log_path), "--format", "json")
    assert code == 0
    models = json.loads(out)["models"]
    named = [c for c in calls if _model(c) is not None]
    assert named, "the generated log has calls that name a model"
    assert set(models) == {_model(c) for c in named}
    for name, figures in models.items():
        mine = [c for c in named if _model(c) == name]
        drifted = [c for c in mine if c["model_drift"] is not None]
        assert figures["calls"] == len(mine)
        assert figures["cost_usd"] == pytest.approx(sum(c["cost_usd"] or 0 for c in mine))
        assert figures["drifted"] == len(drifted)
        answered = {c["model_drift"]["answered"] for c in drifted}
        assert set(figures["drift"]) == answered
    assert models["gpt-4o-mini-2024-07-18"]["drifted"] > 0


def test_the_table_summary_has_a_models_table(log_path: Path) -> None:
    code, out, _ = run("summary", str(log_path))
    assert code == 0
    assert "Calls by model" in out
    row = next(line for line in out.splitlines() if "gpt-4o-mini-2024-07-18" in line)
    assert "gpt-4o-mini-2024-09-01" in row  # the model answered instead
