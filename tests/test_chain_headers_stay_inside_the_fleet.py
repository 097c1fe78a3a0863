"""``targets.NAME.call_chain.propagate``: a target with it off (a provider outside the
fleet) gets no call chain header on any API (envelope, drop-in, MCP), not even one the
agent set itself, while the chain is still decided (a loop or a stale chain is refused
before any I/O) and audited; a target with it on gets the chain as before. Recorded on
real loopback upstreams."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from aiohttp import web

from gateway.agents.chain import CHAIN_HEADER, DEADLINE_HEADER, SIGNATURE_HEADER
from gateway.cli import main
from gateway.providers import mcp as rpc
from tests.conftest import FakeUpstream, Sidecar, compile_policy, envelope, openai_target
from tests.test_call_chains_are_enforced import CALL, ME, Factory, mcp_ok, mcp_target, refusals

OFF = {"call_chain": {"propagate": False}}
#: The agent's own chain headers, in the case an SDK might write them.
AGENT_SET = {"X-Egress-Call-Chain": "planner", "X-Egress-Deadline": "9999999999999"}


def now_ms() -> int:
    return int(time.time() * 1000)


def egress_headers(headers: dict[str, str]) -> dict[str, str]:
    """The ``x-egress-*`` headers an upstream received (the sidecar sends no other)."""
    return {k.lower(): v for k, v in headers.items() if k.lower().startswith("x-egress-")}


async def test_no_chain_header_reaches_a_target_with_propagation_off_on_any_api(
    upstream_factory: Factory, sidecar_factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHAIN_KEY", "fleet-chain-key-2026")  # signed: no signature leaks either
    upstream: FakeUpstream = await upstream_factory()
    mcp_upstream: FakeUpstream = await upstream_factory(mcp_ok)
    # forward_headers lets the agent set the chain headers itself: still none goes out.
    provider = openai_target(upstream.url, forward_headers=list(AGENT_SET), **OFF)
    policy = compile_policy(
        {"fake-openai": provider, "mcp": {**mcp_target(mcp_upstream.url), **OFF}},
        chain={"signing_key_ref": "env://CHAIN_KEY"},
    )
    sc: Sidecar = await sidecar_factory(policy)
    deadline = now_ms() + 60_000

    status, answer = await sc.call(envelope())  # a chain that starts here
    assert (status, answer["success"]) == (200, True), answer
    chain = {"agents": ["planner"], "deadline_ms": deadline}
    status, answer = await sc.call(envelope(call_chain=chain, headers=AGENT_SET))
    assert (status, answer["success"]) == (200, True), answer

    passed = {CHAIN_HEADER: "planner", DEADLINE_HEADER: str(deadline)}
    url = sc.url + "/proxy/fake-openai/v1/chat/completions"
    async with sc.session.post(url, json={"model": "m"}, headers=passed) as resp:
        assert resp.status == 200, await resp.text()
    async with sc.session.post(
        sc.url + "/mcp/mcp", json=CALL, headers={"Accept": rpc.ACCEPT, **passed}
    ) as resp:
        assert resp.status == 200
        assert "result" in await resp.json()

    assert upstream.hits == 3
    assert mcp_upstream.hits == 1
    for seen in [*upstream.seen, *mcp_upstream.seen]:
        assert egress_headers(seen.headers) == {}, seen.path
    # The chain was decided all the same: each record carries the chain it would send.
    records = sc.audit_records()
    assert [(r["api"], r["call_chain"], r["call_chain_depth"]) for r in records] == [
        ("envelope", [ME], 1),
        ("envelope", ["planner", ME], 2),
        ("proxy", ["planner", ME], 2),
        ("mcp", ["planner", ME], 2),
    ]


REFUSED = [
    ("circular", {CHAIN_HEADER: f"planner,{ME}"}, "circular_call_detected"),
    ("stale", {CHAIN_HEADER: "planner", DEADLINE_HEADER: "1"}, "ttl_expired"),
]


@pytest.mark.parametrize(
    ("headers", "reason"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED]
)
async def test_a_refused_chain_is_refused_with_propagation_off(
    upstream_factory: Factory, sidecar_factory: Factory, headers: dict[str, str], reason: str
) -> None:
    upstream: FakeUpstream = await upstream_factory(mcp_ok)
    policy = compile_policy(
        {
            "fake-openai": openai_target(upstream.url, **OFF),
            "mcp": {**mcp_target(upstream.url), **OFF},
        }
    )
    sc: Sidecar = await sidecar_factory(policy)
    agents = headers[CHAIN_HEADER].split(",")
    deadline = int(headers.get(DEADLINE_HEADER, now_ms() + 60_000))

    status, answer = await sc.call(envelope(call_chain={"agents": agents, "deadline_ms": deadline}))
    assert status == 409
    assert answer["error"]["code"] == "CALL_CHAIN_REFUSED"
    assert answer["error"]["details"]["reason"] == reason
    url = sc.url + "/proxy/fake-openai/v1/chat/completions"
    async with sc.session.post(url, json={"model": "m"}, headers=headers) as resp:
        assert resp.status == 409
        assert resp.headers["x-egress-error-code"] == "CALL_CHAIN_REFUSED"
    async with sc.session.post(
        sc.url + "/mcp/mcp", json=CALL, headers={"Accept": rpc.ACCEPT, **headers}
    ) as resp:
        assert (await resp.json())["error"]["data"]["egress_code"] == "CALL_CHAIN_REFUSED"

    assert upstream.hits == 0
    assert [r["attempts"] for r in sc.audit_records()] == [0, 0, 0]
    assert refusals(sc, reason) == 3


async def test_each_target_follows_its_own_setting_failover_included(
    upstream_factory: Factory, sidecar_factory: Factory
) -> None:
    # An internal model server of the fleet (on: the default, and written out) fails over
    # to a provider (off): the first attempt carries the chain, the provider's none.
    async def unavailable(_: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "down"}}, status=503)

    internal: FakeUpstream = await upstream_factory(unavailable)
    provider: FakeUpstream = await upstream_factory()
    also_internal: FakeUpstream = await upstream_factory()
    policy = compile_policy(
        {
            "fake-openai": openai_target(
                internal.url,
                retry={"max_retries": 0},
                fallbacks=[{"target": "provider"}],
                call_chain={"propagate": True},
            ),
            "provider": openai_target(provider.url, **OFF),
            "also-internal": openai_target(also_internal.url),
        }
    )
    sc: Sidecar = await sidecar_factory(policy)
    deadline = now_ms() + 60_000
    chain = {"agents": ["planner"], "deadline_ms": deadline}

    status, answer = await sc.call(envelope(call_chain=chain))
    assert (status, answer["served_by"]["target"]) == (200, "provider"), answer
    status, answer = await sc.call(envelope(call_chain=chain, target_system="also-internal"))
    assert status == 200, answer

    expected = {CHAIN_HEADER: f"planner,{ME}", DEADLINE_HEADER: str(deadline)}
    assert [egress_headers(s.headers) for s in internal.seen] == [expected]
    assert [egress_headers(s.headers) for s in also_internal.seen] == [expected]
    assert [egress_headers(s.headers) for s in provider.seen] == [{}]
    assert SIGNATURE_HEADER not in expected  # unsigned fleet: nothing else to compare


POLICY = """\
version: 1
agent_id: planner-01
targets:
  openai:
    base_url: https://api.openai.com
    endpoints: [{path: /v1/chat/completions, methods: [POST]}]
    usage: openai
{setting}  slack:
    base_url: https://slack.com
    endpoints: [{path: /api/chat.postMessage, methods: [POST]}]
"""


@pytest.mark.parametrize(
    ("setting", "warned"),
    [
        ("", True),
        ("    call_chain: {propagate: false}\n", False),
        ("    call_chain: {propagate: true}\n", False),
        ("    call_chain: {}\n", True),
    ],
    ids=["unsaid", "off", "on", "block-without-propagate"],
)
def test_validate_warns_when_a_provider_target_does_not_say(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], setting: str, warned: bool
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY.replace("{setting}", setting))
    assert main(["validate", "--no-env-check", str(path)]) == 0
    out, err = capsys.readouterr()
    assert out == f"{path}: ok (2 targets, agent_id planner-01)\n"
    warning = (
        f"{path}: targets.openai.call_chain: warning: this openai provider gets the call "
        "chain's headers (your agent ids) by default: set call_chain: {propagate: false}, "
        "or propagate: true if it is an agent of your fleet\n"
    )
    assert err == (warning if warned else "")  # slack (no usage dialect) is never warned


def test_propagation_is_read_once_per_target_at_load() -> None:
    policy = compile_policy(
        {
            "on": openai_target("http://127.0.0.1:1"),
            "off": openai_target("http://127.0.0.1:1", **OFF),
        }
    )
    assert (policy.targets["on"].propagate_chain, policy.targets["off"].propagate_chain) == (
        True,
        False,
    )
