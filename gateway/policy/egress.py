"""The egress decision (pure, no I/O): may this envelope go out, and to which URL?

Rules (the README's "Egress rules"):

* ``target_system`` must be a policy target, else PERMISSION_DENIED.
* ``endpoint`` must be a clean absolute path: no scheme or host, no ``//``, ``\\``, ``@``,
  ``.`` or ``..`` segments, no percent-encoded dot, slash or backslash, no control
  characters (CR/LF included), no ``?`` or ``#``. Otherwise PERMISSION_DENIED with
  ``details.reason``; nothing is forwarded. So an endpoint can never change the scheme,
  host or port: the upstream URL is always the target's ``base_url`` plus the path.
* The path and method must match the target's endpoint allowlist.
* The ``api_key_ref`` (or the target's ``default_ref``) must be one the target permits.
* Every address the sidecar connects to must be allowed by the policy's ``egress`` block
  (checked at DNS resolution by :mod:`gateway.upstream`, and here for IP literals).
"""

from __future__ import annotations

import functools
import ipaddress
import json
import re
from dataclasses import dataclass
from typing import Any, Final

from gateway.envelope import QUERY_METHODS, ExternalCallRequest
from gateway.errors import EgressDenied, InvalidPayload, PermissionDenied
from gateway.policy import (
    HEADER_NAME,
    HEADER_VALUE_FORBIDDEN,
    CompiledTarget,
    EgressSpec,
    PolicySet,
)
from gateway.policy.refs import InvalidSecretRef, SecretRef, parse_ref
from gateway.tracing import TRACE_HEADERS
from gateway.urls import URL

_ENCODED_FORBIDDEN: Final = re.compile(r"%(2e|2f|5c|0[0-9a-f]|1[0-9a-f]|7f|25)", re.IGNORECASE)
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]")


#: Shown in errors and audit records instead of an ``api_key_ref`` that is not a secret
#: reference: an agent that put a key where a reference goes must not have it copied.
NOT_A_REFERENCE: Final = "[not a secret reference]"


def loggable_ref(ref: str | None) -> str | None:
    """``ref`` if it parses as a secret reference (safe to log), else :data:`NOT_A_REFERENCE`."""
    if ref is None:
        return None
    try:
        parse_ref(ref)
    except InvalidSecretRef:
        return NOT_A_REFERENCE
    return ref


@dataclass(frozen=True, slots=True)
class Decision:
    """An allowed call: the compiled target and the secret reference to use, as the
    envelope or the target's ``default_ref`` wrote it (``api_key_ref``) and parsed
    (``ref``); both None for a target that takes no credential."""

    target: CompiledTarget
    api_key_ref: str | None
    ref: SecretRef | None = None


def endpoint_problem(endpoint: str) -> str | None:
    """Why ``endpoint`` is not a clean absolute path, or None if it is."""
    if len(endpoint) > _MAX_REMEMBERED_ENDPOINT:
        return _endpoint_problem(endpoint)  # agent-chosen and long: not kept in memory
    return _remembered_endpoint_problem(endpoint)


#: Endpoints of at most this many characters have their verdict remembered (pure; agents
#: call the same few endpoints): 1,024 of them, ~0.4 MB at most.
_MAX_REMEMBERED_ENDPOINT: Final = 256


def _endpoint_problem(endpoint: str) -> str | None:
    if _CONTROL.search(endpoint):
        return "control_characters"
    if not endpoint.startswith("/"):
        return "not_absolute_path" if "://" not in endpoint else "absolute_url"
    if endpoint.startswith("//") or "//" in endpoint:
        return "empty_segment"
    if "\\" in endpoint:
        return "backslash"
    if "@" in endpoint:
        return "at_sign"
    if "?" in endpoint or "#" in endpoint:
        return "query_or_fragment"
    if _ENCODED_FORBIDDEN.search(endpoint):
        return "encoded_separator"
    # "..;x" is ".." to Tomcat and Spring (path parameters are dropped before resolving).
    if any(seg.split(";", 1)[0] in (".", "..") for seg in endpoint.split("/")):
        return "dot_segment"
    return None


_remembered_endpoint_problem = functools.lru_cache(maxsize=1024)(_endpoint_problem)


def decide(policy: PolicySet, request: ExternalCallRequest) -> Decision:
    """Check ``request`` against ``policy``. Raises :class:`PermissionDenied`."""
    target = policy.targets.get(request.target_system)
    if target is None:
        raise PermissionDenied(
            f"target_system {request.target_system!r} is not in this sidecar's policy "
            f"(known: {', '.join(sorted(policy.targets))})",
            details={"reason": "unknown_target", "target_system": request.target_system},
        )
    problem = endpoint_problem(request.endpoint)
    if problem is not None:
        raise PermissionDenied(
            f"endpoint must be a clean absolute path on target {target.name!r} "
            f"({problem.replace('_', ' ')}); the host comes from the policy only",
            details={"reason": "endpoint_not_a_path", "problem": problem},
        )
    allowed = target.allows(request.endpoint, request.method)
    if not allowed:
        reason = "method_not_allowed" if allowed is False else "endpoint_not_allowed"
        raise PermissionDenied(
            f"{request.method} {request.endpoint} is not allowed on target {target.name!r} "
            "by the policy's endpoint allowlist",
            details={"reason": reason, "method": request.method, "endpoint": request.endpoint},
        )
    ref = request.api_key_ref
    credential = target.spec.credential
    if credential is None:
        if ref is not None:
            raise PermissionDenied(
                f"target {target.name!r} takes no credential; do not send api_key_ref",
                details={"reason": "ref_not_allowed", "api_key_ref": loggable_ref(ref)},
            )
    else:
        ref = ref or credential.default_ref
        if ref is None:
            raise PermissionDenied(
                f"target {target.name!r} needs an api_key_ref (it has no default_ref)",
                details={"reason": "ref_missing"},
            )
        if ref not in target.permitted_refs:
            shown = loggable_ref(ref)
            raise PermissionDenied(
                f"api_key_ref {shown!r} may not be sent to target {target.name!r}",
                details={"reason": "ref_not_allowed", "api_key_ref": shown},
            )
    for name, value in request.headers.items():
        if HEADER_VALUE_FORBIDDEN.search(value) or not HEADER_NAME.match(name):
            raise InvalidPayload(
                f"header {name!r}: names must be RFC 9110 tokens and values may not "
                "contain control characters (CR, LF, NUL...)",
                details={"reason": "invalid_header", "header": name[:64]},
            )
        if name.lower() not in target.forward_headers and name.lower() not in TRACE_HEADERS:
            raise PermissionDenied(
                f"header {name!r} may not be set by the agent on target {target.name!r} "
                "(the policy's forward_headers lists those that may)",
                details={"reason": "header_not_allowed", "header": name},
            )
    return Decision(target, ref, parse_ref(ref) if ref is not None else None)


def upstream_url(target: CompiledTarget, endpoint: str) -> URL:
    """``base_url`` + ``endpoint`` (already checked by :func:`decide`), never another origin."""
    base = target.base_url
    # The endpoint is a path as sent on the wire: keep its percent-escapes ("%20" stays
    # "%20", not "%2520") and encode what must be (spaces, non-ASCII).
    url = base.with_path(base.raw_path.rstrip("/") + URL(endpoint).raw_path, encoded=True)
    if url.origin() != target.origin:  # defence in depth: cannot happen for a clean path
        raise PermissionDenied(
            "endpoint would leave the target's origin", details={"reason": "origin_escape"}
        )
    return url


def query_items(method: str, parameters: dict[str, Any]) -> list[tuple[str, str]] | None:
    """The query string for GET/HEAD/DELETE (lists repeat the key), else None."""
    if method not in QUERY_METHODS:
        return None
    items: list[tuple[str, str]] = []
    for key, value in parameters.items():
        for item in value if isinstance(value, list) else [value]:
            items.append((key, _query_value(item)))
    return items


def _query_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return ""
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return str(value)


def origin_label(url: URL) -> str:
    """``scheme://host:port`` of ``url``: what audit records and errors may show."""
    return f"{url.scheme}://{url.host}:{url.explicit_port or url.port}"


def check_address(egress: EgressSpec, host: str, address: str) -> None:
    """Raise :class:`EgressDenied` unless the policy allows connecting to ``address``."""
    ip = ipaddress.ip_address(address)
    if not egress.allows(ip):
        raise EgressDenied(
            f"{host} resolves to {address}, which the egress policy does not allow "
            "(private, loopback, link-local and metadata addresses need egress.allow_cidrs)",
            details={"reason": "address_denied", "host": host, "address": address},
        )
