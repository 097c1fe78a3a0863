"""Sidecar injection: the chart's injector (``injector.enabled``) rendered offline, its
webhook (``gateway.inject``) served over TLS on loopback with the certificate the chart
made, AdmissionReview v1 requests answered with JSON Patches whose result validates
strictly (kubernetes-validate) for Kubernetes 1.29-1.37; re-invocation adds nothing."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import io
import json
import os
import signal
import socket
import ssl
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import helm_python as helm
import pytest
import yaml
from aiohttp import web

from gateway.cli import main
from gateway.inject import InjectionError, injection_patch, load_template
from gateway.inject.server import ReloadingTLS, build_app
from tests.helm_helpers import CHART, KUBE_VERSIONS, ROOT, validate

#: The range the injected pods are checked against (1.29-1.37).
POD_VERSIONS = KUBE_VERSIONS
HOST = "demo-egress-gateway-injector.agents.svc"

K8S_AUTH_POLICY = """\
version: 1
agent_id: planner
targets:
  httpbin: {base_url: "https://httpbin.org", endpoints: [{path: /get, methods: [GET]}]}
secrets:
  vault:
    address: https://vault.vault.svc:8200
    auth: {method: kubernetes, role: planner, jwt_path: /var/run/secrets/vault/token}
"""
#: Every part on: enforced egress, Vault Kubernetes auth, NetworkPolicy, metrics Service.
ENFORCED: dict[str, Any] = {
    "injector": {"enabled": True},
    "egress": {"enforce": True, "allow": [{"cidr": "10.20.0.0/16", "ports": [8080]}]},
    "networkPolicy": {"enabled": True},
    "metrics": {"service": {"enabled": True}},
    "vault": {"kubernetesAuth": {"enabled": True, "role": "planner"}},
    "policy": {"content": K8S_AUTH_POLICY},
}


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    helm.disable_logging()
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def _render(chart: helm.Chart, values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{kind/name: manifest}; every core manifest strictly valid for 1.29-1.37 (cert-manager's
    kinds are custom resources, whose schemas kubernetes-validate does not carry)."""
    out = chart.render(values, name="demo", namespace="agents")
    docs = [d for p, t in out.items() if p.endswith(".yaml") for d in yaml.safe_load_all(t) if d]
    for doc in docs:
        if not doc["apiVersion"].startswith("cert-manager.io/"):
            for version in POD_VERSIONS:
                validate(doc, version)
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


def _template(manifests: dict[str, dict[str, Any]], tmp_path: Path) -> dict[str, Any]:
    path = tmp_path / "template.json"
    path.write_text(manifests["ConfigMap/demo-egress-gateway-injector"]["data"]["template.json"])
    return load_template(path)


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def apply_patch(document: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 ``add`` (the only operation injection uses): into an object member, at a
    list index (inserting) or at ``-`` (appending). Anything else fails the test."""
    doc = copy.deepcopy(document)
    for op in ops:
        assert op["op"] == "add", op
        *parents, last = [_unescape(t) for t in op["path"].split("/")[1:]]
        node: Any = doc
        for token in parents:
            node = node[int(token)] if isinstance(node, list) else node[token]
        if isinstance(node, list):
            if last == "-":
                node.append(op["value"])
            else:
                assert 0 <= int(last) <= len(node), op["path"]
                node.insert(int(last), op["value"])
        else:
            assert isinstance(node, dict), op["path"]
            node[last] = op["value"]
    return doc


def agent_pod(**annotations: str) -> dict[str, Any]:
    """An agent pod as a Deployment's ReplicaSet creates it (no name yet, generateName)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": "planner-7d9c-",
            "namespace": "team-a",
            "labels": {"app": "planner"},
            "annotations": {"egress-gateway.io/inject": "true", **annotations},
        },
        "spec": {
            "serviceAccountName": "planner",
            "initContainers": [{"name": "fetch-model", "image": "busybox:1.37"}],
            "containers": [
                {"name": "planner", "image": "planner:1.4", "env": [{"name": "A", "value": "1"}]},
                {"name": "helper", "image": "helper:1.0"},
            ],
            "volumes": [{"name": "work", "emptyDir": {}}],
        },
    }


def review(
    pod: dict[str, Any], uid: str = "705ab4f5-6393-11e8-b7cc-42010a800002"
) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "team-a",
            "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
            "object": pod,
            "dryRun": False,
        },
    }


class Webhook:
    """The injector served over TLS on 127.0.0.1 with the chart's certificate; ``send``
    posts an AdmissionReview as the API server would, trusting the chart's CA."""

    def __init__(self, base: str, client: aiohttp.ClientSession, tls: ssl.SSLContext) -> None:
        self.base, self.client, self.tls = base, client, tls

    async def send(self, body: dict[str, Any]) -> dict[str, Any]:
        async with self.client.post(
            f"{self.base}/mutate", json=body, ssl=self.tls, server_hostname=HOST
        ) as resp:
            assert resp.status == 200, await resp.text()
            answer: dict[str, Any] = await resp.json()
            return answer


def _tls_files(manifests: dict[str, dict[str, Any]], tmp_path: Path) -> tuple[Path, Path, Path]:
    data = manifests["Secret/demo-egress-gateway-injector-tls"]["data"]
    paths = []
    for key in ("tls.crt", "tls.key", "ca.crt"):
        path = tmp_path / key
        path.write_bytes(base64.b64decode(data[key]))
        paths.append(path)
    return paths[0], paths[1], paths[2]


@pytest.fixture
async def webhook(chart: helm.Chart, tmp_path: Path) -> AsyncIterator[Webhook]:
    manifests = _render(chart, ENFORCED)
    cert, key, ca = _tls_files(manifests, tmp_path)
    runner = web.AppRunner(build_app(_template(manifests, tmp_path)))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ReloadingTLS(cert, key).context)
    await site.start()
    port = runner.addresses[0][1]
    client_tls = ssl.create_default_context(cafile=str(ca))
    async with aiohttp.ClientSession() as client:
        yield Webhook(f"https://127.0.0.1:{port}", client, client_tls)
    await runner.cleanup()


def _patch_of(answer: dict[str, Any]) -> list[dict[str, Any]]:
    response = answer["response"]
    assert response["allowed"] is True
    if "patch" not in response:
        return []
    assert response["patchType"] == "JSONPatch"
    ops: list[dict[str, Any]] = json.loads(base64.b64decode(response["patch"]))
    return ops


async def test_an_annotated_pod_gets_the_sidecar_and_stays_valid(
    webhook: Webhook, chart: helm.Chart
) -> None:
    pod = agent_pod(**{"egress-gateway.io/policy-configmap": "planner-policy"})
    answer = await webhook.send(review(pod))
    assert answer["apiVersion"] == "admission.k8s.io/v1"
    assert answer["response"]["uid"] == "705ab4f5-6393-11e8-b7cc-42010a800002"
    injected = apply_patch(pod, _patch_of(answer))
    injected["metadata"]["name"] = "planner-7d9c-x2k4q"
    for version in POD_VERSIONS:
        validate(injected, version)

    spec = injected["spec"]
    names = [c["name"] for c in spec["initContainers"]]
    assert names == [
        "egress-gateway-validate",
        "egress-gateway-enforce",
        "egress-gateway",
        "fetch-model",
    ]
    assert spec["initContainers"][2]["restartPolicy"] == "Always"  # the native sidecar
    assert [c["name"] for c in spec["containers"]] == ["planner", "helper"]
    for agent in spec["containers"]:
        assert {"name": "EGRESS_GATEWAY_URL", "value": "http://127.0.0.1:8181"} in agent["env"]
    assert {"name": "A", "value": "1"} in spec["containers"][0]["env"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["egress-gateway-policy"]["configMap"]["name"] == "planner-policy"
    assert volumes["work"] == {"name": "work", "emptyDir": {}}
    token = volumes["egress-gateway-vault-token"]["projected"]["sources"][0]
    assert token["serviceAccountToken"]["audience"] == "vault"  # the pod's own account's

    # What the chart's NetworkPolicy and metrics Service select is on the pod.
    manifests = _render(chart, ENFORCED)
    selected = manifests["NetworkPolicy/demo-egress-gateway-egress"]["spec"]["podSelector"]
    assert selected["matchLabels"].items() <= injected["metadata"]["labels"].items()
    service = manifests["Service/demo-egress-gateway-metrics"]["spec"]["selector"]
    assert service.items() <= injected["metadata"]["labels"].items()
    assert injected["metadata"]["labels"]["app"] == "planner"


async def test_a_second_invocation_adds_nothing(webhook: Webhook) -> None:
    pod = agent_pod()
    injected = apply_patch(pod, _patch_of(await webhook.send(review(pod))))
    assert injected["metadata"]["annotations"]["egress-gateway.io/status"] == "injected"
    assert _patch_of(await webhook.send(review(injected))) == []
    # A pod whose sidecar came from the chart's includes is left alone too.
    hand_written = agent_pod()
    hand_written["spec"]["initContainers"].append({"name": "egress-gateway", "image": "x"})
    assert _patch_of(await webhook.send(review(hand_written))) == []


async def test_a_pod_without_the_annotation_or_lists_is_handled(webhook: Webhook) -> None:
    plain = agent_pod()
    del plain["metadata"]["annotations"]["egress-gateway.io/inject"]
    assert _patch_of(await webhook.send(review(plain))) == []
    bare: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "bare", "annotations": {"egress-gateway.io/inject": "true"}},
        "spec": {"containers": [{"name": "agent", "image": "agent:1"}]},
    }
    injected = apply_patch(bare, _patch_of(await webhook.send(review(bare))))
    for version in POD_VERSIONS:
        validate(injected, version)
    assert [c["name"] for c in injected["spec"]["initContainers"]][-1] == "egress-gateway"
    assert "egress-gateway/instance" in injected["metadata"]["labels"]


async def test_what_is_not_an_admission_review_is_a_400(webhook: Webhook) -> None:
    async with webhook.client.post(
        f"{webhook.base}/mutate", data=b"{}", ssl=webhook.tls, server_hostname=HOST
    ) as resp:
        assert resp.status == 400
        assert "AdmissionReview" in (await resp.json())["error"]


def test_the_policy_key_annotation_picks_the_key(chart: helm.Chart, tmp_path: Path) -> None:
    template = _template(_render(chart, {"injector": {"enabled": True}}), tmp_path)
    pod = agent_pod(**{"egress-gateway.io/policy-key": "agent.yaml"})
    injected = apply_patch(pod, injection_patch(pod, template))
    volume = next(v for v in injected["spec"]["volumes"] if v["name"] == "egress-gateway-policy")
    assert volume["configMap"]["name"] == "demo-egress-gateway-policy"  # the chart's own
    assert volume["configMap"]["items"] == [{"key": "agent.yaml", "path": "policy.yaml"}]
    # Without egress.enforce there is no netfilter container; the sidecar is native anyway.
    names = [c["name"] for c in injected["spec"]["initContainers"]]
    assert names == ["egress-gateway-validate", "egress-gateway", "fetch-model"]


def test_a_broken_template_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "template.json"
    path.write_text('{"initContainers": []}')
    with pytest.raises(InjectionError, match="lacks agentEnv, containers, labels"):
        load_template(path)


def test_the_webhook_fails_closed_in_labelled_namespaces_only(chart: helm.Chart) -> None:
    manifests = _render(chart, {"injector": {"enabled": True}})
    config = manifests["MutatingWebhookConfiguration/demo-egress-gateway-injector-agents"]
    (hook,) = config["webhooks"]
    assert hook["failurePolicy"] == "Fail"
    assert hook["reinvocationPolicy"] == "IfNeeded"
    assert hook["namespaceSelector"] == {"matchLabels": {"egress-gateway.io/injection": "enabled"}}
    assert hook["clientConfig"]["service"] == {
        "name": "demo-egress-gateway-injector",
        "namespace": "agents",
        "path": "/mutate",
        "port": 443,
    }
    secret = manifests["Secret/demo-egress-gateway-injector-tls"]
    assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    # The injector's own pods are never sent to it (they could not start otherwise).
    deployment = manifests["Deployment/demo-egress-gateway-injector"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    (expression,) = hook["objectSelector"]["matchExpressions"]
    assert expression == {"key": "egress-gateway.io/injector", "operator": "DoesNotExist"}
    assert "egress-gateway.io/injector" in labels


def test_cert_manager_makes_the_certificate(chart: helm.Chart) -> None:
    values = {"injector": {"enabled": True, "certificate": {"source": "cert-manager"}}}
    manifests = _render(chart, values)
    assert "Secret/demo-egress-gateway-injector-tls" not in manifests
    cert = manifests["Certificate/demo-egress-gateway-injector"]
    assert cert["spec"]["secretName"] == "demo-egress-gateway-injector-tls"
    assert HOST in cert["spec"]["dnsNames"]
    assert cert["spec"]["issuerRef"]["name"] == "demo-egress-gateway-injector"
    assert manifests["Issuer/demo-egress-gateway-injector"]["spec"] == {"selfSigned": {}}
    config = manifests["MutatingWebhookConfiguration/demo-egress-gateway-injector-agents"]
    annotation = config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
    assert annotation == "agents/demo-egress-gateway-injector"
    assert "caBundle" not in config["webhooks"][0]["clientConfig"]
    named = {"source": "cert-manager", "issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer"}}
    manifests = _render(chart, {"injector": {"enabled": True, "certificate": named}})
    assert "Issuer/demo-egress-gateway-injector" not in manifests
    ref = manifests["Certificate/demo-egress-gateway-injector"]["spec"]["issuerRef"]
    assert ref == {"name": "corp-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}


def test_the_injector_is_off_by_default(chart: helm.Chart) -> None:
    assert not [k for k in _render(chart, {}) if "injector" in k]


async def test_a_renewed_certificate_is_served_without_a_restart(
    chart: helm.Chart, tmp_path: Path
) -> None:
    first = _render(chart, {"injector": {"enabled": True}})
    cert, key, ca = _tls_files(first, tmp_path)
    tls = ReloadingTLS(cert, key)
    runner = web.AppRunner(build_app(_template(first, tmp_path)))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls.context).start()
    port = runner.addresses[0][1]
    renewed = tmp_path / "renewed"
    renewed.mkdir()
    new_cert, new_key, new_ca = _tls_files(_render(chart, {"injector": {"enabled": True}}), renewed)
    try:
        connector = aiohttp.TCPConnector(force_close=True)  # a handshake per check
        async with aiohttp.ClientSession(connector=connector) as client:

            async def served_by(ca_file: Path) -> bool:
                trust = ssl.create_default_context(cafile=str(ca_file))
                url = f"https://127.0.0.1:{port}/healthz"
                try:
                    async with client.get(url, ssl=trust, server_hostname=HOST) as resp:
                        return resp.status == 200
                except aiohttp.ClientConnectorCertificateError:
                    return False

            assert await served_by(ca)
            assert not await served_by(new_ca)
            stamp = cert.stat().st_mtime_ns
            key.write_bytes(new_key.read_bytes())
            cert.write_bytes(new_cert.read_bytes())
            os.utime(cert, ns=(stamp + 10**9, stamp + 10**9))  # a coarse clock may not move
            assert await served_by(new_ca)
            assert not await served_by(ca)
    finally:
        await runner.cleanup()


def test_the_inject_command_refuses_a_broken_template(tmp_path: Path) -> None:
    path = tmp_path / "template.json"
    path.write_text("not json")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["inject", "--template", str(path), "--tls-cert", "c", "--tls-key", "k"])
    assert code == 1
    assert err.getvalue().startswith(f"egress-gateway inject: {path}: not JSON")


@pytest.mark.parametrize("source", ["helm", "cert-manager"])
def test_lint_passes_strict_with_the_injector(source: str) -> None:
    values = {**ENFORCED, "injector": {"enabled": True, "certificate": {"source": source}}}
    report = helm.lint(CHART, values, strict=True, kube_version="v1.29.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


async def test_the_inject_command_serves_and_stops_on_sigterm(
    chart: helm.Chart, tmp_path: Path
) -> None:
    manifests = _render(chart, {"injector": {"enabled": True}})
    cert, key, ca = _tls_files(manifests, tmp_path)
    template = tmp_path / "template.json"
    template.write_text(json.dumps(_template(manifests, tmp_path)))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "inject", "--template", str(template),
        "--tls-cert", str(cert), "--tls-key", str(key), "--host", "127.0.0.1",
        "--port", str(port), cwd=ROOT,
    )  # fmt: skip
    trust = ssl.create_default_context(cafile=str(ca))
    try:
        async with aiohttp.ClientSession() as client:

            async def healthy() -> bool:
                try:
                    url = f"https://127.0.0.1:{port}/healthz"
                    async with client.get(url, ssl=trust, server_hostname=HOST) as resp:
                        return resp.status == 200
                except aiohttp.ClientConnectionError:
                    return False

            for _ in range(400):  # bounded: the process imports and binds
                if await healthy() or proc.returncode is not None:
                    break
                await asyncio.sleep(0.025)
            assert await healthy()
            hook = Webhook(f"https://127.0.0.1:{port}", client, trust)
            pod = agent_pod()
            assert _patch_of(await hook.send(review(pod)))  # injected
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 15)
    assert code == 0  # a clean stop on SIGTERM
