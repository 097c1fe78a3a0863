"""Sidecar injection: a mutating admission webhook (``egress-gateway inject``).

A pod annotated ``egress-gateway.io/inject: "true"`` gets what the chart's named
templates give an agent's pod (the native sidecar, the policy check and netfilter init
containers, their volumes, the labels the NetworkPolicy and metrics Service select), as
one RFC 6902 JSON Patch in an AdmissionReview v1 answer.

    patch.py    pure: (pod, injection template) -> JSON Patch operations
    server.py   the HTTPS endpoint the API server calls (aiohttp.web), TLS from files

The injection template is rendered by the chart (``injector.enabled``) from the same
named templates as a hand-written pod, so that the two cannot drift apart.
"""

from gateway.inject.patch import (
    INJECT_ANNOTATION,
    POLICY_CONFIGMAP_ANNOTATION,
    POLICY_KEY_ANNOTATION,
    STATUS_ANNOTATION,
    InjectionError,
    injection_patch,
    load_template,
)

__all__ = [
    "INJECT_ANNOTATION",
    "POLICY_CONFIGMAP_ANNOTATION",
    "POLICY_KEY_ANNOTATION",
    "STATUS_ANNOTATION",
    "InjectionError",
    "injection_patch",
    "load_template",
]
