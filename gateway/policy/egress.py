"""The egress decision (pure, no I/O): may this envelope go out, and to which URL?

Rules (docs/features/egress.md):

* ``target_system`` must be a policy target, else PERMISSION_DENIED.
* ``endpoint`` must be a clean absolute path: no scheme or host, no ``//``, ``\\``, ``@``,
  ``.`` or ``..`` segments, no percent-encoded dot, slash or backslash, no control
  characters (CR/LF included), no ``?`` or ``#``. Otherwise PERMISSION_DENIED with
  ``details.reason``; nothing is forwarded. So an endpoint can never change the scheme,
  host or port: the upstream URL is always the target's ``base_url`` plus the path.
* The path and method must match the target's endpoint allowlist. A call that only a
  ``mode: shadow`` rule allows is allowed, and :attr:`Decision.shadow_rule` names that
  rule (its "would deny" once the rule is removed: how a narrower allowlist is tried).
* The ``api_key_ref`` (or the target's ``default_ref``) must be one the target permits.
* For a target whose credential is a ``query_param``, a query-method envelope may not
  carry a parameter of that name, compared as the most lenient upstream would read it
  (:func:`same_query_name`), else PERMISSION_DENIED: the agent's value would go beside the
  secret (one upstream takes the first, another the last, PHP an array).
* A redirect ``Location`` is judged by :func:`location_problem` before it is resolved.
* Every address the sidecar connects to must be allowed by the policy's ``egress`` block
  (checked at DNS resolution by :mod:`gateway.upstream`, and here for IP literals).
"""

from __future__ import annotations

import functools
import ipaddress
import json
import re
import unicodedata
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import unquote_plus

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
#: A ``%`` not followed by two hex digits (RFC 3986, section 2.1: pct-encoded = "%"
#: HEXDIG HEXDIG). yarl sends it as ``%25`` and decodes what follows where it can
#: (``%%32e`` goes out as ``%252e``), so an upstream or proxy that decodes twice reads
#: ``.``, ``/`` or ``\`` where the allowlist saw none.
_MALFORMED_PERCENT: Final = re.compile(r"%(?![0-9A-Fa-f]{2})")
#: C0 and C1 controls and DEL: WHATWG URL parsers drop tab and newline where yarl
#: percent-encodes them, so the two would read another path.
_LOCATION_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f-\x9f]")
#: Bytes that are not UTF-8 reach us as lone surrogates (aiohttp decodes header values
#: with ``surrogateescape``); yarl silently drops them, so they would change the path.
_SURROGATE: Final = re.compile(r"[\ud800-\udfff]")
#: The authority of an absolute or scheme-relative reference (RFC 3986, section 3.2).
_AUTHORITY: Final = re.compile(r"^(?:[A-Za-z][A-Za-z0-9+.-]*:)?//([^/?#]*)")
#: A redirect ``Location`` longer than this is not followed (aiohttp's parser refuses
#: header lines past 8190 bytes anyway; a same-origin redirect needs far less).
MAX_LOCATION_CHARS: Final = 4096
_FOLLOWED_SCHEMES: Final = frozenset({"http", "https"})
_SCHEME: Final = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")


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
    #: The ``mode: shadow`` endpoint rule that alone allowed the call (its "would deny").
    shadow_rule: str | None = None


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
    if _MALFORMED_PERCENT.search(endpoint):
        return "malformed_percent_encoding"
    # "..;x" is ".." to Tomcat and Spring (path parameters are dropped before resolving).
    if any(seg.split(";", 1)[0] in (".", "..") for seg in endpoint.split("/")):
        return "dot_segment"
    return None


_remembered_endpoint_problem = functools.lru_cache(maxsize=1024)(_endpoint_problem)


def location_problem(location: str) -> str | None:
    """Why a redirect's ``Location`` header value (as aiohttp decoded it) is not followed
    whatever it points at, or None. Problems: ``empty``, ``too_long``,
    ``control_characters``, ``whitespace``, ``not_utf8``, ``backslash`` (WHATWG parsers
    read ``\\`` as ``/``, yarl as a path character: ``/\\evil.com`` is another host to a
    browser), ``scheme`` (not http or https: ``file:``, ``javascript:``, ``data:``),
    ``userinfo`` (aiohttp turns ``user:pw@`` into an ``Authorization`` header of the
    upstream's choosing). A Location yarl cannot parse (bad port, brackets) is the
    caller's ``invalid_url``. RFC 9110, section 10.2.2: a Location is a URI-reference."""
    if not location:
        return "empty"
    if len(location) > MAX_LOCATION_CHARS:
        return "too_long"
    if _LOCATION_CONTROL.search(location):
        return "control_characters"
    if any(ch.isspace() for ch in location):
        return "whitespace"
    if _SURROGATE.search(location):
        return "not_utf8"
    if "\\" in location:
        return "backslash"
    scheme = _SCHEME.match(location)
    if scheme is not None and scheme.group(1).lower() not in _FOLLOWED_SCHEMES:
        return "scheme"
    authority = _AUTHORITY.match(location)
    if authority is not None and "@" in authority.group(1):
        return "userinfo"
    return None


def resolve_location(values: list[str], url: URL, status: int) -> URL:
    """The Location header ``values`` of a ``status`` redirect from ``url``, resolved
    against it (RFC 3986, section 5). Raises PermissionDenied with ``details.problem``
    (:func:`location_problem`, ``repeated`` for several Location headers, ``invalid_url``
    for what yarl refuses, ``scheme``)."""
    problem = "repeated" if len(values) > 1 else location_problem(values[0])
    if problem is None:
        try:
            location = url.join(URL(values[0]))
            location.origin()  # a port or host yarl refuses raises only when used
        except ValueError:  # bad port, unbalanced or invalid brackets, IDNA
            problem = "invalid_url"
        else:
            if location.scheme in ("http", "https"):
                return location
            problem = "scheme"
    raise invalid_location(url, status, problem)


def redirect_hop(
    target: CompiledTarget,
    url: URL,
    locations: list[str],
    *,
    method: str,
    status: int,
    credential_param: str | None,
) -> URL | None:
    """The URL to follow a ``status`` redirect from ``url`` to, given its Location header
    values, or None to answer the 3xx as is (301/302/303 after a method other than GET
    or HEAD: resending a body to another path is a new call). The URL is the Location
    resolved, without fragment and without query items named like ``credential_param``
    (:func:`next_hop_url`). Raises PermissionDenied (``invalid_redirect_location``,
    ``userinfo``, ``redirect_outside_allowlist``) or EgressDenied (another origin);
    no message shows the Location."""
    location = resolve_location(locations, url, status)
    if location.origin() != target.origin:
        raise EgressDenied(
            f"{origin_label(url)} redirected ({status}) to another origin, "
            f"{origin_label(location)}; cross-origin redirects are never followed",
            details={"reason": "cross_origin_redirect", "location_origin": origin_label(location)},
            status_code=status,
        )
    if location.raw_user is not None or location.raw_password is not None:
        raise invalid_location(url, status, "userinfo")  # defence in depth
    if status in (301, 302, 303) and method not in ("GET", "HEAD"):
        return None
    base_path = target.base_url.path.rstrip("/")
    inside = location.path == base_path or location.path.startswith(base_path + "/")
    relative = location.path[len(base_path) :] if inside else ""
    if (
        not relative
        or endpoint_problem(location.raw_path) is not None
        or not target.allows(relative, method)
    ):
        raise PermissionDenied(
            f"{origin_label(url)} redirected to a path outside the target's allowlist",
            details={"reason": "redirect_outside_allowlist"},
            status_code=status,
        )
    return next_hop_url(location, credential_param)


def invalid_location(url: URL, status: int, problem: str) -> PermissionDenied:
    """The refusal of a redirect whose Location is not followed (never shown)."""
    return PermissionDenied(
        f"{origin_label(url)} redirected ({status}) with a Location the sidecar does not "
        f"follow ({problem.replace('_', ' ')}); nothing was sent to it",
        details={"reason": "invalid_redirect_location", "problem": problem},
        status_code=status,
    )


def next_hop_url(location: URL, credential_param: str | None) -> URL:
    """``location`` without its fragment and without query items an upstream could read
    as the credential's parameter (a redirect cannot choose the credential)."""
    raw_query = location.raw_query_string
    if raw_query and credential_param is not None:
        # "a=1;key=x" is two parameters to servers that also split on ";".
        raw_query = "&".join(
            item
            for item in raw_query.split("&")
            if not any(
                same_query_name(piece.split("=", 1)[0], credential_param)
                for piece in item.split(";")
            )
        )
    return URL.build(
        scheme=location.scheme,
        authority=location.raw_authority,
        path=location.raw_path,
        query_string=raw_query,
        encoded=True,
    )


#: Percent-decodings applied to a query name before comparing it (a server that decodes
#: twice reads ``k%2565y`` as ``key``); bounded, so a name cannot make it loop.
_NAME_DECODES: Final = 3


def _query_name_key(name: str) -> str:
    key = name
    for _ in range(_NAME_DECODES):
        decoded = unquote_plus(key)
        if decoded == key:
            break
        key = decoded
    # NUL ends a name in C parsers; "key[]" and "key[0]" are "key" to PHP and Rails,
    # which also read "." and " " as "_"; names differ only by case to ASP.NET.
    key = key.split("\x00", 1)[0].split("[", 1)[0]
    key = unicodedata.normalize("NFKC", key).casefold().strip()
    return key.replace(".", "_").replace(" ", "_")


_remembered_name_key = functools.lru_cache(maxsize=1024)(_query_name_key)


def same_query_name(name: str, credential_param: str) -> bool:
    """True if an upstream might read query parameter ``name`` (as the sidecar sends it,
    or as it appears in a Location) as ``credential_param``: equal after up to three
    percent-decodings, NFKC and case folding, with a NUL or ``[`` ending the name and
    ``.`` and spaces read as ``_`` (PHP). Errs towards True: a refusal is the cost."""
    if name == credential_param:
        return True
    # Agent-chosen names: only short ones are remembered, so memory stays bounded.
    key = _remembered_name_key(name) if len(name) <= 256 else _query_name_key(name)
    return key == _remembered_name_key(credential_param)


def decide(policy: PolicySet, request: ExternalCallRequest) -> Decision:
    """Check ``request`` against ``policy``. Raises :class:`PermissionDenied`."""
    # Each refusal is built by a helper below: the common path makes no extra call.
    target = policy.targets.get(request.target_system)
    if target is None:
        raise _unknown_target(policy, request)
    problem = endpoint_problem(request.endpoint)
    if problem is not None:
        raise _endpoint_not_a_path(target, problem)
    allowed = target.allows(request.endpoint, request.method)
    if not allowed:
        raise _endpoint_not_allowed(target, request, allowed)
    ref = request.api_key_ref
    credential = target.spec.credential
    if credential is None:
        if ref is not None:
            raise _ref_not_taken(target, ref)
    else:
        ref = ref or credential.default_ref or (credential.refs[0] if credential.refs else None)
        if ref is None:
            raise _ref_missing(target)
        if ref not in target.permitted_refs:
            raise _ref_not_permitted(target, ref)
    if credential is not None and credential.query_param is not None:
        _check_query_names(target, request, credential.query_param)
    for name, value in request.headers.items():
        if HEADER_VALUE_FORBIDDEN.search(value) or not HEADER_NAME.match(name):
            raise _invalid_header(name)
        if name.lower() not in target.forward_headers and name.lower() not in TRACE_HEADERS:
            raise _header_not_allowed(target, name)
    shadow_rule = target.shadow_rule(request.endpoint, request.method)
    # The same few (ref, rule) pairs call after call: each decided once per target; the
    # Decision is frozen, so calls share it. Both halves come from the policy (the ref is
    # one of the target's permitted refs), so the entries are bounded by it.
    decision: Decision | None = target.decisions.get((ref, shadow_rule))
    if decision is None:
        parsed = parse_ref(ref) if ref is not None else None
        decision = Decision(target, ref, parsed, shadow_rule)
        target.decisions[(ref, shadow_rule)] = decision
    return decision


def _unknown_target(policy: PolicySet, request: ExternalCallRequest) -> PermissionDenied:
    return PermissionDenied(
        f"target_system {request.target_system!r} is not in this sidecar's policy "
        f"(known: {', '.join(sorted(policy.targets))})",
        details={"reason": "unknown_target", "target_system": request.target_system},
    )


def _endpoint_not_a_path(target: CompiledTarget, problem: str) -> PermissionDenied:
    return PermissionDenied(
        f"endpoint must be a clean absolute path on target {target.name!r} "
        f"({problem.replace('_', ' ')}); the host comes from the policy only",
        details={"reason": "endpoint_not_a_path", "problem": problem},
    )


def _endpoint_not_allowed(
    target: CompiledTarget, request: ExternalCallRequest, allowed: bool | None
) -> PermissionDenied:
    """``allowed`` False: the path is listed but not for this method; None: not listed."""
    reason = "method_not_allowed" if allowed is False else "endpoint_not_allowed"
    return PermissionDenied(
        f"{request.method} {request.endpoint} is not allowed on target {target.name!r} "
        "by the policy's endpoint allowlist",
        details={"reason": reason, "method": request.method, "endpoint": request.endpoint},
    )


def _ref_not_taken(target: CompiledTarget, ref: str) -> PermissionDenied:
    return PermissionDenied(
        f"target {target.name!r} takes no credential; do not send api_key_ref",
        details={"reason": "ref_not_allowed", "api_key_ref": loggable_ref(ref)},
    )


def _ref_missing(target: CompiledTarget) -> PermissionDenied:
    return PermissionDenied(
        f"target {target.name!r} needs an api_key_ref (it has no default_ref)",
        details={"reason": "ref_missing"},
    )


def _ref_not_permitted(target: CompiledTarget, ref: str) -> PermissionDenied:
    shown = loggable_ref(ref)
    return PermissionDenied(
        f"api_key_ref {shown!r} may not be sent to target {target.name!r}",
        details={"reason": "ref_not_allowed", "api_key_ref": shown},
    )


def _invalid_header(name: str) -> InvalidPayload:
    return InvalidPayload(
        f"header {name!r}: names must be RFC 9110 tokens and values may not "
        "contain control characters (CR, LF, NUL...)",
        details={"reason": "invalid_header", "header": name[:64]},
    )


def _header_not_allowed(target: CompiledTarget, name: str) -> PermissionDenied:
    return PermissionDenied(
        f"header {name!r} may not be set by the agent on target {target.name!r} "
        "(the policy's forward_headers lists those that may)",
        details={"reason": "header_not_allowed", "header": name},
    )


def _check_query_names(target: CompiledTarget, request: ExternalCallRequest, param: str) -> None:
    names = list(request.query)
    if request.method in QUERY_METHODS:  # otherwise parameters go in the body
        names += request.parameters
    for name in names:
        if same_query_name(name, param):
            shown = name[:64]
            raise PermissionDenied(
                f"parameter {shown!r} may not be set by the agent on target {target.name!r}: "
                f"the sidecar sends the credential as query parameter {param!r}, and an "
                "upstream could read this name as that one",
                details={"reason": "credential_parameter", "parameter": shown},
            )


def upstream_url(target: CompiledTarget, endpoint: str) -> URL:
    """``base_url`` + ``endpoint`` (already checked by :func:`decide`), never another origin.

    Built once per target and endpoint (:meth:`CompiledTarget.remember_url`)."""
    known = target.known_url(endpoint)
    if known is not None:
        return known
    base = target.base_url
    # The endpoint is a path as sent on the wire: keep its percent-escapes ("%20" stays
    # "%20", not "%2520") and encode what must be (spaces, non-ASCII).
    url = base.with_path(base.raw_path.rstrip("/") + URL(endpoint).raw_path, encoded=True)
    if url.origin() != target.origin:  # defence in depth: cannot happen for a clean path
        raise PermissionDenied(
            "endpoint would leave the target's origin", details={"reason": "origin_escape"}
        )
    target.remember_url(endpoint, url)
    return url


def query_items(
    method: str, parameters: dict[str, Any], query: dict[str, Any] | None = None
) -> list[tuple[str, str]] | None:
    """The query string: ``parameters`` for GET/HEAD/DELETE, then the envelope's ``query``
    for any method (lists repeat the key); None when there is none for a method whose
    parameters are its body."""
    if method not in QUERY_METHODS:
        return _pairs(query) if query else None
    return _pairs(parameters) + (_pairs(query) if query else [])


def _pairs(parameters: dict[str, Any]) -> list[tuple[str, str]]:
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


#: A percent-escape (``endpoint_problem`` has refused malformed ones).
_ESCAPE: Final = re.compile(r"%([0-9A-Fa-f]{2})")
#: RFC 3986's unreserved characters less ``.`` (a dot escape is refused anyway): an
#: upstream reads ``%63`` as ``c``, so the name decodes them.
_UNRESERVED: Final = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_~")


def endpoint_name(endpoint: str) -> str:
    """The one name of a clean endpoint (:func:`endpoint_problem`) however the agent
    spells it, as the approval rules, tool caps and the repeated-call breaker match and
    count it: escapes of unreserved characters decoded and other escapes' hex digits
    upper-cased (RFC 3986, section 6.2.2), trailing slashes dropped (the allowlist reads
    ``/a/`` as ``/a``). What is sent upstream is the endpoint as given."""
    if "%" in endpoint:
        endpoint = _ESCAPE.sub(_normal_escape, endpoint)
    if endpoint.endswith("/") and endpoint != "/":
        endpoint = endpoint.rstrip("/") or "/"
    return endpoint


def _normal_escape(match: re.Match[str]) -> str:
    char = chr(int(match.group(1), 16))
    return char if char in _UNRESERVED else "%" + match.group(1).upper()


def unescaped_path(endpoint: str) -> str:
    """``endpoint`` with the escapes of unreserved characters and of ``:`` decoded (a
    path segment may hold ``:`` as it is, RFC 3986, section 3.3): what an upstream reads
    it as, spelt so that a provider's path rules (a Gemini ``models/{model}:{method}``)
    read it alike; sent as such. Other escapes are kept."""
    if "%" not in endpoint:
        return endpoint
    return _ESCAPE.sub(_path_escape, endpoint)


def _path_escape(match: re.Match[str]) -> str:
    char = chr(int(match.group(1), 16))
    return char if char in _UNRESERVED or char == ":" else match.group(0)
