"""docs/reference/policy.md is generated from the policy models (docs/gen_policy_reference.py):
the page in the repository is what the generator writes today, every key has its words,
and a key added to a model shows up in the page."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "docs" / "gen_policy_reference.py"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_policy_reference", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_policy_reference_page_is_current() -> None:
    gen = _generator()
    assert gen.PAGE.read_text(encoding="utf-8") == gen.render(), "run: make docs"


def test_the_check_mode_fails_on_a_stale_page(tmp_path: Path) -> None:
    gen = _generator()
    ok = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    gen.PAGE = tmp_path / "policy.md"
    gen.PAGE.write_text("# stale\n")
    assert gen.main(["--check"]) == 1
    assert gen.main([]) == 0
    assert gen.main(["--check"]) == 0


def test_every_key_has_a_description() -> None:
    assert _generator().missing_descriptions() == []


def test_every_key_of_the_models_is_in_the_page_with_default_and_bounds() -> None:
    from gateway.policy.models import ServerSpec, TargetSpec
    from gateway.policy.root import Policy

    page = _generator().render()
    for name in Policy.model_fields:
        assert f"| `{name}` |" in page
    for name in TargetSpec.model_fields:
        assert f"| `targets.NAME.{name}` |" in page
    assert set(ServerSpec.model_fields) >= {"port", "drain_s"}
    row = next(line for line in page.splitlines() if line.startswith("| `server.port` |"))
    assert "`8181`" in row
    assert ">= 0, <= 65,535" in row
    row = next(line for line in page.splitlines() if line.startswith("| `targets.NAME.timeout_s`"))
    assert "> 0, <= 3600.0" in row
    assert "(demo.yaml)" in row  # an example from a shipped policy
