"""The seam between the call path and the outbound client: what one attempt sends and
what it gets back (plain data; no aiohttp here)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from gateway.policy import CompiledTarget
from gateway.secrets import Secret
from gateway.urls import URL

#: How an attempt failed below HTTP (the breaker and the retry rules use the same words):
#: ``connect`` (no connection was established), ``timeout`` (no answer in time), ``reset``
#: (the connection was lost, or the answer could not be read).
TransportKind = Literal["connect", "timeout", "reset"]


class TransportError(Exception):
    """An attempt failed below HTTP. ``kind`` is connect, timeout or reset; ``sent`` is
    True once the request headers went out (the upstream may have acted on it);
    ``answered`` once the upstream's status line arrived (the answer was lost after it
    began: a body cut, or not read in time)."""

    def __init__(
        self, kind: TransportKind, *, sent: bool, message: str, answered: bool = False
    ) -> None:
        super().__init__(message)
        self.kind: TransportKind = kind
        self.sent = sent
        self.answered = answered
        self.message = message


@dataclass(frozen=True, slots=True)
class Credential:
    """Where and how the secret goes: ``header`` (with ``format``) or ``query_param``."""

    secret: Secret
    header: str | None = None
    query_param: str | None = None
    format: str = "{secret}"


def _slot_setters(cls: type, names: tuple[str, ...]) -> tuple[Callable[[Any, Any], None], ...]:
    # Each slot's own descriptor: what object.__setattr__ ends at, without its lookups.
    return tuple(vars(cls)[name].__set__ for name in names)


@dataclass(frozen=True, slots=True, init=False)
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

    # Built once or more per call: a frozen dataclass's generated __init__ spends about
    # twice the instructions (an object.__setattr__ lookup and call per field); the
    # parameters are the fields', in order, with their defaults (tests/test_core_reuse.py).
    def __init__(
        self,
        target: CompiledTarget,
        method: str,
        url: URL,
        query: list[tuple[str, str]] | None,
        body: bytes | None,
        headers: dict[str, str] | None = None,
        credential: Credential | None = None,
        content_type: str = "application/json",
    ) -> None:
        s = _OUTBOUND_SETTERS
        s[0](self, target)
        s[1](self, method)
        s[2](self, url)
        s[3](self, query)
        s[4](self, body)
        s[5](self, {} if headers is None else headers)
        s[6](self, credential)
        s[7](self, content_type)


_OUTBOUND_SETTERS: Final = _slot_setters(
    OutboundRequest,
    ("target", "method", "url", "query", "body", "headers", "credential", "content_type"),
)


@dataclass(frozen=True, slots=True, init=False)
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
    #: ``body`` is then empty): an :class:`gateway.upstream.answers.UpstreamStream`.
    stream: Any = None
    #: True when ``body`` is a 2xx event stream whose connection broke mid-way, or that
    #: fell silent for its target's ``stream_idle_timeout_s`` (then ``idle`` too).
    cut: bool = False
    idle: bool = False

    def __init__(  # as OutboundRequest's, for the same reason
        self,
        status: int,
        reason: str,
        headers: Mapping[str, str],
        content_type: str | None,
        body: bytes,
        elapsed_s: float,
        stream: Any = None,
        cut: bool = False,
        idle: bool = False,
    ) -> None:
        s = _RESPONSE_SETTERS
        s[0](self, status)
        s[1](self, reason)
        s[2](self, headers)
        s[3](self, content_type)
        s[4](self, body)
        s[5](self, elapsed_s)
        s[6](self, stream)
        s[7](self, cut)
        s[8](self, idle)


_RESPONSE_SETTERS: Final = _slot_setters(
    UpstreamResponse,
    ("status", "reason", "headers", "content_type", "body", "elapsed_s", "stream", "cut", "idle"),
)
