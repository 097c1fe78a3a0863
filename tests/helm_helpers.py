"""Rendering the Helm chart in tests: helm-python-sdk (Helm's own engine, no binary, no
cluster) and kubernetes-validate in strict mode (an unknown field is an error), against
every Kubernetes version the chart supports (Chart.yaml: kubeVersion >= 1.29)."""

from __future__ import annotations

import functools
import re
import shutil
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import yaml
from kubernetes_validate.utils import (
    SchemaNotFoundError,
    ValidationError,
    VersionNotSupportedError,
    all_versions,
    latest_version,
    major_minor,
    schema_contents,
)
from referencing import Registry, Resource

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "egress-gateway"
#: The newest Kubernetes version the installed kubernetes-validate bundles schemas for.
KUBE_VERSION = kubernetes_validate.latest_version()
#: The supported range (1.29: native sidecars on by default; 1.33: GA; 1.37: the newest
#: schemas kubernetes-validate bundles).
KUBE_VERSIONS = tuple(f"1.{minor}.0" for minor in range(29, 38))

Manifests = dict[str, list[Any]]


@functools.cache
def _schema_version(desired: str) -> str:
    """The newest bundled schema version not newer than ``desired``, as the library picks."""
    if major_minor(desired) > latest_version():
        raise VersionNotSupportedError(version=major_minor(desired))
    return [v for v in all_versions() if major_minor(v) <= major_minor(desired)][-1]


@functools.cache
def _definitions(schema_dir: str) -> Resource[Any]:
    """A version's ``_definitions.json`` (1.8 MB), which the library reads for every
    document, read once per process."""
    path = f"kubernetes-json-schema/{schema_dir}/_definitions.json"
    return Resource.from_contents(schema_contents(path, schema_dir))


@functools.cache
def _validator(schema_dir: str, schema_file: str) -> jsonschema.Draft202012Validator:
    """The library's validator for one schema file (its registry: the file, then the
    definitions), made once per process."""
    schema = schema_contents(f"kubernetes-json-schema/{schema_dir}/{schema_file}", schema_dir)
    registry: Registry[Any] = Resource.from_contents(schema) @ Registry()
    registry = _definitions(schema_dir) @ registry
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate(doc: dict[str, Any], version: str) -> None:
    """``kubernetes_validate.validate(doc, version, strict=True)``: the same schema files,
    validator and errors, each schema loaded once per process (``test_helm.py`` checks
    that both refuse what one refuses)."""
    schema_version = _schema_version(version)
    api_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", doc["apiVersion"])
    schema_file = f"{doc['kind'].lower()}-{api_version}.json"
    try:
        validator = _validator(f"v{schema_version}-local-strict", schema_file)
    except FileNotFoundError:
        raise SchemaNotFoundError(
            version=major_minor(version), kind=doc["kind"], api_version=doc["apiVersion"]
        ) from None
    try:
        validator.validate(doc)
    except jsonschema.ValidationError as error:
        raise ValidationError(error, version=major_minor(schema_version)) from None


def render(
    chart: helm.Chart,
    values: dict[str, Any] | None = None,
    kube_versions: tuple[str, ...] = (KUBE_VERSION,),
) -> Manifests:
    """Render and return {template file: [manifest, ...]}, each manifest strictly valid
    for every version of ``kube_versions``."""
    out = chart.render(values, name="demo", namespace="agents")
    manifests: Manifests = {}
    for path, text in out.items():
        if not path.endswith(".yaml"):
            continue
        docs = [d for d in yaml.safe_load_all(text) if d]
        for doc in docs:
            for version in kube_versions:
                validate(doc, version)
        manifests[Path(path).name] = docs
    return manifests


def kinds(manifests: Manifests) -> list[str]:
    return sorted(d["kind"] for docs in manifests.values() for d in docs)


def only(manifests: Manifests, kind: str) -> dict[str, Any]:
    found = [d for docs in manifests.values() for d in docs if d["kind"] == kind]
    assert len(found) == 1, kinds(manifests)
    return found[0]


def pod_spec(manifests: Manifests) -> dict[str, Any]:
    spec: dict[str, Any] = only(manifests, "Deployment")["spec"]["template"]["spec"]
    return spec


def container(spec: dict[str, Any], name: str) -> dict[str, Any]:
    found = [c for c in spec["containers"] + spec.get("initContainers", []) if c["name"] == name]
    assert len(found) == 1, [c["name"] for c in spec["containers"] + spec.get("initContainers", [])]
    return found[0]


def sidecar(spec: dict[str, Any]) -> dict[str, Any]:
    return container(spec, "egress-gateway")


def init_names(spec: dict[str, Any]) -> list[str]:
    return [c["name"] for c in spec.get("initContainers", [])]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def agent_chart(parent: Path, values: dict[str, Any], deployment: str) -> Path:
    """An agent's chart at ``parent`` that depends on this chart (copied to charts/), with
    ``values`` and its own ``deployment`` template; returns its path."""
    (parent / "templates").mkdir(parents=True)
    shutil.copytree(CHART, parent / "charts" / "egress-gateway")
    (parent / "Chart.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v2",
                "name": "planner",
                "version": "1.0.0",
                "appVersion": "1.0.0",
                "dependencies": [{"name": "egress-gateway", "version": "0.1.0", "repository": ""}],
            }
        )
    )
    (parent / "values.yaml").write_text(yaml.safe_dump(values))
    (parent / "templates" / "deployment.yaml").write_text(deployment)
    return parent
