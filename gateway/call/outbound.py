"""The request the upstream gets, built from the envelope (pure, no I/O).

:func:`build` turns an allowed envelope and its compiled target into a :class:`Draft`
of the :class:`~gateway.upstream.OutboundRequest`:

* URL: the target's ``base_url`` plus the checked endpoint (:func:`gateway.policy.egress.
  upstream_url`), never another origin;
* ``parameters``: the query string for GET, HEAD and DELETE (lists repeat the key), a
  compact JSON body otherwise; an envelope ``body`` (base64) is sent as its bytes with its
  ``content_type`` instead; the envelope's ``query`` is added to the query string for any
  method; the digest of the body (or of the query) is what the audit record keeps;
* headers, later ones winning: the target's static headers, the agent's allowlisted
  ``headers`` (less trace headers), W3C ``traceparent``/``tracestate``
  (:mod:`gateway.tracing`), and the idempotency key under the target's header name.

:func:`with_credential` makes the request of the draft, with the resolved secret placed
as the target's ``credential`` says (:class:`Credentials`: a header with its ``format``,
or a query parameter);
the secret itself is only revealed by :mod:`gateway.upstream` when the request is written.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlencode

from gateway import fastjson
from gateway.envelope import QUERY_METHODS, ExternalCallRequest
from gateway.policy import CompiledTarget
from gateway.policy.egress import query_items, upstream_url
from gateway.secrets import ResolvedSecret, Secret
from gateway.tracing import TRACE_HEADERS, outbound_headers
from gateway.upstream import Credential, OutboundRequest
from gateway.urls import URL

JSON = "application/json"


@dataclass(frozen=True, slots=True)
class BodyDigest:
    """What the audit record says of the bytes sent: their count and, with
    ``audit.payloads: summary``, their SHA-256 (hex); None with ``payloads: none``."""

    size: int
    sha256: str | None


@dataclass(slots=True)
class Draft:
    """An outbound request before its credential: what :func:`build` makes of the
    envelope, finished by :func:`with_credential` into the one frozen
    :class:`~gateway.upstream.OutboundRequest` of the call (the secret is resolved in
    between). The fields are the request's; ``headers`` may still be added to."""

    target: CompiledTarget
    method: str
    url: URL
    query: list[tuple[str, str]] | None
    body: bytes | None
    headers: dict[str, str]
    content_type: str


def build(
    request: ExternalCallRequest,
    target: CompiledTarget,
    *,
    idempotency_key: str | None,
    digest: bool,
) -> tuple[Draft, BodyDigest]:
    """The outbound request of ``request`` on ``target`` (no credential yet) and the
    digest of its body or query. ``digest`` False skips the hash (``payloads: none``).
    Raises :class:`~gateway.errors.PermissionDenied` if the URL would leave the target's
    origin (cannot happen for an endpoint :func:`gateway.policy.egress.decide` allowed)."""
    spec = target.spec
    url = upstream_url(target, request.endpoint)
    query = query_items(request.method, request.parameters, request.query)
    body = None
    content_type = JSON
    if request.body is not None:
        body = base64.b64decode(request.body.base64)  # checked at intake
        content_type = request.body.content_type
    elif request.method not in QUERY_METHODS:
        body = fastjson.compact(request.parameters, held=True)
    sent = body if body is not None else urlencode(query or []).encode()
    given = request.headers
    headers = {
        **spec.static_headers,
        **({k: v for k, v in given.items() if k.lower() not in TRACE_HEADERS} if given else {}),
        **outbound_headers(request.trace_id, given),
    }
    if idempotency_key is not None and spec.idempotency is not None:
        headers[spec.idempotency.header] = idempotency_key
    draft = Draft(target, request.method, url, query, body, headers, content_type)
    return draft, BodyDigest(len(sent), hashlib.sha256(sent).hexdigest() if digest else None)


class Credentials:
    """The credential of each target's secret, built once per secret: a cached secret (a
    ``file://`` whose stamp is unchanged, a live Vault entry) is the same object call
    after call, and so is its :class:`~gateway.upstream.Credential` (which memoises the
    header it writes). The memo exists for that: no rebuild per call. Kept per target
    name with the target and the secret it was built from (held, so neither identity can
    be reused by a new object), it lives on the pipeline: a reload builds a new one and a
    closed pipeline drops it, so no secret outlives its policy or the sidecar; bounded
    by the targets of one policy (:data:`MAX_BUILT` past that: cleared)."""

    __slots__ = ("_built",)

    def __init__(self) -> None:
        self._built: dict[str, tuple[CompiledTarget, Secret, Credential]] = {}

    def of(self, target: CompiledTarget, resolved: ResolvedSecret | None) -> Credential | None:
        """Where the target's ``credential`` puts ``resolved``; None without either."""
        spec = target.spec.credential
        if spec is None or resolved is None:
            return None
        built = self._built
        last = built.get(target.name)
        secret = resolved.secret
        if last is not None and last[0] is target and last[1] is secret:
            return last[2]
        made = Credential(secret, spec.header, spec.query_param, spec.format)
        if len(built) >= MAX_BUILT:
            built.clear()
        built[target.name] = (target, secret, made)
        return made


#: The targets :class:`Credentials` keeps at most (a policy has far fewer).
MAX_BUILT: Final = 1024


def credential(target: CompiledTarget, resolved: ResolvedSecret | None) -> Credential | None:
    """Where the target's ``credential`` puts ``resolved`` (built anew; :class:`Credentials`
    keeps it per secret); None without either."""
    spec = target.spec.credential
    if spec is None or resolved is None:
        return None
    return Credential(resolved.secret, spec.header, spec.query_param, spec.format)


def with_credential(
    draft: Draft,
    target: CompiledTarget,
    resolved: ResolvedSecret | None,
    memo: Credentials | None = None,
) -> OutboundRequest:
    """The request of ``draft``, carrying the target's credential built from ``resolved``
    (none without one; the one ``memo`` keeps for that secret, if given): built once per
    call, after the secret is resolved."""
    return OutboundRequest(
        draft.target,
        draft.method,
        draft.url,
        draft.query,
        draft.body,
        draft.headers,
        memo.of(target, resolved) if memo is not None else credential(target, resolved),
        draft.content_type,
    )
