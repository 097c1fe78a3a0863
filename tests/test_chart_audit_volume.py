"""The chart's audit volume (``audit.volume``) for the policy's file sink: each kind
renders strictly valid for Kubernetes 1.29-1.37 (also through the injector), and the
chart refuses a rotation larger than the volume the file is on, an unbounded file, and
an audit path on no writable volume."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import helm_python as helm
import pytest

from tests.helm_helpers import CHART, KUBE_VERSIONS, pod_spec, render, sidecar

VERSIONS = KUBE_VERSIONS


def _policy(path: str, max_bytes: int | None, backup_count: int = 5, otlp: bool = False) -> str:
    audit = f"{{sink: file, path: {path}, backup_count: {backup_count}"
    audit += f", max_bytes: {max_bytes}" if max_bytes else ""
    audit += ", otlp: {endpoint: 'http://otel:4318/v1/logs'}" if otlp else ""
    return f"version: 1\nagent_id: a\nserver: {{drain_s: 20}}\ntargets: {{}}\naudit: {audit}}}\n"


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    helm.disable_logging()
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def _volume(chart: helm.Chart, values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    spec = pod_spec(render(chart, values, kube_versions=VERSIONS))
    (volume,) = [v for v in spec["volumes"] if v["name"] == "egress-gateway-audit"]
    (mount,) = [m for m in sidecar(spec)["volumeMounts"] if m["name"] == "egress-gateway-audit"]
    return volume, mount


def test_each_kind_of_audit_volume_renders(chart: helm.Chart) -> None:
    policy = {"content": _policy("/var/log/egress-gateway/audit.log", 100_000_000)}
    volume, mount = _volume(chart, {"policy": policy, "audit": {"volume": {"type": "emptyDir"}}})
    assert volume["emptyDir"] == {"sizeLimit": "1Gi"}
    assert mount["mountPath"] == "/var/log/egress-gateway"
    ephemeral = {"type": "ephemeral", "size": "2Gi", "storageClassName": "fast"}
    volume, _ = _volume(chart, {"policy": policy, "audit": {"volume": ephemeral}})
    claim = volume["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert claim["resources"]["requests"]["storage"] == "2Gi"
    assert claim["storageClassName"] == "fast"
    pvc = {"type": "persistentVolumeClaim", "claimName": "audit-logs"}
    volume, _ = _volume(chart, {"policy": policy, "audit": {"volume": pvc}})
    assert volume["persistentVolumeClaim"] == {"claimName": "audit-logs"}


def test_the_injected_pod_gets_the_audit_volume_too(chart: helm.Chart) -> None:
    policy = {"content": _policy("/var/log/egress-gateway/audit.log", 100_000_000)}
    values = {"policy": policy, "audit": {"volume": {"type": "ephemeral"}}}
    out = render(chart, {**values, "injector": {"enabled": True}}, kube_versions=VERSIONS)
    (config,) = out["injector-configmap.yaml"]
    assert '"name":"egress-gateway-audit"' in config["data"]["template.json"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"policy": {"content": _policy("/tmp/audit.log", 100_000_000)}},
            "the audit file's rotation (max_bytes 100000000 x 6 files = 600000000 bytes) is "
            "larger than its volume (sidecar.tmpSizeLimit: 67108864 bytes)",
        ),
        (
            {
                "policy": {"content": _policy("/var/log/egress-gateway/a.log", 200_000_000, 5)},
                "audit": {"volume": {"type": "ephemeral", "size": "1Gi"}},
            },
            "(max_bytes 200000000 x 6 files = 1200000000 bytes) is larger than its volume "
            "(audit.volume.size: 1073741824 bytes)",
        ),
        (
            {"policy": {"content": _policy("/tmp/audit.log", 8_000_000, 4, otlp=True)}},
            "(max_bytes 8000000 x 5 files = 40000000 bytes, plus the OTLP spool's 33554432) "
            "is larger than its volume (sidecar.tmpSizeLimit: 67108864 bytes)",
        ),
        (
            {"policy": {"content": _policy("/tmp/audit.log", None)}},
            "the policy's audit sink file has no max_bytes, so it grows without bound",
        ),
        (
            {"policy": {"content": _policy("/var/log/audit.log", 1000)}},
            "the policy's audit.path (/var/log/audit.log) is on no writable volume",
        ),
        (
            {"audit": {"volume": {"type": "persistentVolumeClaim"}}},
            "audit.volume.type persistentVolumeClaim needs audit.volume.claimName",
        ),
    ],
    ids=["tmp", "volume", "spool", "unbounded", "read-only", "no-claim"],
)
def test_the_chart_refuses_an_audit_file_its_volume_cannot_hold(
    chart: helm.Chart, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(Exception, match="egress-gateway: ") as caught:
        chart.render(values, name="demo", namespace="agents")
    assert message in str(caught.value)


def test_a_rotation_that_fits_renders(chart: helm.Chart) -> None:
    spec = pod_spec(render(chart, {"policy": {"content": _policy("/tmp/audit.log", 10_000_000)}}))
    assert "egress-gateway-audit" not in [v["name"] for v in spec["volumes"]]
