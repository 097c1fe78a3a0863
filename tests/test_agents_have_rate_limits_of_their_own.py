"""Each agent its own pace, and its own series: real client processes under their own
UIDs (``setpriv --reuid``) call a real sidecar process over loopback TCP and its Unix
socket. An agent that used up its ``agents.NAME.rate_limit_group`` is refused
(CAPACITY_EXCEEDED, a Retry-After, audited with the group) while the other agent,
sharing the target and its group, still gets through; ``agent_calls_total`` counts the
agent the sidecar established, never the id a call claims."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from tests.agent_processes import (
    COMPLETION,
    NEEDS_ROOT,
    calls_by_trace,
    envelope_request,
    run_as,
    shared_dir,
)
from tests.conftest import openai_target, policy_yaml, wait_for
from tests.processes import Process

pytestmark = NEEDS_ROOT

PLANNER, CODER, STRANGER = 64111, 64112, 64113
#: Refilled at one call per 1000 s: a test never sees a refill, whatever the machine.
SLOW = {"requests_per_second": 0.001, "max_queue_s": 0}
GROUPS = {
    "shared": {"requests_per_second": 100, "burst": 100},
    "planner-pace": {**SLOW, "burst": 2},
    "coder-pace": {**SLOW, "burst": 10},
}


@pytest.fixture
async def sidecar(upstream_factory: Any, tmp_path: Path) -> AsyncIterator[tuple[Process, Any, str]]:
    async def completion(_: web.Request) -> web.StreamResponse:
        return web.json_response(COMPLETION)

    up = await upstream_factory(completion)
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        policy_yaml(
            {"fake-openai": openai_target(up.url, rate_limit_group="shared")},
            rate_limit_groups=GROUPS,
            agents={
                "planner": {"uid": PLANNER, "rate_limit_group": "planner-pace"},
                "coder": {"uid": CODER, "rate_limit_group": "coder-pace"},
            },
            # Stopped at the end with nothing in flight: no quiet period (default 1 s)
            # to wait out; the drain itself is tests/test_shutdown.py's.
            server={"shutdown": {"quiet_s": 0}},
        )
    )
    with shared_dir() as socket_dir:
        sock = str(socket_dir / "egress.sock")
        process = await Process.start(policy, env={"GATEWAY_UNIX_SOCKET": sock}, timeout_s=30)
        assert process.calls_url, process.raw[-5:]
        try:
            yield process, up, sock
        finally:
            await process.stop()


def _openai(sock: str) -> dict[str, Any]:
    return {"kind": "openai", "via": "unix", "socket": sock, "target": "fake-openai"}


async def _metrics(process: Process) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(process.ops_url + "/metrics")).text
    assert "ghost-agent" not in text  # a claimed id is never a label value
    found: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return found


async def test_an_agent_past_its_group_is_refused_while_the_other_gets_through(
    sidecar: Any,
) -> None:
    process, up, sock = sidecar
    planner = await run_as(
        PLANNER,
        [envelope_request(process, sock, via, f"tr-planner-{i}")
         for i, via in enumerate(("tcp", "unix", "tcp"))]
        + [_openai(sock)],
    )  # fmt: skip
    assert [r.get("status") for r in planner[:3]] == [200, 200, 429], planner
    refused = planner[2]["body"]["error"]
    assert refused["code"] == "CAPACITY_EXCEEDED"
    assert refused["retryable"] is True
    assert (refused["details"]["group"], refused["details"]["reason"]) == (
        "planner-pace", "queue_timeout",
    )  # fmt: skip
    assert refused["suggested_retry_after"] > 500  # the next call is a refill away
    sdk = planner[3]  # the drop-in route: the SDKs' own Retry-After
    assert sdk["error_status"] == 429
    assert int(sdk["retry_after"]) > 500
    # The coder shares the target and its group: the planner's pace is not its own.
    coder = await run_as(
        CODER,
        [envelope_request(process, sock, via, f"tr-coder-{i}")
         for i, via in enumerate(("tcp", "unix", "tcp"))]
        + [_openai(sock)],
    )  # fmt: skip
    assert [r.get("status") for r in coder[:3]] == [200, 200, 200], coder
    assert coder[3] == {"content": "pong"}
    assert len(up.seen) == 2 + 4

    await wait_for(lambda: len(process.events("egress_call")) >= 8, 10)
    records = process.events("egress_call")
    seen = [
        (r["agent_id"], r["api"], r["rate_limit_group"], r["agent_rate_limit_group"],
         r["rate_limit_refused"], r["error_code"])
        for r in records
    ]  # fmt: skip
    ok, limited = (None, None), ("planner-pace", "CAPACITY_EXCEEDED")
    assert seen == [
        ("planner", "envelope", "shared", "planner-pace", *ok),
        ("planner", "envelope", "shared", "planner-pace", *ok),
        ("planner", "envelope", "shared", "planner-pace", *limited),
        ("planner", "proxy", "shared", "planner-pace", *limited),
        *[("coder", api, "shared", "coder-pace", *ok) for api in ["envelope"] * 3 + ["proxy"]],
    ]
    assert calls_by_trace(process)["tr-planner-2"]["attempts"] == 0  # nothing went out
    metrics = await _metrics(process)
    rejections = metrics["egress_gateway_ratelimit_rejections_total"]
    assert rejections[(("group", "planner-pace"),)] == 2
    assert rejections[(("group", "coder-pace"),)] == 0
    assert rejections[(("group", "shared"),)] == 0


async def test_calls_are_counted_by_the_agent_the_sidecar_established(sidecar: Any) -> None:
    process, _, sock = sidecar
    [own, claims_coder, claims_ghost] = await run_as(
        PLANNER,
        [
            envelope_request(process, sock, "tcp", "tr-planner-own"),
            envelope_request(process, sock, "unix", "tr-planner-as-coder", agent_id="coder"),
            envelope_request(
                process,
                sock,
                "tcp",
                "tr-planner-as-ghost",
                headers={"x-egress-agent": "ghost-agent"},
            ),
        ],
    )
    [coder] = await run_as(CODER, [envelope_request(process, sock, "unix", "tr-coder-own")])
    [stranger] = await run_as(
        STRANGER, [envelope_request(process, sock, "tcp", "tr-stranger", agent_id="ghost-agent")]
    )
    assert [r["status"] for r in (own, claims_coder, claims_ghost, coder, stranger)] == [
        200, 403, 403, 200, 403,
    ]  # fmt: skip
    await wait_for(lambda: len(process.events("egress_call")) >= 5, 10)
    records = calls_by_trace(process)
    assert {t: r["agent_id"] for t, r in records.items()} == {
        "tr-planner-own": "planner",
        "tr-planner-as-coder": "planner",
        "tr-planner-as-ghost": "planner",
        "tr-coder-own": "coder",
        "tr-stranger": "_unknown",
    }
    counted = (await _metrics(process))["egress_gateway_agent_calls_total"]
    by_record = Counter((r["agent_id"], r["decision"]) for r in records.values())
    assert {
        (dict(labels)["agent"], dict(labels)["decision"]): value
        for labels, value in counted.items()
    } == by_record
    assert {agent for agent, _ in by_record} == {"planner", "coder", "_unknown"}
    assert by_record[("coder", "allowed")] == 1  # the planner's claim of coder is the planner's
