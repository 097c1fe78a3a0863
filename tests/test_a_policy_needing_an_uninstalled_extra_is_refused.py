"""A policy that uses an optional extra not installed (a database target without
``egress-gateway[database]``, ``a2a.card.verify`` without ``egress-gateway[a2a]``,
``audit.otlp`` without ``egress-gateway[otel]``) is
refused by ``validate`` and ``serve`` with one line naming the extra to install, never
with a traceback or at the first call. Each case runs the CLI in a child interpreter
where the extra's module is absent (``sys.modules[name] = None`` makes its import raise
ImportError, as when the package is not installed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

DATABASE_POLICY = """\
version: 1
agent_id: db-agent
egress: {allow_cidrs: ["127.0.0.0/8"]}
targets:
  shop:
    database:
      engine: postgresql
      dsn: postgresql://127.0.0.1:5432/test
      credential: {user_ref: "env://EGW_TEST_DB_USER", password_ref: "env://EGW_TEST_DB_PW"}
      statements:
        count: {mode: read, sql: SELECT 1}
"""

CARD_POLICY = """\
version: 1
agent_id: a
targets:
  b:
    base_url: https://agent.example.com
    a2a:
      agent_id: b
      card: {verify: true, public_key_ref: "env://CARD_KEY"}
"""

OTLP_POLICY = """\
version: 1
agent_id: a
audit:
  otlp:
    endpoint: http://127.0.0.1:4318/v1/logs
targets:
  b:
    base_url: https://api.example.com
    endpoints: [{path: /v1/items, methods: [GET]}]
"""

DATABASE_REFUSED = (
    "policy.yaml:6: targets.shop.database: a database target needs asyncpg, not installed "
    "(import of asyncpg halted; None in sys.modules): pip install 'egress-gateway[database]'"
)
CARD_REFUSED = (
    "policy.yaml:8: targets.b.a2a.card.verify: a2a.card.verify needs PyJWT with "
    "cryptography, not installed (import of jwt halted; None in sys.modules): "
    "pip install 'egress-gateway[a2a]'"
)

OTLP_REFUSED = (
    "policy.yaml:4: audit.otlp: audit.otlp needs the OpenTelemetry SDK, not installed "
    "(import of opentelemetry.sdk halted; None in sys.modules): "
    "pip install 'egress-gateway[otel]'"
)


def run_cli(tmp_path: Path, absent: list[str], *argv: str) -> subprocess.CompletedProcess[str]:
    """``egress-gateway ARGV`` in a child interpreter without the modules ``absent``."""
    program = (
        "import sys\n"
        f"for name in {absent!r}:\n"
        "    sys.modules[name] = None\n"
        "from gateway.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env |= {"PYTHONPATH": str(ROOT), "GATEWAY_PORT": "0", "GATEWAY_OPS_PORT": "0"}
    return subprocess.run(
        [sys.executable, "-c", program, *argv],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


CASES = [
    pytest.param(DATABASE_POLICY, ["asyncpg"], DATABASE_REFUSED, id="database"),
    pytest.param(CARD_POLICY, ["jwt"], CARD_REFUSED, id="a2a"),
    # opentelemetry-api alone (an agent's own tracing may bring it): not the SDK.
    pytest.param(OTLP_POLICY, ["opentelemetry.sdk"], OTLP_REFUSED, id="otel"),
]


@pytest.mark.parametrize(("policy", "absent", "refused"), CASES)
@pytest.mark.parametrize("command", [["validate"], ["serve", "--policy"]])
def test_validate_and_serve_name_the_extra_to_install(
    tmp_path: Path, policy: str, absent: list[str], refused: str, command: list[str]
) -> None:
    (tmp_path / "policy.yaml").write_text(policy)
    done = run_cli(tmp_path, absent, *command, "policy.yaml")
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines() == [refused]
    assert done.stdout == ""


def test_pyjwt_without_cryptography_is_not_enough_to_verify_a_card(tmp_path: Path) -> None:
    # `pip install PyJWT` alone: jwt imports, but none of ES256, RS256, EdDSA is there.
    (tmp_path / "policy.yaml").write_text(CARD_POLICY)
    done = run_cli(tmp_path, ["cryptography"], "validate", "policy.yaml")
    assert done.returncode == 1, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith(
        "policy.yaml:8: targets.b.a2a.card.verify: a2a.card.verify needs PyJWT with "
        "cryptography, not installed (PyJWT "
    )
    assert line.endswith(" is installed without cryptography): pip install 'egress-gateway[a2a]'")


@pytest.mark.parametrize("policy", [DATABASE_POLICY, CARD_POLICY, OTLP_POLICY])
def test_with_the_extras_installed_the_same_policies_validate(tmp_path: Path, policy: str) -> None:
    (tmp_path / "policy.yaml").write_text(policy)
    done = run_cli(tmp_path, [], "validate", "policy.yaml")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("policy.yaml: ok (1 targets, ")
