"""The Helm chart: rendered offline with helm-python-sdk (Helm's own engine, no binary, no
cluster), every manifest validated with kubernetes-validate in strict mode (unknown fields
are errors) for Kubernetes 1.29-1.37, and values.schema.json
enforced on wrong value types. Enforced egress and the NetworkPolicy: test_helm_egress.py."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from gateway.policy import DEFAULT_DRAIN_S, parse_policy
from tests.helm_helpers import (
    CHART,
    KUBE_VERSION,
    KUBE_VERSIONS,
    ROOT,
    agent_chart,
    container,
    env_of,
    init_names,
    kinds,
    only,
    pod_spec,
    render,
    sidecar,
    validate,
)

TOKEN_PATH = "/var/run/secrets/vault/token"

VAULT_POLICY = f"""\
version: 1
agent_id: planner-01
server: {{drain_s: 25}}
targets:
  openai:
    base_url: https://api.openai.com
    credential:
      header: Authorization
      format: "Bearer {{secret}}"
      default_ref: vault://openai-key
    endpoints:
      - {{path: /v1/chat/completions, methods: [POST]}}
    rate_limit_group: llm
    usage: openai
rate_limit_groups:
  llm: {{requests_per_second: 5, burst: 10, scope: cluster}}
secrets:
  vault:
    address: http://127.0.0.1:8200
    auth: {{method: kubernetes, role: planner, jwt_path: {TOKEN_PATH}}}
redis: {{url: "redis://127.0.0.1:6379/0"}}
"""

#: Non-default values: native sidecar, Vault Kubernetes auth, Redis, custom resources,
#: metrics Service, a digest-pinned image.
CUSTOM: dict[str, Any] = {
    "image": {"repository": "registry.example.com/egress-gateway", "digest": "sha256:" + "a" * 64},
    "sidecar": {
        "native": True,
        "port": 9191,
        "opsPort": 9192,
        "resources": {
            "requests": {"cpu": "100m", "memory": "96Mi"},
            "limits": {"cpu": 1, "memory": "512Mi"},
        },
        "extraEnv": [{"name": "OPENAI_ORG", "value": "org-1"}],
    },
    "policy": {"content": VAULT_POLICY},
    "terminationGracePeriodSeconds": 40,
    "vault": {
        "address": "https://vault.vault.svc:8200",
        "namespace": "team-a",
        "caCert": {"configMap": "vault-ca"},
        "kubernetesAuth": {
            "enabled": True,
            "role": "planner",
            "audience": "vault",
            "expirationSeconds": 1800,
        },
    },
    "redis": {"urlSecret": {"name": "redis-url", "key": "url"}},
    "metrics": {"service": {"enabled": True, "port": 9192}},
    "agent": {"image": {"repository": "registry.example.com/planner", "tag": "1.4.2"}},
}


def test_lint_passes_strict_with_default_and_custom_values() -> None:
    for values in (None, CUSTOM):
        report = helm.lint(CHART, values, strict=True, kube_version=f"v{KUBE_VERSION}")
        assert report["errors"] == []
        # Severity 1 is "info" (e.g. "icon is recommended"); warnings and errors fail.
        assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_strict_validation_rejects_unknown_fields(version: str) -> None:
    # Guard for the chart tests: strict mode must really refuse a misspelt field, in the
    # library and in helm_helpers.validate (the library's schemas, loaded once) alike.
    good = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "x"}}
    bad = {**good, "automountServiceAccountTokens": False}
    assert kubernetes_validate.validate(good, version, strict=True) == version[:4]
    validate(good, version)
    with pytest.raises(kubernetes_validate.ValidationError) as theirs:
        kubernetes_validate.validate(bad, version, strict=True)
    with pytest.raises(kubernetes_validate.ValidationError) as ours:
        validate(bad, version)
    assert (ours.value.message, ours.value.version) == (theirs.value.message, version[:4])
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        validate({**good, "kind": "NoSuchKind"}, version)


def test_default_render_is_one_resource_per_template(chart: helm.Chart) -> None:
    manifests = render(chart)

    assert all(len(docs) <= 1 for docs in manifests.values())
    assert kinds(manifests) == ["ConfigMap", "Deployment", "ServiceAccount"]


def test_default_policy_value_is_a_valid_policy(chart: helm.Chart) -> None:
    content = chart.values["policy"]["content"]
    policy = parse_policy(content, "values.yaml:policy.content")
    assert policy.targets
    configmap = only(render(chart), "ConfigMap")
    assert configmap["data"] == {"policy.yaml": content}


@pytest.mark.parametrize("values", [None, CUSTOM], ids=["default", "custom"])
def test_sidecar_is_locked_down_and_probed(chart: helm.Chart, values: dict[str, Any]) -> None:
    merged = chart.merge_values(values)
    manifests = render(chart, values)
    spec = pod_spec(manifests)
    container = sidecar(spec)

    assert container["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "readOnlyRootFilesystem": True,
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["automountServiceAccountToken"] is False

    ops = merged["sidecar"]["opsPort"]
    assert container["ports"] == [{"name": "gateway-ops", "containerPort": ops, "protocol": "TCP"}]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "gateway-ops"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "gateway-ops"}
    assert container["startupProbe"]["httpGet"]["port"] == "gateway-ops"

    env = env_of(container)
    assert env["GATEWAY_HOST"] == "127.0.0.1"  # the calls API never leaves the pod
    assert env["GATEWAY_PORT"] == str(merged["sidecar"]["port"])
    assert env["GATEWAY_OPS_HOST"] == "0.0.0.0"  # noqa: S104 - probes and scrapes on the pod IP
    assert env["GATEWAY_OPS_PORT"] == str(ops)
    assert container["resources"] == merged["sidecar"]["resources"]
    assert container["resources"]["requests"]
    assert container["resources"]["limits"]

    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    assert volumes[mounts["/etc/egress-gateway"]]["configMap"]["items"] == [
        {"key": "policy.yaml", "path": "policy.yaml"}
    ]
    assert not any("subPath" in m for m in container["volumeMounts"])  # hot reload needs it

    policy = parse_policy(merged["policy"]["content"])
    assert spec["terminationGracePeriodSeconds"] > policy.server.drain_s >= 0

    agent = next(c for c in spec["containers"] if c["name"] == "agent")
    assert env_of(agent)["EGRESS_GATEWAY_URL"] == f"http://127.0.0.1:{merged['sidecar']['port']}"


def test_the_default_sidecar_is_native(chart: helm.Chart) -> None:
    # The chart needs Kubernetes >= 1.29, where native sidecars are on by default.
    assert pod_spec(render(chart)) == pod_spec(render(chart, {"sidecar": {"native": True}}))


def test_a_non_native_sidecar_is_a_regular_container(chart: helm.Chart) -> None:
    spec = pod_spec(render(chart, {"sidecar": {"native": False}}))
    assert [c["name"] for c in spec["containers"]] == ["agent", "egress-gateway"]
    assert init_names(spec) == ["egress-gateway-validate"]  # the policy check only
    assert "restartPolicy" not in sidecar(spec)
    # SIGTERM reaches the agent at the same moment: the policy's server.shutdown decides
    # (new calls served while draining, by default).
    assert "GATEWAY_SHUTDOWN_ACCEPT_NEW_CALLS" not in env_of(sidecar(spec))


def test_native_sidecar_is_an_always_restarting_init_container(chart: helm.Chart) -> None:
    spec = pod_spec(render(chart, {"sidecar": {"native": True}}))
    assert [c["name"] for c in spec["containers"]] == ["agent"]
    # The policy is checked before the sidecar starts; the agent starts after both.
    assert init_names(spec) == ["egress-gateway-validate", "egress-gateway"]
    assert sidecar(spec)["restartPolicy"] == "Always"
    # Stopped after the agent has exited: nothing is left to send a new call.
    assert env_of(sidecar(spec))["GATEWAY_SHUTDOWN_ACCEPT_NEW_CALLS"] == "false"


def test_no_service_account_token_without_vault_kubernetes_auth(chart: helm.Chart) -> None:
    manifests = render(chart)
    assert only(manifests, "ServiceAccount")["automountServiceAccountToken"] is False
    spec = pod_spec(manifests)
    assert spec["automountServiceAccountToken"] is False
    assert not [v for v in spec["volumes"] if "projected" in v]
    assert "serviceAccountToken" not in yaml.safe_dump(manifests)


def test_vault_kubernetes_auth_mounts_a_projected_token_in_the_sidecar_only(
    chart: helm.Chart,
) -> None:
    parse_policy(VAULT_POLICY)  # the policy these values carry is itself valid
    manifests = render(chart, CUSTOM)
    spec = pod_spec(manifests)
    assert spec["automountServiceAccountToken"] is False
    assert spec["serviceAccountName"] == only(manifests, "ServiceAccount")["metadata"]["name"]

    volume = next(v for v in spec["volumes"] if v["name"] == "egress-gateway-vault-token")
    # Readable by the sidecar without a pod fsGroup (an agent's chart may set none); only
    # the sidecar container mounts it.
    assert volume["projected"]["defaultMode"] == 0o444
    assert volume["projected"]["sources"] == [
        {"serviceAccountToken": {"audience": "vault", "expirationSeconds": 1800, "path": "token"}}
    ]
    container = sidecar(spec)
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    assert mount == {
        "name": "egress-gateway-vault-token",
        "mountPath": "/var/run/secrets/vault",
        "readOnly": True,
    }
    agent = next(c for c in spec["containers"] if c["name"] == "agent")
    assert [m["name"] for m in agent["volumeMounts"]] == ["agent-tmp"]
    every = spec["containers"] + spec["initContainers"]
    mounting = [
        c["name"] for c in every if volume["name"] in {m["name"] for m in c["volumeMounts"]}
    ]
    assert mounting == ["egress-gateway"]

    env = env_of(container)
    assert env["VAULT_ADDR"] == "https://vault.vault.svc:8200"
    assert env["VAULT_NAMESPACE"] == "team-a"
    assert env["VAULT_CACERT"] == "/etc/egress-gateway-vault-ca/ca.crt"
    assert "VAULT_SKIP_VERIFY" not in env
    assert env["REDIS_URL"] == {"secretKeyRef": {"name": "redis-url", "key": "url"}}
    assert env["OPENAI_ORG"] == "org-1"
    assert container["image"] == "registry.example.com/egress-gateway@sha256:" + "a" * 64


def test_redis_url_from_plain_value(chart: helm.Chart) -> None:
    spec = pod_spec(render(chart, {"redis": {"url": "redis://redis.redis.svc:6379/0"}}))
    assert env_of(sidecar(spec))["REDIS_URL"] == "redis://redis.redis.svc:6379/0"
    assert "REDIS_URL" not in env_of(sidecar(pod_spec(render(chart))))


@pytest.mark.parametrize("values", [None, CUSTOM], ids=["default", "custom"])
def test_no_service_exposes_the_calls_port(chart: helm.Chart, values: dict[str, Any]) -> None:
    merged = chart.merge_values(values)
    manifests = render(chart, values)
    services = [d for docs in manifests.values() for d in docs if d["kind"] == "Service"]
    assert len(services) == (1 if merged["metrics"]["service"]["enabled"] else 0)
    for service in services:
        assert service["spec"]["ports"] == [
            {
                "name": "gateway-ops",
                "port": merged["metrics"]["service"]["port"],
                "targetPort": "gateway-ops",
                "protocol": "TCP",
            }
        ]
        labels = only(manifests, "Deployment")["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
    container_ports = [p["containerPort"] for p in sidecar(pod_spec(manifests))["ports"]]
    assert merged["sidecar"]["port"] not in container_ports


def test_policy_checksum_rolls_pods_on_change(chart: helm.Chart) -> None:
    def annotations(values: dict[str, Any] | None) -> dict[str, str]:
        deployment = only(render(chart, values), "Deployment")
        found: dict[str, str] = deployment["spec"]["template"]["metadata"].get("annotations", {})
        return found

    roll = {"rollOnChange": True}
    rolled = annotations({"policy": roll})
    changed_text = chart.values["policy"]["content"].replace("drain_s: 20", "drain_s: 15")
    changed = annotations({"policy": {**roll, "content": changed_text}})
    assert len(rolled["checksum/policy"]) == 64
    assert rolled["checksum/policy"] != changed["checksum/policy"]
    assert rolled["prometheus.io/port"] == "8182"

    # Off by default: hot reload takes a changed policy in without a restart.
    hot_reload_only = annotations(None)
    assert "checksum/policy" not in hot_reload_only
    assert hot_reload_only["prometheus.io/port"] == "8182"
    assert "prometheus.io/scrape" not in annotations({"metrics": {"prometheusAnnotations": False}})


def test_existing_config_map_is_mounted_instead(chart: helm.Chart) -> None:
    values = {"policy": {"existingConfigMap": "planner-policy", "existingConfigMapKey": "p.yaml"}}
    manifests = render(chart, values)
    assert not [d for docs in manifests.values() for d in docs if d["kind"] == "ConfigMap"]
    spec = pod_spec(manifests)
    volume = next(v for v in spec["volumes"] if v["name"] == "egress-gateway-policy")
    assert volume["configMap"] == {
        "name": "planner-policy",
        "items": [{"key": "p.yaml", "path": "policy.yaml"}],
    }
    assert "checksum/policy" not in only(manifests, "Deployment")["spec"]["template"][
        "metadata"
    ].get("annotations", {})


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"sidecar": {"resources": "500m"}}, "/sidecar/resources"),
        ({"sidecar": {"port": "8181"}}, "/sidecar/port"),
        ({"sidecar": {"opsPort": 70000}}, "/sidecar/opsPort"),
        ({"sidecar": {"native": "yes"}}, "/sidecar/native"),
        ({"terminationGracePeriodSeconds": "30s"}, "/terminationGracePeriodSeconds"),
        ({"agent": {"resources": {"limits": {"memory": "lots of it"}}}}, "/agent/resources"),
        ({"vault": {"kubernetesAuth": {"enabled": True}}}, "/vault/kubernetesAuth"),
        ({"vault": {"adress": "http://vault:8200"}}, "/vault"),
        ({"image": {"digest": "latest"}}, "/image/digest"),
    ],
)
def test_wrong_values_fail_the_schema(
    chart: helm.Chart, values: dict[str, Any], where: str
) -> None:
    with pytest.raises(helm.HelmValuesError) as caught:
        chart.render(values, name="demo")
    assert where in str(caught.value)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"terminationGracePeriodSeconds": 20},
            "terminationGracePeriodSeconds (20) must exceed the policy's server.drain_s (20)",
        ),
        ({"sidecar": {"port": 8182}}, "sidecar.port and sidecar.opsPort must differ"),
        ({"policy": {"content": VAULT_POLICY}}, "set vault.kubernetesAuth.enabled=true"),
        (
            {"vault": {"kubernetesAuth": {"enabled": True, "role": "planner"}}},
            "the policy's secrets.vault.auth.method is not kubernetes",
        ),
        (
            {
                "policy": {"content": VAULT_POLICY},
                "terminationGracePeriodSeconds": 40,
                "vault": {"kubernetesAuth": {"enabled": True, "role": "other"}},
            },
            'vault.kubernetesAuth.role ("other") differs from the policy\'s',
        ),
        (
            {
                "policy": {"content": VAULT_POLICY.replace(TOKEN_PATH, "/var/run/t/token")},
                "terminationGracePeriodSeconds": 40,
                "vault": {"kubernetesAuth": {"enabled": True, "role": "planner"}},
            },
            'jwt_path ("/var/run/t/token") must be vault.kubernetesAuth.tokenPath',
        ),
    ],
)
def test_inconsistent_values_and_policy_fail_the_render(
    chart: helm.Chart, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmRenderError) as caught:
        chart.render(values, name="demo")
    assert message in str(caught.value)


def test_drain_default_matches_the_policy_model(chart: helm.Chart) -> None:
    # The chart assumes drain_s defaults to 20 s when the policy omits it.
    content = chart.values["policy"]["content"].replace("server:\n  drain_s: 20\n", "")
    assert "drain_s" not in content
    assert parse_policy(content).server.drain_s == DEFAULT_DRAIN_S == 20
    with pytest.raises(helm.HelmRenderError, match=r"server\.drain_s \(20\)"):
        chart.render(
            {"policy": {"content": content}, "terminationGracePeriodSeconds": 20}, name="d"
        )


#: An agent's Deployment, as docs/kubernetes.md shows it: two includes (initContainers,
#: volumes) with a native sidecar; a third (containers) only without one.
AGENT_DEPLOYMENT = """\
{{- $gw := dict "root" $ "gateway" (index $.Values "egress-gateway") }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ .Release.Name }}-planner
spec:
  selector:
    matchLabels: {app: planner}
  template:
    metadata:
      labels: {app: planner}
    spec:
      initContainers:
        {{- include "egress-gateway.initContainers" $gw | nindent 8 }}
      containers:
        - name: planner
          image: registry.example.com/planner:1.0
          securityContext: {runAsNonRoot: true, runAsUser: 20000}
        {{- include "egress-gateway.containers" $gw | nindent 8 }}
      volumes:
        {{- include "egress-gateway.volumes" $gw | nindent 8 }}
"""
AGENT_VALUES: dict[str, Any] = {
    "agent": {"enabled": False},
    "sidecar": {"native": True},
    "vault": copy.deepcopy(CUSTOM["vault"]),
    "policy": {"content": VAULT_POLICY},
    "terminationGracePeriodSeconds": 45,
}


@pytest.mark.parametrize(
    ("extra", "native"),
    [({}, True), ({"sidecar": {"native": False}, "egress": {"enforce": True}}, False)],
    ids=["native", "regular-enforced"],
)
def test_an_agent_chart_includes_the_sidecar_with_two_includes(
    tmp_path: Path, extra: dict[str, Any], native: bool
) -> None:
    values = copy.deepcopy(AGENT_VALUES)
    for key, value in extra.items():
        values[key] = {**values.get(key, {}), **value}
    parent = agent_chart(tmp_path / "planner", {"egress-gateway": values}, AGENT_DEPLOYMENT)
    with helm.Chart.load(parent) as agent:
        manifests = render(agent, kube_versions=KUBE_VERSIONS)

    assert kinds(manifests) == ["ConfigMap", "Deployment", "ServiceAccount"]  # no example agent
    spec = pod_spec(manifests)
    side = sidecar(spec)
    # Image tag from the dependency's appVersion, not the agent chart's.
    assert side["image"] == "egress-gateway:0.1.0"
    expected_init = ["egress-gateway-validate"]
    if not native:
        expected_init.append("egress-gateway-enforce")
    if native:
        expected_init.append("egress-gateway")
        assert side["restartPolicy"] == "Always"
        assert env_of(side)["GATEWAY_SHUTDOWN_ACCEPT_NEW_CALLS"] == "false"
    assert init_names(spec) == expected_init
    assert [c["name"] for c in spec["containers"]] == ["planner"] + (
        [] if native else ["egress-gateway"]
    )
    # The volumes name the dependency's own ConfigMap; the projected Vault token is
    # readable by the sidecar without the pod-level settings the agent chart left out.
    policy_volume = next(v for v in spec["volumes"] if v["name"] == "egress-gateway-policy")
    assert policy_volume["configMap"]["name"] == only(manifests, "ConfigMap")["metadata"]["name"]
    token = next(v for v in spec["volumes"] if "projected" in v)
    assert token["projected"]["defaultMode"] == 0o444
    assert "securityContext" not in spec
    mounted = {
        m["name"]
        for c in [side, container(spec, "egress-gateway-validate")]
        for m in c["volumeMounts"]
    }
    assert mounted <= {v["name"] for v in spec["volumes"]}


def test_the_older_named_templates_still_render_the_sidecar(tmp_path: Path) -> None:
    # Agent charts written against the first version of the chart keep working.
    old = AGENT_DEPLOYMENT.replace(
        'include "egress-gateway.initContainers"', 'include "egress-gateway.sidecarContainer"'
    ).replace('include "egress-gateway.volumes"', 'include "egress-gateway.sidecarVolumes"')
    parent = agent_chart(tmp_path / "planner", {"egress-gateway": AGENT_VALUES}, old)
    with helm.Chart.load(parent) as agent:
        spec = pod_spec(render(agent))
    assert init_names(spec) == ["egress-gateway"]
    assert sidecar(spec)["restartPolicy"] == "Always"


def test_the_repository_example_policy_renders_with_the_charts_vault_settings(
    chart: helm.Chart,
) -> None:
    example = (ROOT / "policies" / "example.yaml").read_text()
    values = {
        "policy": {"content": example},
        "vault": {"kubernetesAuth": {"enabled": True, "role": "planner-01"}},
    }
    spec = pod_spec(render(chart, values))
    token = next(
        m for m in sidecar(spec)["volumeMounts"] if m["name"] == "egress-gateway-vault-token"
    )
    assert parse_policy(example).secrets is not None
    jwt_path = parse_policy(example).secrets.vault.auth.jwt_path  # type: ignore[union-attr]
    assert str(Path(token["mountPath"]) / "token") == jwt_path == TOKEN_PATH


def test_a_policy_without_jwt_path_is_told_what_to_add(chart: helm.Chart) -> None:
    policy = VAULT_POLICY.replace(f", jwt_path: {TOKEN_PATH}", "")
    values = {**CUSTOM, "policy": {"content": policy}}
    with pytest.raises(helm.HelmRenderError) as caught:
        chart.render(values, name="demo")
    assert f"add jwt_path: {TOKEN_PATH} to secrets.vault.auth" in str(caught.value)
