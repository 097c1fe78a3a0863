"""The seam between the call path and the outbound client: what one attempt sends and
what it gets back (plain data; no aiohttp here)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.policy import CompiledTarget
from gateway.secrets import Secret
from gateway.urls import URL

#: How an attempt failed below HTTP (the breaker and the retry rules use the same words):
#: ``connect`` (no connection was established), ``timeout`` (no answer in time), ``reset``
#: (the connection was lost, or the answer could not be read).
TransportKind = Literal["connect", "timeout", "reset"]


class TransportError(Exception):
    """An attempt failed below HTTP. ``kind`` is connect, timeout or reset; ``sent`` is
    True once the request headers went out (the upstream may have acted on it)."""

    def __init__(self, kind: TransportKind, *, sent: bool, message: str) -> None:
        super().__init__(message)
        self.kind: TransportKind = kind
        self.sent = sent
        self.message = message


@dataclass(frozen=True, slots=True)
class Credential:
    """Where and how the secret goes: ``header`` (with ``format``) or ``query_param``."""

    secret: Secret
    header: str | None = None
    query_param: str | None = None
    format: str = "{secret}"


@dataclass(frozen=True, slots=True)
class OutboundRequest:
    """One call as the upstream gets it (built by :mod:`gateway.call.outbound`), the seam
    between the call path and this module.

    ``url`` is the target's ``base_url`` plus the checked endpoint (origin = the target's);
    ``query`` the query items (None when there are none); ``body`` the bytes to send
    (compact JSON, or an upload's) with ``content_type``, or None; ``headers`` what goes out
    besides ``User-Agent``, ``Content-Type`` and the credential, which :meth:`Upstream.send`
    adds last, so nothing in ``headers`` can replace it.
    """

    target: CompiledTarget
    method: str
    url: URL
    query: list[tuple[str, str]] | None
    body: bytes | None
    headers: dict[str, str] = field(default_factory=dict)
    credential: Credential | None = None
    #: The media type of ``body``: JSON, or an upload's own (envelope ``body``).
    content_type: str = "application/json"


@dataclass(frozen=True, slots=True)
class UpstreamResponse:
    """The upstream's final answer to one attempt (after same-origin redirects).

    ``body`` is complete and decoded (gzip/deflate), at most ``max_response_bytes``;
    ``headers`` are aiohttp's case-insensitive mapping; ``elapsed_s`` is the attempt's
    wall time in seconds, from sending to the last body byte.
    """

    status: int
    reason: str
    headers: Mapping[str, str]  # aiohttp's CIMultiDictProxy: case-insensitive names
    content_type: str | None
    body: bytes
    elapsed_s: float
    #: With ``Upstream.send(stream=True)``, a 2xx event stream still to be read (its
    #: ``body`` is then empty): an :class:`gateway.upstream.client.UpstreamStream`.
    stream: Any = None
    #: True when ``body`` is a 2xx event stream whose connection broke mid-way.
    cut: bool = False
