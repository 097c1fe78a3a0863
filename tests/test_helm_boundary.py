"""The chart's boundary: the policy check before the sidecar starts, enforced egress
(``egress.enforce``: the init container that runs deploy/egress-gateway-enforce, the only
one with NET_ADMIN) and the optional NetworkPolicy, rendered and validated strictly for
Kubernetes 1.29-1.33. The script itself is run for real in tests/test_enforce.py."""

from __future__ import annotations

import subprocess
from typing import Any

import helm_python as helm
import pytest

from tests.helm_helpers import (
    CHART,
    KUBE_VERSIONS,
    ROOT,
    container,
    env_of,
    init_names,
    kinds,
    only,
    pod_spec,
    render,
    sidecar,
)
from tests.test_helm import CUSTOM

SCRIPT = ROOT / "deploy" / "egress-gateway-enforce"
LOCKED_DOWN = {
    "runAsNonRoot": True,
    "runAsUser": 10001,
    "runAsGroup": 10001,
    "readOnlyRootFilesystem": True,
    "allowPrivilegeEscalation": False,
    "privileged": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
ENFORCED: dict[str, Any] = {
    "egress": {
        "enforce": True,
        "dns": {"servers": ["10.96.0.10", "fd00:10:96::a"], "port": 5353},
        "allow": [
            {"cidr": "10.20.0.0/16", "ports": [8080, "9000-9010"]},
            {"cidr": "fd00:20::/64", "protocol": "udp", "ports": [5000]},
            {"cidr": "192.0.2.7"},
        ],
    },
}


@pytest.mark.parametrize(
    "values",
    [
        None,
        CUSTOM,
        ENFORCED,
        {**ENFORCED, "sidecar": {"native": True}, "networkPolicy": {"enabled": True}},
        {**CUSTOM, **ENFORCED, "networkPolicy": {"enabled": True}},
    ],
    ids=["default", "custom", "enforced", "enforced-native-netpol", "custom-enforced-netpol"],
)
def test_manifests_are_valid_for_every_supported_kubernetes(
    chart: helm.Chart, values: dict[str, Any] | None
) -> None:
    manifests = render(chart, values, kube_versions=KUBE_VERSIONS)
    assert all(len(docs) <= 1 for docs in manifests.values())  # one resource per template
    assert "Deployment" in kinds(manifests)
    for version in (KUBE_VERSIONS[0], KUBE_VERSIONS[-1]):
        report = helm.lint(CHART, values, strict=True, kube_version=f"v{version}")
        assert report["errors"] == []
        assert [m for m in report["messages"] if m["severity"] >= 2] == []


# --- the policy check -------------------------------------------------------------------


@pytest.mark.parametrize("native", [False, True])
def test_the_policy_is_validated_before_the_sidecar_starts(chart: helm.Chart, native: bool) -> None:
    secret = {"secretKeyRef": {"name": "openai", "key": "api-key"}}
    extra_env = [{"name": "OPENAI_API_KEY", "valueFrom": secret}]
    spec = pod_spec(render(chart, {"sidecar": {"native": native, "extraEnv": extra_env}}))
    check = spec["initContainers"][0]
    side = sidecar(spec)
    assert check["name"] == "egress-gateway-validate"
    assert check["image"] == side["image"]
    assert check["args"] == ["validate", env_of(side)["GATEWAY_POLICY"]]  # what serve reads
    assert check["env"] == extra_env  # its env:// warnings are about the sidecar's variables
    # Its problems (FILE:LINE: key: problem) become the container's termination message.
    assert check["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert side["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert check["securityContext"] == side["securityContext"] == LOCKED_DOWN
    assert check["resources"] == side["resources"]  # the same program, the same memory
    mounts = {m["mountPath"]: m["name"] for m in check["volumeMounts"]}
    assert mounts == {"/etc/egress-gateway": "egress-gateway-policy", "/tmp": "egress-gateway-tmp"}
    if native:
        assert init_names(spec) == ["egress-gateway-validate", "egress-gateway"]

    values = {"policy": {"validateOnStart": False}, "sidecar": {"native": native}}
    off = pod_spec(render(chart, values))
    assert init_names(off) == (["egress-gateway"] if native else [])  # no policy check


# --- enforced egress --------------------------------------------------------------------


def test_enforcement_is_off_by_default(chart: helm.Chart) -> None:
    manifests = render(chart)
    spec = pod_spec(manifests)
    assert "egress-gateway-enforce" not in init_names(spec)
    assert "NetworkPolicy" not in kinds(manifests)
    assert spec["securityContext"]["runAsUser"] == 10001  # unchanged without enforcement


@pytest.mark.parametrize("native", [False, True])
def test_only_the_enforce_init_container_gets_net_admin(chart: helm.Chart, native: bool) -> None:
    spec = pod_spec(render(chart, {**ENFORCED, "sidecar": {"native": native}}))
    # The rules are in force before the sidecar and the agent start.
    expected = ["egress-gateway-validate", "egress-gateway-enforce"]
    assert init_names(spec) == expected + (["egress-gateway"] if native else [])
    enforce = container(spec, "egress-gateway-enforce")
    assert enforce["command"] == ["egress-gateway-enforce"]
    assert enforce["image"] == sidecar(spec)["image"]
    assert enforce["securityContext"] == {
        "runAsNonRoot": False,
        "runAsUser": 0,  # no effective capabilities for a non-root process in Kubernetes
        "runAsGroup": 0,
        "readOnlyRootFilesystem": True,
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert enforce["resources"]["limits"]
    others = [c for c in spec["containers"] + spec["initContainers"] if c is not enforce]
    for other in others:
        context = other["securityContext"]
        assert "add" not in context.get("capabilities", {}), other["name"]
        assert context["runAsUser"] != 0, other["name"]
    assert sidecar(spec)["securityContext"] == LOCKED_DOWN
    # Nothing inherits the sidecar's UID from the pod; the example agent has its own.
    assert "runAsUser" not in spec["securityContext"]
    assert "runAsGroup" not in spec["securityContext"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert container(spec, "agent")["securityContext"]["runAsUser"] not in (0, 10001)


def test_enforce_arguments_are_what_the_script_accepts(chart: helm.Chart) -> None:
    enforce = container(pod_spec(render(chart, ENFORCED)), "egress-gateway-enforce")
    assert enforce["args"] == [
        "--uid", "10001",
        "--dns-port", "5353",
        "--dns", "10.96.0.10",
        "--dns", "fd00:10:96::a",
        "--allow", "10.20.0.0/16 tcp 8080,9000-9010",
        "--allow", "fd00:20::/64 udp 5000",
        "--allow", "192.0.2.7",
    ]  # fmt: skip
    done = subprocess.run(
        ["sh", str(SCRIPT), *enforce["args"], "--dry-run"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    for rule in (
        "meta skuid 10001 accept",
        "ip daddr { 10.96.0.10 } meta l4proto { tcp, udp } th dport 5353 accept",
        "ip6 daddr { fd00:10:96::a } meta l4proto { tcp, udp } th dport 5353 accept",
        "ip daddr 10.20.0.0/16 tcp dport { 8080, 9000-9010 } accept",
        "ip6 daddr fd00:20::/64 udp dport { 5000 } accept",
        "ip daddr 192.0.2.7 accept",
    ):
        assert rule in done.stdout

    default = container(
        pod_spec(render(chart, {"egress": {"enforce": True}})), "egress-gateway-enforce"
    )
    # No --dns: the script reads the pod's /etc/resolv.conf (the cluster resolver).
    assert default["args"] == ["--uid", "10001", "--dns-port", "53"]


def test_an_example_agent_with_the_sidecars_uid_is_refused(chart: helm.Chart) -> None:
    same = {"agent": {"securityContext": {"runAsNonRoot": True, "runAsUser": 10001}}}
    render(chart, same)  # cooperative egress: allowed
    with pytest.raises(helm.HelmRenderError) as caught:
        chart.render({**same, "egress": {"enforce": True}}, name="demo")
    assert "agent.securityContext.runAsUser is sidecar.uid (10001)" in str(caught.value)


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"egress": {"enforce": "yes"}}, "/egress/enforce"),
        ({"egress": {"allow": [{"cidr": "internal"}]}}, "/egress/allow/0/cidr"),
        (
            {"egress": {"allow": [{"cidr": "10.0.0.0/8", "ports": [70000]}]}},
            "/egress/allow/0/ports",
        ),
        ({"egress": {"allow": [{"cidr": "10.0.0.0/8", "protocol": "tcp"}]}}, "/egress/allow/0"),
        (
            {"egress": {"allow": [{"cidr": "10.0.0.0/8", "protocol": "icmp", "ports": [1]}]}},
            "/egress/allow/0/protocol",
        ),
        ({"egress": {"allow": ["10.0.0.0/8"]}}, "/egress/allow/0"),
        ({"egress": {"dns": {"servers": ["kube-dns.kube-system"]}}}, "/egress/dns/servers/0"),
        ({"egress": {"enforced": True}}, "/egress"),
        ({"networkPolicy": {"extraPorts": ["443"]}}, "/networkPolicy/extraPorts/0"),
        ({"policy": {"validateOnStart": "true"}}, "/policy/validateOnStart"),
    ],
)
def test_wrong_boundary_values_fail_the_schema(
    chart: helm.Chart, values: dict[str, Any], where: str
) -> None:
    with pytest.raises(helm.HelmValuesError) as caught:
        chart.render(values, name="demo")
    assert where in str(caught.value)


# --- the NetworkPolicy ------------------------------------------------------------------


def egress_rules(manifests: dict[str, list[Any]]) -> list[dict[str, Any]]:
    policy = only(manifests, "NetworkPolicy")
    assert policy["spec"]["policyTypes"] == ["Egress"]  # probes and scrapes still come in
    labels = only(manifests, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    rules: list[dict[str, Any]] = policy["spec"]["egress"]
    assert rules[0] == {
        "to": [
            {
                "namespaceSelector": {
                    "matchLabels": {"kubernetes.io/metadata.name": "kube-system"}
                },
                "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
            }
        ],
        "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
    }
    return rules


def tcp_ports(rule: dict[str, Any]) -> list[int]:
    assert "to" not in rule  # any address: the sidecar's own egress rules judge addresses
    assert {p["protocol"] for p in rule["ports"]} == {"TCP"}
    return sorted(p["port"] for p in rule["ports"])


def test_network_policy_allows_dns_and_the_targets_ports(chart: helm.Chart) -> None:
    # The default policy: one https target.
    rules = egress_rules(render(chart, {"networkPolicy": {"enabled": True}}))
    assert len(rules) == 2
    assert tcp_ports(rules[1]) == [443]

    # The repository's example: https targets, an internal one on 8080, Vault on 8200.
    example = (ROOT / "policies" / "example.yaml").read_text()
    values = {
        "policy": {"content": example},
        "vault": {"kubernetesAuth": {"enabled": True, "role": "planner-01"}},
        "networkPolicy": {
            "enabled": True,
            "extraPorts": [9443],
            "extraEgress": [{"to": [{"ipBlock": {"cidr": "10.30.0.0/16"}}]}],
        },
    }
    rules = egress_rules(render(chart, values))
    assert tcp_ports(rules[1]) == [443, 8080, 8200, 9443]
    assert rules[2:] == [{"to": [{"ipBlock": {"cidr": "10.30.0.0/16"}}]}]

    # Vault from the values, Redis from a Secret (its default port).
    rules = egress_rules(render(chart, {**CUSTOM, "networkPolicy": {"enabled": True}}))
    assert tcp_ports(rules[1]) == [443, 6379, 8200]


def test_network_policy_lets_through_what_egress_allow_allows(chart: helm.Chart) -> None:
    rules = egress_rules(render(chart, {**ENFORCED, "networkPolicy": {"enabled": True}}))
    assert tcp_ports(rules[1]) == [443]  # the default policy's target
    assert rules[2:] == [
        {
            "to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}],
            "ports": [
                {"protocol": "TCP", "port": 8080},
                {"protocol": "TCP", "port": 9000, "endPort": 9010},
            ],
        },
        {
            "to": [{"ipBlock": {"cidr": "fd00:20::/64"}}],
            "ports": [{"protocol": "UDP", "port": 5000}],
        },
        {"to": [{"ipBlock": {"cidr": "192.0.2.7/32"}}]},  # every port and protocol
    ]


def test_network_policy_with_a_policy_the_chart_cannot_read(chart: helm.Chart) -> None:
    values: dict[str, Any] = {
        "policy": {"existingConfigMap": "planner-policy"},
        "networkPolicy": {"enabled": True, "podSelector": {"app": "planner"}},
    }
    with pytest.raises(
        helm.HelmRenderError, match=r"list their ports in networkPolicy\.extraPorts"
    ):
        chart.render(values, name="demo")
    values["networkPolicy"]["extraPorts"] = [443]
    values["agent"] = {"podLabels": {"app": "planner"}}
    policy = only(render(chart, values), "NetworkPolicy")
    assert policy["spec"]["podSelector"] == {"matchLabels": {"app": "planner"}}
    assert tcp_ports(policy["spec"]["egress"][1]) == [443]
