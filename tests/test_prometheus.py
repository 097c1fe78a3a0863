"""The alert rules and the dashboard against the real Prometheus (Debian package
``prometheus``: ``promtool`` and the server).

* ``promtool check rules`` and ``promtool test rules`` (tests/prometheus/alerts.test.yaml),
  and every alert of the rules file has a unit test in which it fires;
* a real Prometheus (our own, on a loopback port, with a temporary config and storage)
  scrapes a real sidecar (``python -m gateway serve``) while a short load runs through
  it; then every query of every dashboard panel, and of its variables, returns data.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from tests.conftest import FakeUpstream, envelope, openai_target, policy_yaml
from tests.processes import Process

ROOT = Path(__file__).resolve().parent.parent
ALERTS = ROOT / "helm" / "egress-gateway" / "files" / "alerts.yaml"
ALERT_TESTS = ROOT / "tests" / "prometheus" / "alerts.test.yaml"
DASHBOARD = ROOT / "helm" / "egress-gateway" / "files" / "dashboard.json"
PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
JOB = "egress"
#: What Grafana puts in for the dashboard's variables and intervals in this test.
SUBSTITUTIONS = {"$__rate_interval": "30s", "$job": JOB, "$target": ".*"}

#: CI (.ci/run) installs the Debian package and sets this: the tests fail instead of skip.
REQUIRED = os.environ.get("REQUIRE_PROMETHEUS") == "1"
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None and not REQUIRED, reason="Debian package prometheus"
)


def promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], capture_output=True, text=True, cwd=cwd, check=False, timeout=60
    )


@needs_promtool
def test_promtool_checks_the_rules() -> None:
    done = promtool("check", "rules", str(ALERTS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 17 rules found" in done.stdout


@needs_promtool
def test_promtool_unit_tests_pass_and_cover_every_alert() -> None:
    done = promtool("test", "rules", ALERT_TESTS.name, cwd=ALERT_TESTS.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    alerts = {
        rule["alert"]
        for group in yaml.safe_load(ALERTS.read_text())["groups"]
        for rule in group["rules"]
        if "alert" in rule
    }
    cases = yaml.safe_load(ALERT_TESTS.read_text())["tests"]
    fired = {
        case["alertname"]
        for test in cases
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    quiet = {
        case["alertname"]
        for test in cases
        for case in test.get("alert_rule_test", [])
        if not case.get("exp_alerts")
    }
    assert fired == alerts  # each alert fires in a test...
    assert quiet == alerts  # ...and stays quiet in a near miss


@needs_promtool
def test_a_broken_expectation_fails_promtool(tmp_path: Path) -> None:
    # The unit tests can fail: a wrong expected label is reported.
    broken = ALERT_TESTS.read_text().replace("target: openai}", "target: anthropic}", 1)
    (tmp_path / "t.yaml").write_text(broken.replace("../../helm", str(ROOT / "helm")))
    done = promtool("test", "rules", "t.yaml", cwd=tmp_path)
    assert done.returncode != 0
    assert "EgressGatewayBreakerOpen" in done.stdout + done.stderr


# --- a real Prometheus scraping a real sidecar ---------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Prometheus:
    """Our own Prometheus server on a loopback port (not the Debian service)."""

    def __init__(self, directory: Path, scrape: str) -> None:
        self.port = _free_port()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [
                {"job_name": JOB, "static_configs": [{"targets": [scrape]}]},
            ],
        }
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
        assert PROMETHEUS is not None
        self.proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={directory / 'prometheus.yml'}",
                f"--storage.tsdb.path={directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.url = f"http://127.0.0.1:{self.port}"

    async def query(self, session: aiohttp.ClientSession, expr: str) -> list[dict[str, Any]]:
        async with session.get(self.url + "/api/v1/query", params={"query": expr}) as resp:
            body = await resp.json()
        assert body["status"] == "success", (expr, body)
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def _upstream_app(upstream_factory: Callable[..., Awaitable[FakeUpstream]]) -> FakeUpstream:
    async def handler(request: web.Request) -> web.StreamResponse:
        if request.path.startswith("/fail"):
            return web.json_response({"error": {"message": "down"}}, status=503)
        body = await request.json()  # FakeUpstream read it already: this is the cached body
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for chunk in (
                {"model": "fake-model-1-0613", "choices": [{"delta": {"content": "hi"}}]},
                {"model": "fake-model-1-0613", "choices": [{"delta": {}, "finish_reason": "stop"}]},
                {"model": "fake-model-1-0613", "choices": [],
                 "usage": {"prompt_tokens": 5, "completion_tokens": 1}},
            ):  # fmt: skip
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return web.json_response(
            {
                "model": "fake-model-1-0613",
                "usage": {"prompt_tokens": 20, "completion_tokens": 3, "total_tokens": 23},
            }
        )

    return await upstream_factory(handler)


def _policy(upstream: str) -> str:
    flaky = openai_target(upstream, circuit_breaker={"fail_max": 2, "reset_timeout_s": 60})
    flaky["endpoints"] = [{"path": "/fail/*", "methods": ["POST"]}]
    flaky["retry"] = {"max_retries": 1, "backoff_base_s": 0.01, "backoff_max_s": 0.02}
    return policy_yaml(
        {
            "llm": openai_target(upstream, rate_limit_group="llm"),
            "flaky": flaky,
            "tight": openai_target(upstream, rate_limit_group="tight"),
        },
        rate_limit_groups={
            "llm": {"requests_per_second": 200, "burst": 2, "max_queue_s": 5},
            "tight": {"requests_per_second": 0.001, "burst": 1, "max_queue_s": 0},
        },
        telemetry={"models": ["fake-model-1", "fake-model-1-*"]},
        # Cost, a budget's spend against its limit and shadow denials get data: a
        # shadow budget far below what the load costs (it never refuses).
        prices={"fake-model-1": {"input_usd_per_mtok": 1.0, "output_usd_per_mtok": 2.0}},
        budgets={
            "llm-daily": {"limit_usd": 0.0001, "window": "daily", "mode": "shadow",
                          "applies_to": {"target": "llm"}, "max_output_tokens": 16},
        },
    )  # fmt: skip


@pytest.fixture
async def scraped(
    tmp_path: Path, upstream_factory: Callable[..., Awaitable[FakeUpstream]]
) -> AsyncIterator[tuple[Prometheus, aiohttp.ClientSession, Process]]:
    if PROMETHEUS is None and not REQUIRED:
        pytest.skip("prometheus (Debian package prometheus) is not installed")
    upstream = await _upstream_app(upstream_factory)
    policy = tmp_path / "policy.yaml"
    policy.write_text(_policy(upstream.url))
    sidecar = await Process.start(policy, env={"TEST_OPENAI_KEY": "sk-fake-TEST-0001-NOTREAL"})
    assert sidecar.calls_url, sidecar.raw
    prometheus = Prometheus(tmp_path, sidecar.ops_url.removeprefix("http://"))
    session = aiohttp.ClientSession()
    try:
        yield prometheus, session, sidecar
    finally:
        await session.close()
        prometheus.stop()
        await sidecar.stop()


async def _load(session: aiohttp.ClientSession, calls_url: str) -> int:
    """A short mixed load: model calls (whole and streamed), retries and an open
    breaker, rate-limit waits and rejections, denied calls. Returns the calls made."""
    made = 0

    async def call(env: dict[str, Any], stream: bool = False) -> None:
        nonlocal made
        headers = {"Accept": "text/event-stream"} if stream else {}
        async with session.post(calls_url + "/v1/calls", json=env, headers=headers) as resp:
            await resp.read()
        made += 1

    for i in range(3):
        await call(envelope(target_system="flaky", endpoint=f"/fail/{i}", correlation_id=f"f{i}"))
    await call(envelope(target_system="tight"))
    await call(envelope(target_system="tight"))  # the group cannot admit it: rejected
    await call(envelope(target_system="nowhere"))  # PERMISSION_DENIED
    deadline = time.monotonic() + 3
    i = 0
    while time.monotonic() < deadline:
        i += 1
        batch = [call(envelope(target_system="llm", correlation_id=f"l{i}-{j}")) for j in range(4)]
        params = {"model": "fake-model-1", "stream": True, "messages": []}
        batch.append(call(envelope(target_system="llm", parameters=params), stream=True))
        await asyncio.gather(*batch)
    return made


async def test_every_dashboard_query_returns_data_from_a_real_scrape(
    scraped: tuple[Prometheus, aiohttp.ClientSession, Process],
) -> None:
    prometheus, session, sidecar = scraped

    async def up() -> bool:
        try:
            result = await prometheus.query(session, f'up{{job="{JOB}"}} == 1')
        except aiohttp.ClientError:
            return False
        return bool(result)

    await _poll(up, 20)
    made = await _load(session, sidecar.calls_url)

    async def all_scraped() -> bool:
        result = await prometheus.query(session, f'sum(egress_gateway_calls_total{{job="{JOB}"}})')
        return bool(result) and float(result[0]["value"][1]) == made

    await _poll(all_scraped, 15)

    async def scrapes() -> int:
        result = await prometheus.query(session, f'count_over_time(up{{job="{JOB}"}}[10m])')
        return int(float(result[0]["value"][1])) if result else 0

    # One more scrape after the one that saw every call, so every rate() window has two
    # points with the calls in them.
    seen = await scrapes()

    async def scraped_again() -> bool:
        return await scrapes() > seen

    await _poll(scraped_again, 15)

    dashboard = json.loads(DASHBOARD.read_text())
    empty: list[str] = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = _substitute(target["expr"])
            result = await prometheus.query(session, expr)
            values = [float(r["value"][1]) for r in result]
            if not [v for v in values if not math.isnan(v)]:
                empty.append(f"{panel['title']}: {expr}")
    assert empty == []
    # The variables' label_values() queries list something too.
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        metric, label = (
            var["definition"].removeprefix("label_values(").removesuffix(")").rsplit(", ", 1)
        )
        result = await prometheus.query(session, f"count by ({label}) ({_substitute(metric)})")
        assert result, var["name"]
    # The model labels are the policy's names; the breaker opened.
    tokens = await prometheus.query(
        session, "sum by (gen_ai_response_model) (gen_ai_client_token_usage_count)"
    )
    assert {r["metric"]["gen_ai_response_model"] for r in tokens} == {"fake-model-1-0613"}
    opened = await prometheus.query(session, 'egress_gateway_breaker_state{target="flaky"}')
    assert opened[0]["value"][1] == "2"


def _substitute(expr: str) -> str:
    for name, value in SUBSTITUTIONS.items():
        expr = expr.replace(name, value)
    return expr


async def _poll(check: Callable[[], Awaitable[bool]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.1)
