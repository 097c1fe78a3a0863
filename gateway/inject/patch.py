"""What injection adds to a pod, as RFC 6902 JSON Patch operations (pure, no I/O but
:func:`load_template`).

The injection template is a JSON object the chart renders (``injector.enabled``) from its
named templates::

    {"initContainers": [Container, ...],   # validate, enforce, the native sidecar
     "containers": [Container, ...],       # the sidecar when not native, else []
     "volumes": [Volume, ...],             # what those containers mount
     "labels": {str: str},                 # what the NetworkPolicy and Service select
     "agentEnv": [EnvVar, ...],            # EGRESS_GATEWAY_URL for the agent's containers
     "policyVolume": "egress-gateway-policy"}

The pod's annotations choose the policy: ``egress-gateway.io/policy-configmap`` (default:
the chart's own policy ConfigMap) and ``egress-gateway.io/policy-key`` (default
``policy.yaml``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Final

INJECT_ANNOTATION: Final = "egress-gateway.io/inject"
POLICY_CONFIGMAP_ANNOTATION: Final = "egress-gateway.io/policy-configmap"
POLICY_KEY_ANNOTATION: Final = "egress-gateway.io/policy-key"
#: Set on an injected pod: a second invocation (reinvocationPolicy IfNeeded) adds nothing.
STATUS_ANNOTATION: Final = "egress-gateway.io/status"
INJECTED: Final = "injected"
#: The sidecar's container name: a pod that already has it (hand-written with the
#: chart's includes) is left as it is.
SIDECAR_NAME: Final = "egress-gateway"
TEMPLATE_KEYS: Final = frozenset(
    {"initContainers", "containers", "volumes", "labels", "agentEnv", "policyVolume"}
)

Json = dict[str, Any]


class InjectionError(ValueError):
    """An injection template or a pod that cannot be injected (the message says which)."""


def load_template(path: str | Path) -> Json:
    """Read and check an injection template (JSON, the shape in the module docstring).
    Raises InjectionError naming the file and the missing keys, OSError if unreadable."""
    try:
        template = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise InjectionError(f"{path}: not JSON: {exc}") from exc
    missing = TEMPLATE_KEYS - set(template) if isinstance(template, dict) else TEMPLATE_KEYS
    if missing:
        raise InjectionError(f"{path}: injection template lacks {', '.join(sorted(missing))}")
    return template  # type: ignore[no-any-return]


def _pointer(*parts: str | int) -> str:
    """A JSON Pointer (RFC 6901): ``~`` and ``/`` in a key escaped as ``~0`` and ``~1``."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def wants_injection(pod: Json) -> bool:
    """True when the pod asks for the sidecar and does not have it yet."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    if str(annotations.get(INJECT_ANNOTATION, "")).lower() != "true":
        return False
    if annotations.get(STATUS_ANNOTATION) == INJECTED:
        return False
    spec = pod.get("spec") or {}
    names = {c.get("name") for c in spec.get("containers", []) + spec.get("initContainers", [])}
    return SIDECAR_NAME not in names


def _volumes(template: Json, annotations: dict[str, str]) -> list[Json]:
    volumes: list[Json] = copy.deepcopy(template["volumes"])
    for volume in volumes:
        if volume.get("name") != template["policyVolume"] or "configMap" not in volume:
            continue
        name = annotations.get(POLICY_CONFIGMAP_ANNOTATION)
        if name:
            volume["configMap"]["name"] = name
        key = annotations.get(POLICY_KEY_ANNOTATION)
        if key:
            volume["configMap"]["items"] = [{"key": key, "path": "policy.yaml"}]
    return volumes


def _add_all(path: str, current: list[Any] | None, items: list[Any], *, first: bool) -> list[Json]:
    """Operations adding ``items`` to the list at ``path``: the whole list when the pod has
    none, else one by one, at the front (in order) or at the end."""
    if not items:
        return []
    if not current:
        return [{"op": "add", "path": path, "value": items}]
    return [
        {"op": "add", "path": f"{path}/{i if first else '-'}", "value": item}
        for i, item in enumerate(items)
    ]


def _add_keys(path: str, current: dict[str, str] | None, items: dict[str, str]) -> list[Json]:
    if current is None:
        return [{"op": "add", "path": path, "value": items}]
    return [{"op": "add", "path": path + _pointer(k), "value": v} for k, v in items.items()]


def _agent_env(spec: Json, env: list[Json]) -> list[Json]:
    """EGRESS_GATEWAY_URL (and the rest of ``agentEnv``) for each of the pod's own
    containers that does not set it already."""
    ops: list[Json] = []
    for index, container in enumerate(spec.get("containers", [])):
        have = {e.get("name") for e in container.get("env") or []}
        missing = [e for e in env if e["name"] not in have]
        path = _pointer("spec", "containers", index, "env")
        ops += _add_all(path, container.get("env"), missing, first=False)
    return ops


def injection_patch(pod: Json, template: Json) -> list[Json]:
    """The JSON Patch (RFC 6902 operations, all ``add``) that injects ``pod`` (a Pod
    object as the API server sends it) with ``template`` (see the module docstring); []
    when the pod does not ask for injection or already has the sidecar. Our init
    containers go first: the policy check and the netfilter rules must run before any of
    the agent's, and the native sidecar must serve before they start."""
    if not wants_injection(pod):
        return []
    metadata = pod.get("metadata") or {}
    annotations = metadata.get("annotations") or {}
    spec = pod.get("spec") or {}
    ops = _agent_env(spec, template["agentEnv"])
    ops += _add_all(
        "/spec/initContainers", spec.get("initContainers"), template["initContainers"], first=True
    )
    ops += _add_all("/spec/containers", spec.get("containers"), template["containers"], first=False)
    ops += _add_all(
        "/spec/volumes", spec.get("volumes"), _volumes(template, annotations), first=False
    )
    ops += _add_keys("/metadata/labels", metadata.get("labels"), template["labels"])
    ops += _add_keys("/metadata/annotations", annotations, {STATUS_ANNOTATION: INJECTED})
    return ops
