"""The outbound client (the only user of the aiohttp client): ``types`` (what one attempt
sends and gets back), ``resolver`` (the SSRF guard in the connector), ``client``
(:class:`Upstream`: one session for the process, one attempt at a time), ``answers``
(reading an answer; the relayed event stream), ``failures`` (aiohttp's exceptions
translated), ``slots`` (each target's connections)."""

from gateway.upstream.client import (
    CONNECT_TIMEOUT_CAP_S,
    MAX_REDIRECTS,
    POOL_FULL,
    USER_AGENT,
    Upstream,
)
from gateway.upstream.resolver import EgressResolver, Resolver
from gateway.upstream.types import (
    Credential,
    OutboundRequest,
    TransportError,
    TransportKind,
    UpstreamResponse,
)

__all__ = [
    "CONNECT_TIMEOUT_CAP_S",
    "MAX_REDIRECTS",
    "POOL_FULL",
    "USER_AGENT",
    "Credential",
    "EgressResolver",
    "OutboundRequest",
    "Resolver",
    "TransportError",
    "TransportKind",
    "Upstream",
    "UpstreamResponse",
]
