"""An agent recognised by its token (header ``x-egress-agent-token``, compared with the
value of its ``token_ref``): its calls are its own on every API; a caller without a
token, or with one that matches no agent, is refused and never given a default agent;
the token never goes upstream and never shows in any log line or answer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from multidict import CIMultiDict

from gateway.policy import load_policy
from tests.conftest import compile_policy, envelope, openai_target, policy_yaml

TOKEN = "agent-token-TEST-0042-NOTREAL"
OTHER = "agent-token-TEST-0043-NOTREAL"


@pytest.fixture
async def sidecar(upstream: Any, sidecar_factory: Any, tmp_path: Path) -> Any:
    token_file = tmp_path / "interpreter-token"
    token_file.write_text(TOKEN + "\n")
    policy = compile_policy(
        {"fake-openai": openai_target(upstream.url)},
        agents={
            "interpreter": {"token_ref": f"file://{token_file}"},
            "reviewer": {"token_ref": "env://TEST_REVIEWER_TOKEN", "targets": []},
        },
    )
    return await sidecar_factory(policy)


@pytest.fixture(autouse=True)
def _reviewer_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_REVIEWER_TOKEN", OTHER)


async def _post(sc: Any, path: str, body: Any, headers: dict[str, str]) -> tuple[int, Any]:
    async with sc.session.post(sc.url + path, json=body, headers=headers) as resp:
        return resp.status, await resp.json()


async def test_calls_are_the_agents_whose_token_they_carry(sidecar: Any, upstream: Any) -> None:
    sc = sidecar
    mine = {"x-egress-agent-token": TOKEN}
    assert (await _post(sc, "/v1/calls", envelope(trace_id="tr-env"), mine))[0] == 200
    params = envelope()["parameters"]
    status, _ = await _post(sc, "/proxy/fake-openai/v1/chat/completions", params, {
        **mine, "x-egress-trace-id": "tr-proxy",
    })  # fmt: skip
    assert status == 200
    status, body = await _post(sc, "/v1/calls", envelope(trace_id="tr-none"), {})
    assert (status, body["error"]["details"]["reason"]) == (403, "unknown_agent")
    assert body["error"]["details"]["peer_uid"] is None  # no agent has a uid: not asked
    guess = {"x-egress-agent-token": "agent-token-guess-0000"}
    status, body = await _post(sc, "/v1/calls", envelope(trace_id="tr-guess"), guess)
    assert (status, body["error"]["details"]["reason"]) == (403, "unknown_agent")
    reviewer = {"x-egress-agent-token": OTHER}
    status, body = await _post(sc, "/v1/calls", envelope(trace_id="tr-reviewer"), reviewer)
    assert (status, body["error"]["details"]["reason"]) == (403, "target_not_allowed")
    status, body = await _post(
        sc, "/v1/calls", envelope(trace_id="tr-claim", agent_id="reviewer"), mine
    )
    assert (status, body["error"]["details"]["reason"]) == (403, "agent_mismatch")

    seen = {r["trace_id"]: (r["agent_id"], r["agent_auth"], r["api"]) for r in sc.audit_records()}
    assert seen == {
        "tr-env": ("interpreter", "token", "envelope"),
        "tr-proxy": ("interpreter", "token", "proxy"),
        "tr-none": ("_unknown", None, "envelope"),
        "tr-guess": ("_unknown", None, "envelope"),
        "tr-reviewer": ("reviewer", "token", "envelope"),
        "tr-claim": ("interpreter", "token", "envelope"),
    }
    assert len(upstream.seen) == 2
    for request in upstream.seen:
        sent = {k.lower() for k in request.headers}
        assert not sent & {"x-egress-agent-token", "x-egress-agent"}
        assert TOKEN not in str(dict(request.headers)) + request.body.decode()
    assert TOKEN not in sc.log.getvalue()
    assert OTHER not in sc.log.getvalue()


async def test_an_unknown_caller_on_an_unknown_route_is_audited_as_unknown(
    sidecar: Any,
) -> None:
    async with sidecar.session.get(sidecar.url + "/nowhere") as resp:
        assert resp.status == 404
    [record] = sidecar.audit_records()
    assert (record["agent_id"], record["agent_auth"], record["http_status"]) == (
        "_unknown", None, 404,
    )  # fmt: skip
    assert record["policy_sha256"] == sidecar.gateway.policy.sha256


async def test_a_start_with_an_empty_token_fails(
    upstream: Any, sidecar_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TEST_REVIEWER_TOKEN", " ")
    policy = compile_policy(
        {"fake-openai": openai_target(upstream.url)},
        agents={"reviewer": {"token_ref": "env://TEST_REVIEWER_TOKEN"}},
    )
    with pytest.raises(ValueError, match=r"agents\.reviewer\.token_ref: the agent token is empty"):
        await sidecar_factory(policy)


async def test_a_reload_reads_the_tokens_again(
    upstream: Any, sidecar_factory: Any, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    path = tmp_path / "policy.yaml"
    agents = {"interpreter": {"token_ref": f"file://{token_file}"}}
    path.write_text(policy_yaml({"fake-openai": openai_target(upstream.url)}, agents=agents))
    sc = await sidecar_factory(load_policy(path))
    assert (await _post(sc, "/v1/calls", envelope(), {"x-egress-agent-token": TOKEN}))[0] == 200

    token_file.write_text(OTHER)  # rotated: the reload reads it
    assert await sc.gateway.reload() is True
    status, body = await _post(sc, "/v1/calls", envelope(), {"x-egress-agent-token": TOKEN})
    assert (status, body["error"]["details"]["reason"]) == (403, "unknown_agent")
    assert (await _post(sc, "/v1/calls", envelope(), {"x-egress-agent-token": OTHER}))[0] == 200

    token_file.write_text("")  # an empty token refuses the reload; the one in force stays
    assert await sc.gateway.reload() is False
    assert (await _post(sc, "/v1/calls", envelope(), {"x-egress-agent-token": OTHER}))[0] == 200
    [refused] = [e for e in sc.lines() if e.get("event") == "policy_reload" and not e["applied"]]
    assert refused["problems"] == [
        f"{path}:1: agents.interpreter.token_ref: the agent token 'file://{token_file}' is empty"
    ]


async def test_an_identity_header_sent_twice_with_two_values_is_refused(sidecar: Any) -> None:
    """A second copy of ``x-egress-agent`` or of the token header is read, not ignored:
    two different values are no one's identity (the first copy alone decided before)."""
    sc = sidecar
    cases = {
        "tr-two-claims": (
            [
                ("x-egress-agent-token", TOKEN),
                ("x-egress-agent", "interpreter"),
                ("x-egress-agent", "reviewer"),
            ],
            "agent_mismatch",
        ),
        "tr-two-tokens": (
            [("x-egress-agent-token", TOKEN), ("x-egress-agent-token", OTHER)],
            "unknown_agent",
        ),
    }
    for trace, (pairs, reason) in cases.items():
        async with sc.session.post(
            sc.url + "/v1/calls", json=envelope(trace_id=trace), headers=CIMultiDict(pairs)
        ) as resp:
            body = await resp.json()
        assert (resp.status, body["error"]["details"]["reason"]) == (403, reason), trace
    same = CIMultiDict([("x-egress-agent-token", TOKEN), ("x-egress-agent-token", TOKEN)])
    async with sc.session.post(
        sc.url + "/v1/calls", json=envelope(trace_id="tr-same"), headers=same
    ) as resp:
        assert resp.status == 200  # the same value twice is one identity


async def test_who_calls_is_settled_before_an_a2a_body_is_read(sidecar: Any) -> None:
    """An A2A request from no known agent is refused as such (``unknown_agent``), whatever
    its body: a body that is not JSON does not turn the refusal into a parse error."""
    sc = sidecar
    async with sc.session.post(
        sc.url + "/a2a/fake-openai", data=b"{bad", headers={"Content-Type": "application/json"}
    ) as resp:
        body = await resp.json()
    assert body["error"]["data"]["egress_code"] == "PERMISSION_DENIED", body
    assert body["error"]["data"]["reason"] == "unknown_agent", body
