"""The request the upstream gets, built from the envelope (pure, no I/O).

:func:`build` turns an allowed envelope and its compiled target into an
:class:`~gateway.upstream.OutboundRequest`:

* URL: the target's ``base_url`` plus the checked endpoint (:func:`gateway.policy.egress.
  upstream_url`), never another origin;
* ``parameters``: the query string for GET, HEAD and DELETE (lists repeat the key), a
  compact JSON body otherwise; an envelope ``body`` (base64) is sent as its bytes with its
  ``content_type`` instead; the envelope's ``query`` is added to the query string for any
  method; the digest of the body (or of the query) is what the audit record keeps;
* headers, later ones winning: the target's static headers, the agent's allowlisted
  ``headers`` (less trace headers), W3C ``traceparent``/``tracestate``
  (:mod:`gateway.tracing`), and the idempotency key under the target's header name.

:func:`with_credential` places the resolved secret as the target's ``credential`` says
(a header with its ``format``, or a query parameter); the secret itself is only revealed
by :mod:`gateway.upstream` when the request is written.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass, replace
from urllib.parse import urlencode

from gateway import fastjson
from gateway.envelope import QUERY_METHODS, ExternalCallRequest
from gateway.policy import CompiledTarget
from gateway.policy.egress import query_items, upstream_url
from gateway.secrets import ResolvedSecret
from gateway.tracing import TRACE_HEADERS, outbound_headers
from gateway.upstream import Credential, OutboundRequest

JSON = "application/json"


@dataclass(frozen=True, slots=True)
class BodyDigest:
    """What the audit record says of the bytes sent: their count and, with
    ``audit.payloads: summary``, their SHA-256 (hex); None with ``payloads: none``."""

    size: int
    sha256: str | None


def build(
    request: ExternalCallRequest,
    target: CompiledTarget,
    *,
    idempotency_key: str | None,
    digest: bool,
) -> tuple[OutboundRequest, BodyDigest]:
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
        body = fastjson.compact(request.parameters)
    sent = body if body is not None else urlencode(query or []).encode()
    agent_headers = {k: v for k, v in request.headers.items() if k.lower() not in TRACE_HEADERS}
    headers = {
        **spec.static_headers,
        **agent_headers,
        **outbound_headers(request.trace_id, request.headers),
    }
    if idempotency_key is not None and spec.idempotency is not None:
        headers[spec.idempotency.header] = idempotency_key
    outbound = OutboundRequest(
        target=target,
        method=request.method,
        url=url,
        query=query,
        body=body,
        headers=headers,
        content_type=content_type,
    )
    return outbound, BodyDigest(len(sent), hashlib.sha256(sent).hexdigest() if digest else None)


def credential(target: CompiledTarget, resolved: ResolvedSecret | None) -> Credential | None:
    """Where the target's ``credential`` puts ``resolved``; None without either."""
    spec = target.spec.credential
    if spec is None or resolved is None:
        return None
    return Credential(resolved.secret, spec.header, spec.query_param, spec.format)


def with_credential(
    outbound: OutboundRequest, target: CompiledTarget, resolved: ResolvedSecret | None
) -> OutboundRequest:
    """``outbound`` carrying the target's credential built from ``resolved``."""
    return replace(outbound, credential=credential(target, resolved))
