"""Local budget spend kept across a restart: the journal on the pod's volume
(``GATEWAY_BUDGET_JOURNAL``) replays what was booked, a torn last line is skipped,
compaction is atomic, and a real sidecar killed with SIGKILL comes back with its spend
(the upstream counts what went out)."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from typing import Any

import aiohttp
import helm_python as helm
from aiohttp import web

from gateway.budgets import NANO_USD, Budgets
from gateway.budgets.journal import COMPACT_AFTER_LINES, BudgetJournal
from gateway.cli import main
from gateway.policy.budgets import BudgetSpec
from tests.conftest import envelope, openai_target, policy_yaml
from tests.helm_helpers import CHART, container, env_of, pod_spec, render, sidecar
from tests.processes import Process

PRICES = {"fake-model-1": {"input_usd_per_mtok": 100_000, "output_usd_per_mtok": 100_000}}
MESSAGES = [{"role": "user", "content": "ping"}]
RESERVED_USD = (len(json.dumps(MESSAGES, separators=(",", ":"))) + 10) * 0.1  # 4.4 USD
NOW = 1_780_000_000.0


def _budgets(journal: BudgetJournal, limit: float = 10.0) -> Budgets:
    spec = BudgetSpec(limit_usd=limit, window="daily")
    return Budgets({"daily": spec}, journal=journal, clock=lambda: NOW)


async def test_spend_is_replayed_from_the_journal(tmp_path: Path) -> None:
    path = tmp_path / "state" / "budgets.journal"
    first = BudgetJournal(path)
    budgets = _budgets(first)
    applied = budgets.applying("t", None, "a")
    booking = await budgets.reserve(applied, 4.0)
    budgets.settle(booking, 3.5)  # the real cost replaces the reservation
    await budgets.reserve(applied, 2.0)  # in flight when the process dies: kept reserved
    first.close()

    again = _budgets(BudgetJournal(path))
    (budget,) = again.applying("t", None, "a")
    assert again.ledger.spent(budget, NOW) == round(5.5 * NANO_USD)
    refused = None
    try:
        await again.reserve([budget], 5.0)
    except Exception as exc:  # BudgetExceeded
        refused = exc
    assert refused is not None
    assert refused.details["spent_usd"] == 5.5  # type: ignore[attr-defined]


def test_a_torn_last_line_is_skipped_and_the_last_total_wins(tmp_path: Path) -> None:
    path = tmp_path / "budgets.journal"
    path.write_text("daily 20604 100\ndaily 20604 250\nother 20604 7\ndaily 20604 9")
    journal = BudgetJournal(path)
    assert journal.totals == {"daily": {20604: 250}, "other": {20604: 7}}
    journal.close()
    # Opening compacted it: one line per bucket, the torn line gone.
    assert sorted(path.read_text().splitlines()) == ["daily 20604 250", "other 20604 7"]


async def test_compaction_keeps_the_totals(tmp_path: Path) -> None:
    path = tmp_path / "budgets.journal"
    journal = BudgetJournal(path)
    budgets = _budgets(journal, limit=1_000_000.0)
    applied = budgets.applying("t", None, "a")
    for _ in range(COMPACT_AFTER_LINES + 5):
        await budgets.reserve(applied, 1.0)
    journal.close()
    lines = path.read_text().splitlines()
    assert len(lines) < COMPACT_AFTER_LINES  # rewritten once it grew past the bound
    assert not (tmp_path / "budgets.journal.tmp").exists()
    assert BudgetJournal(path).totals["daily"] == {
        next(iter(budgets.ledger._spent["daily"])): (COMPACT_AFTER_LINES + 5) * NANO_USD
    }


async def test_a_removed_budget_leaves_the_journal(tmp_path: Path) -> None:
    path = tmp_path / "budgets.journal"
    journal = BudgetJournal(path)
    budgets = _budgets(journal)
    await budgets.reserve(budgets.applying("t", None, "a"), 1.0)
    budgets.update({})  # hot reload without the budget
    journal.close()
    assert BudgetJournal(path).totals == {}


async def test_a_killed_sidecar_comes_back_with_its_spend(upstream_factory, tmp_path: Path) -> None:
    body = {"model": "fake-model-1", "usage": {"prompt_tokens": 34, "completion_tokens": 10}}

    async def handler(_: web.Request) -> web.StreamResponse:
        return web.json_response(body)

    up = await upstream_factory(handler)
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        policy_yaml(
            {"fake-openai": openai_target(up.url, retry={"max_retries": 0})},
            budgets={"daily": {"limit_usd": 10, "window": "daily"}},
            prices=PRICES,
        )
    )
    env = {"GATEWAY_BUDGET_JOURNAL": str(tmp_path / "budgets.journal"), "TEST_OPENAI_KEY": "k"}
    call = envelope(parameters={"model": "fake-model-1", "max_tokens": 10, "messages": MESSAGES})

    async def post(proc: Process) -> tuple[int, dict[str, Any]]:
        async with (
            aiohttp.ClientSession() as session,
            session.post(proc.calls_url + "/v1/calls", json=call) as resp,
        ):
            return resp.status, await resp.json()

    first = await Process.start(policy, env=env, timeout_s=30)
    try:
        assert first.calls_url, "the sidecar did not start"
        assert [(await post(first))[0] for _ in range(2)] == [200, 200]  # 8.8 of 10 USD
    finally:
        await first.kill()  # SIGKILL: no shutdown, no flush
    assert up.hits == 2
    second = await Process.start(policy, env=env, timeout_s=30)
    try:
        assert second.calls_url, "the sidecar did not start again"
        status, answer = await post(second)
        assert status == 429
        assert answer["error"]["code"] == "BUDGET_EXCEEDED"
        assert answer["error"]["details"]["spent_usd"] == round(2 * RESERVED_USD, 9)
        assert up.hits == 2  # nothing went out after the restart
    finally:
        await second.kill()
    assert os.path.getsize(tmp_path / "budgets.journal") > 0


def test_validate_warns_about_a_local_budget_on_several_replicas(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        policy_yaml(
            {
                "fake-openai": openai_target(
                    "https://api.openai.com", call_chain={"propagate": False}
                )
            },
            budgets={
                "daily": {"limit_usd": 10, "window": "daily"},
                "shared": {"limit_usd": 10, "window": "daily", "scope": "cluster"},
            },
            redis={"url": "redis://127.0.0.1:6379/0"},
        )
    )
    for replicas, expected in ((None, []), (1, []), (3, ["daily"])):
        err = io.StringIO()
        argv = ["validate", str(policy), "--no-env-check"]
        argv += ["--replicas", str(replicas)] if replicas else []
        with contextlib.redirect_stderr(err):
            assert main(argv) == 0  # a warning, not a failure
        # The budgets' warnings (validate also warns about other things, e.g. a provider
        # target that does not say whether the call chain goes to it).
        lines = [line for line in err.getvalue().splitlines() if ": budgets." in line]
        assert [line.split("budgets.")[1].split(".")[0] for line in lines] == expected
        if expected:
            assert "may spend 3 x 10 USD; use scope: cluster" in lines[0]


def test_the_chart_passes_the_replicas_and_keeps_the_journal_on_the_pod() -> None:
    with helm.Chart.load(CHART) as chart:
        spec = pod_spec(render(chart, {"agent": {"replicas": 3}}))
    check = container(spec, "egress-gateway-validate")
    assert check["args"][-2:] == ["--replicas", "3"]
    journal = env_of(sidecar(spec))["GATEWAY_BUDGET_JOURNAL"]
    mounts = {m["mountPath"]: m["name"] for m in sidecar(spec)["volumeMounts"]}
    assert journal.startswith("/tmp/")
    assert mounts["/tmp"] == "egress-gateway-tmp"  # an emptyDir: lives as long as the pod
