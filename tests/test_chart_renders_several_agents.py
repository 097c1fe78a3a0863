"""The chart for several agents in one pod: ``agents`` rendered into the policy (each with
the UID its container runs as), the calls API on a Unix socket in an emptyDir the
sidecar and the agents share, strictly valid manifests, and refusals of values that
would let two agents share an identity."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from gateway.policy import parse_policy
from tests.helm_helpers import (
    CHART,
    KUBE_VERSIONS,
    agent_chart,
    container,
    env_of,
    only,
    pod_spec,
    render,
    sidecar,
)
from tests.test_helm import AGENT_DEPLOYMENT, AGENT_VALUES

SOCKET = "/var/run/egress-gateway/egress.sock"
AGENTS: list[dict[str, Any]] = [
    {"id": "planner", "uid": 20001, "targets": ["httpbin"]},
    {"id": "coder", "uid": 20002},
]
VALUES: dict[str, Any] = {
    "agents": AGENTS,
    "sidecar": {"unixSocket": SOCKET},
    "egress": {"enforce": True},
    "agent": {"securityContext": {"runAsNonRoot": True, "runAsUser": 20001}},
}


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    helm.disable_logging()
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def test_agents_and_the_unix_socket_render(chart: helm.Chart) -> None:
    manifests = render(chart, VALUES, KUBE_VERSIONS)
    text = only(manifests, "ConfigMap")["data"]["policy.yaml"]
    policy = parse_policy(text, "policy.yaml")
    assert {n: (a.uid, a.targets) for n, a in policy.agents.items()} == {
        "planner": (20001, ["httpbin"]),
        "coder": (20002, None),
    }
    assert yaml.safe_load(text)["agent_id"] == "example-agent"  # the rest as written
    spec = pod_spec(manifests)
    gateway = sidecar(spec)
    assert env_of(gateway)["GATEWAY_UNIX_SOCKET"] == SOCKET
    mount = {"name": "egress-gateway-socket", "mountPath": "/var/run/egress-gateway"}
    assert mount in gateway["volumeMounts"]
    for name in ("planner", "coder"):  # each agent's own container
        agent = container(spec, name)
        assert mount in agent["volumeMounts"]
        assert env_of(agent)["EGRESS_GATEWAY_SOCKET"] == SOCKET
    [volume] = [v for v in spec["volumes"] if v["name"] == "egress-gateway-socket"]
    assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Mi"}
    # The policy's checksum covers the agents: a new agent rolls the pods (with
    # policy.rollOnChange, off by default: hot reload takes the change in).
    roll = {**VALUES, "policy": {"rollOnChange": True}}
    both = [render(chart, roll), render(chart, {**roll, "agents": AGENTS[:1]})]
    annotations = [pod_spec_annotations(m) for m in both]
    assert annotations[0]["checksum/policy"] != annotations[1]["checksum/policy"]


def test_each_agent_container_runs_as_the_uid_the_policy_gives_it(chart: helm.Chart) -> None:
    agents = [
        {"id": "planner", "uid": 20001, "rateLimitGroup": "planner-pace",
         "image": {"repository": "registry.example.com/planner", "tag": "1.0"},
         "command": ["planner"], "env": [{"name": "ROLE", "value": "plan"}]},
        {**AGENTS[1], "id": "Coder_2", "containerName": "coder"},
    ]  # fmt: skip
    content = "version: 1\nagent_id: example-agent\nrate_limit_groups:\n"
    content += "  planner-pace: {requests_per_second: 1, burst: 5}\n"
    manifests = render(chart, {**VALUES, "agents": agents, "policy": {"content": content}},
                       KUBE_VERSIONS)  # fmt: skip
    policy = parse_policy(only(manifests, "ConfigMap")["data"]["policy.yaml"], "policy.yaml")
    spec = pod_spec(manifests)
    names = [c["name"] for c in spec["containers"]]
    assert names[:2] == ["planner", "coder"]
    assert "agent" not in names
    for name, agent_id in (("planner", "planner"), ("coder", "Coder_2")):
        security = container(spec, name)["securityContext"]
        assert security["runAsUser"] == policy.agents[agent_id].uid  # one source: the values
        assert security["runAsNonRoot"] is True
        # The rest of agent.securityContext stays (its defaults: locked down).
        assert security["readOnlyRootFilesystem"] is True
        assert security["capabilities"] == {"drop": ["ALL"]}
    assert policy.agents["planner"].rate_limit_group == "planner-pace"
    assert policy.agents["Coder_2"].rate_limit_group is None
    planner, coder = container(spec, "planner"), container(spec, "coder")
    assert (planner["image"], planner["command"]) == (
        "registry.example.com/planner:1.0",
        ["planner"],
    )
    assert env_of(planner)["ROLE"] == "plan"
    assert coder["image"] == "busybox:1.37"  # agent.image
    assert coder["command"][0] == "sh"  # agent.command
    assert "ROLE" not in env_of(coder)
    # The pod's UID stays the sidecar's only where a container sets none: each agent sets its own.
    assert {container(spec, n)["securityContext"]["runAsUser"] for n in ("planner", "coder")} == {
        20001, 20002,
    }  # fmt: skip


def test_an_agent_chart_takes_each_agents_uid_from_the_values(
    chart: helm.Chart, tmp_path: Path
) -> None:
    deployment = AGENT_DEPLOYMENT.replace(
        "          securityContext: {runAsNonRoot: true, runAsUser: 20000}\n",
        '          securityContext:\n            {{- include "egress-gateway.agentSecurityContext" '
        '(dict "gateway" (index $.Values "egress-gateway") "agent" "planner") '
        "| nindent 12 }}\n",
    )
    assert "agentSecurityContext" in deployment
    agents = [{"id": "planner", "uid": 20001, "targets": ["openai"]}, AGENTS[1]]
    values = {**copy.deepcopy(AGENT_VALUES), "agents": agents}
    parent = agent_chart(tmp_path / "planner", {"egress-gateway": values}, deployment)
    with helm.Chart.load(parent) as agent:
        manifests = render(agent, kube_versions=KUBE_VERSIONS)
    security = container(pod_spec(manifests), "planner")["securityContext"]
    assert (security["runAsUser"], security["runAsNonRoot"]) == (20001, True)
    policy = parse_policy(only(manifests, "ConfigMap")["data"]["policy.yaml"], "policy.yaml")
    assert policy.agents["planner"].uid == 20001
    wrong = deployment.replace('"agent" "planner"', '"agent" "nobody"')
    parent = agent_chart(tmp_path / "nobody", {"egress-gateway": values}, wrong)
    with helm.Chart.load(parent) as agent, pytest.raises(helm.HelmRenderError) as caught:
        agent.render(None, name="demo")
    assert 'no agent "nobody" in agents' in str(caught.value)


DOC_BLOCK = "# values.yaml: a pod with two agents, each its own UID\n"


def _doc_values() -> dict[str, Any]:
    """The two-agent values block of README.md and docs/kubernetes.md (one text in both)."""
    root = CHART.parent.parent
    texts = {
        re.search(f"```yaml\n({DOC_BLOCK}.*?)```", (root / page).read_text(), re.DOTALL)[1]
        for page in ("README.md", "docs/kubernetes.md")
    }  # type: ignore[index]
    [text] = texts
    values: dict[str, Any] = yaml.safe_load(text)
    return values


def test_the_documented_two_agent_pod_renders_each_agent_under_its_uid(
    chart: helm.Chart,
) -> None:
    manifests = render(chart, _doc_values(), KUBE_VERSIONS)
    policy = parse_policy(only(manifests, "ConfigMap")["data"]["policy.yaml"], "policy.yaml")
    spec = pod_spec(manifests)
    uids = {}
    for agent_id, spec_of_agent in policy.agents.items():
        agent = container(spec, agent_id)
        assert agent["securityContext"]["runAsUser"] == spec_of_agent.uid
        assert agent["securityContext"]["runAsNonRoot"] is True
        assert env_of(agent)["EGRESS_GATEWAY_SOCKET"] == SOCKET
        uids[agent_id] = spec_of_agent.uid
    assert uids == {"planner": 20001, "coder": 20002}
    assert policy.agents["planner"].rate_limit_group == "planner-pace"
    assert container(spec, "coder")["image"] == "registry.example.com/coder:1.0"


def pod_spec_annotations(manifests: dict[str, list[Any]]) -> dict[str, str]:
    annotations: dict[str, str] = only(manifests, "Deployment")["spec"]["template"]["metadata"][
        "annotations"
    ]
    return annotations


def test_without_agents_nothing_changes(chart: helm.Chart) -> None:
    manifests = render(chart)
    spec = pod_spec(manifests)
    assert "GATEWAY_UNIX_SOCKET" not in env_of(sidecar(spec))
    assert "EGRESS_GATEWAY_SOCKET" not in env_of(container(spec, "agent"))
    assert all(v["name"] != "egress-gateway-socket" for v in spec["volumes"])
    assert "agents" not in yaml.safe_load(only(manifests, "ConfigMap")["data"]["policy.yaml"])


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"agents": [{"id": "a", "uid": 20001}, {"id": "b", "uid": 20001}]},
            "agents a and b have one UID (20001): one UID, one agent",
        ),
        (
            {"agents": [{"id": "a", "uid": 10001}]},
            "agents a has sidecar.uid (10001): give each agent a UID of its own",
        ),
        (
            {"agents": [{"id": "Planner", "uid": 20001}]},
            'agents Planner: "Planner" is not a container name',
        ),
        (  # else one policy entry (the last UID) and both containers running as it
            {"agents": [{"id": "a", "uid": 20001}, {"id": "a", "uid": 20002}]},
            "agents a is listed twice: one entry per agent",
        ),
        (  # the policy alone (no example Deployment): refused all the same
            {
                "agents": [{"id": "a", "uid": 20001}, {"id": "a", "uid": 20002}],
                "agent": {"enabled": False},
            },
            "agents a is listed twice: one entry per agent",
        ),
        (
            {
                "agents": [
                    {"id": "a", "uid": 20001, "containerName": "worker"},
                    {"id": "b", "uid": 20002, "containerName": "worker"},
                ]
            },
            'agents a and b have one container name ("worker")',
        ),
        (
            {"agents": [{"id": "a", "uid": 20001, "containerName": "egress-gateway"}]},
            'agents a: container name "egress-gateway" is the chart\'s own',
        ),
        (
            {"agents": AGENTS, "policy": {"existingConfigMap": "mine"}},
            "with policy.existingConfigMap write them in that policy",
        ),
        (
            {
                "agents": AGENTS,
                "policy": {"content": "version: 1\nagent_id: a\nagents: {x: {uid: 5}}\n"},
            },
            "has an agents: section and the values list agents: write them in one place",
        ),
    ],
)
def test_agents_that_would_share_an_identity_fail_the_render(
    chart: helm.Chart, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmRenderError) as caught:
        chart.render(values, name="demo")
    assert message in str(caught.value)


@pytest.mark.parametrize(
    "values",
    [
        {"agents": [{"id": "a", "uid": 0}]},
        {"agents": [{"id": "a", "uid": "20001"}]},
        {"agents": [{"id": "a"}]},
        {"agents": [{"id": "a", "uid": 20001, "token": "x"}]},
        {"sidecar": {"unixSocket": "relative/egress.sock"}},
    ],
    ids=["root", "string-uid", "no-uid", "unknown-key", "relative-socket"],
)
def test_wrong_agent_values_fail_the_schema(chart: helm.Chart, values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        chart.render(values, name="demo")
