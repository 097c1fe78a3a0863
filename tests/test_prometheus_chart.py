"""The chart's dashboard ConfigMap and PrometheusRule: rendered offline (helm-python-sdk),
the ConfigMap validated strictly (kubernetes-validate), the rule's groups held to the plain
rules file and checked by the real ``promtool``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "egress-gateway"
DASHBOARD = CHART / "files" / "dashboard.json"
ALERTS = CHART / "files" / "alerts.yaml"
KUBE_VERSION = kubernetes_validate.latest_version()
ENABLED: dict[str, Any] = {
    "grafanaDashboard": {
        "enabled": True,
        "annotations": {"grafana_folder": "AI agents"},
        "namespace": "monitoring",
    },
    "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
}


def manifests(chart: helm.Chart, values: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    out = chart.render(values, name="demo", namespace="agents")
    texts = [text for path, text in out.items() if path.endswith(".yaml")]  # not NOTES.txt
    docs = [d for text in texts for d in yaml.safe_load_all(text) if d]
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


def test_off_by_default(chart: helm.Chart) -> None:
    kinds = sorted(k.split("/")[0] for k in manifests(chart, None))
    assert kinds == ["ConfigMap", "Deployment", "ServiceAccount"]


def test_dashboard_config_map_carries_the_dashboard_for_the_grafana_sidecar(
    chart: helm.Chart,
) -> None:
    cm = manifests(chart, ENABLED)["ConfigMap/demo-egress-gateway-dashboard"]
    kubernetes_validate.validate(cm, KUBE_VERSION, strict=True)
    meta = cm["metadata"]
    assert meta["labels"]["grafana_dashboard"] == "1"
    assert meta["labels"]["app.kubernetes.io/name"] == "egress-gateway"
    assert meta["annotations"] == {"grafana_folder": "AI agents"}
    assert meta["namespace"] == "monitoring"
    dashboard = json.loads(cm["data"]["egress-gateway.json"])
    assert dashboard == json.loads(DASHBOARD.read_text())


def test_the_dashboard_is_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    graphs = [p for p in panels if p["type"] != "row"]
    assert len(graphs) >= 15
    for panel in graphs:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        assert panel["description"], panel["title"]
        for target in panel["targets"]:
            assert 'job=~"$job"' in target["expr"], panel["title"]
    titles = " ".join(p["title"] for p in graphs).lower()
    for need in ("errors", "latency", "tokens", "rate-limit", "breaker", "secret", "vault",
                 "audit", "memory"):  # fmt: skip
        assert need in titles, need
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource", "job", "target"]


def test_prometheus_rule_is_the_plain_rules_file(chart: helm.Chart, tmp_path: Path) -> None:
    rule = manifests(chart, ENABLED)["PrometheusRule/demo-egress-gateway"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert "namespace" not in rule["metadata"]  # the release's
    assert rule["spec"] == yaml.safe_load(ALERTS.read_text())
    # What the operator would load passes the real promtool.
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(yaml.safe_dump(rule["spec"]))
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("REQUIRE_PROMETHEUS") == "1":
            pytest.fail("promtool is required (REQUIRE_PROMETHEUS=1)")
        pytest.skip("promtool (Debian package prometheus) is not installed")
    check = subprocess.run(
        [promtool, "check", "rules", str(rendered)], capture_output=True, text=True, check=False
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 17 rules found" in check.stdout


def test_lint_passes_strict_with_both_enabled() -> None:
    report = helm.lint(CHART, ENABLED, strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"grafanaDashboard": {"enabled": "yes"}}, "/grafanaDashboard/enabled"),
        ({"grafanaDashboard": {"lables": {}}}, "/grafanaDashboard"),
        ({"prometheusRule": {"labels": {"release": 1}}}, "/prometheusRule/labels/release"),
        ({"prometheusRule": {"namespace": 5}}, "/prometheusRule/namespace"),
    ],
)
def test_wrong_values_fail_the_schema(
    chart: helm.Chart, values: dict[str, Any], where: str
) -> None:
    with pytest.raises(helm.HelmValuesError) as caught:
        chart.render(values, name="demo")
    assert where in str(caught.value)


def _alerts() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_every_alert_links_its_runbook_section() -> None:
    operations = (ROOT / "docs" / "operations.md").read_text()
    headings = {line.removeprefix("### ") for line in operations.splitlines()}
    base = "https://github.com/egress-gateway/egress-gateway/blob/main/docs/operations.md"
    for rule in _alerts():
        name = rule["alert"]
        assert rule["annotations"]["runbook_url"] == f"{base}#{name.lower()}", name
        assert name in headings, f"docs/operations.md has no '### {name}' runbook"


def test_alerts_page_once_per_outage_not_per_pod() -> None:
    for rule in _alerts():
        expr = " ".join(rule["expr"].split())
        assert " by (" in expr, rule["alert"]
        for by in expr.split(" by (")[1:]:
            assert "instance" not in by.split(")")[0], rule["alert"]


def test_the_runbook_base_is_a_value(chart: helm.Chart) -> None:
    values = {**ENABLED, "prometheusRule": {"enabled": True, "runbookBaseUrl": "https://wiki/ops/"}}
    rule = manifests(chart, values)["PrometheusRule/demo-egress-gateway"]
    urls = [r["annotations"]["runbook_url"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert urls
    assert all(u.startswith("https://wiki/ops#egressgateway") for u in urls)
