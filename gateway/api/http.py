"""The interface every API the sidecar speaks implements, the handler that drives it, and
the request's side of HTTP (design.md, "Package layout, round two").

An API module (:mod:`gateway.api.envelope`, :mod:`gateway.api.proxy`,
:mod:`gateway.api.mcp`) turns one request into one :class:`Exchange`: it runs the call
and describes, as data, the answer (:class:`Answer`), its refusal, and the framing of a
relayed stream (:class:`Head`, :meth:`Exchange.frame`, :meth:`Exchange.end`).
:func:`handler` drives an exchange and hands what it describes to the one answer writer,
:mod:`gateway.api.writer` (:func:`~gateway.api.writer.respond`,
:class:`~gateway.api.writer.Stream`), which alone writes to the agent's connection, so
every API gets the same guarantees without remembering them: every header and body byte
scrubbed of the secrets the sidecar holds, a large answer written within a bound, a
stream within the call's deadline.

It also reads a request's body by the listener's rules (:meth:`Incoming.read`), the same
for every API, each byte charged to the memory budget of the bodies in flight before it
is held (:mod:`gateway.api.admission`; made by :func:`charge` and given back by the
calls application's middleware once the answer is written), so that every API refuses
what does not fit alike, through its own refusal shape; and it matches the routes of
the API families (:class:`TargetRoute`, :func:`edge_answer`). An API module never sees
aiohttp: its request is read here (:class:`Incoming`), its answer written by the writer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, NoReturn, Protocol
from urllib.parse import unquote

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError

from gateway.agents.identity import Agents, Identity
from gateway.api.admission import COPIES, ByteBudget, Charge, held_bytes
from gateway.api.writer import Stream, respond
from gateway.audit import get_logger
from gateway.call.relay import Relay
from gateway.envelope import ExternalCallResponse
from gateway.errors import GatewayError, InternalError, InvalidPayload
from gateway.policy import PolicySet

#: The whole body must arrive within this long of its headers, or the answer is 408
#: (INVALID_PAYLOAD, ``details.reason: body_timeout``) and the connection is closed.
BODY_TIMEOUT_S: Final = 30.0
BODY_TIMEOUT_KEY: Final = web.AppKey("body_timeout_s", float)
#: The memory request bodies in flight may hold (:mod:`gateway.api.admission`; the calls
#: application's: the ops listener reads no bodies), and its limit now, in bytes (read at
#: each request: ``server.max_inflight_request_bytes`` of the policy in force).
BUDGET_KEY: Final = web.AppKey("request_budget", ByteBudget)
BUDGET_LIMIT_KEY: Final = web.AppKey[Callable[[], int]]("request_budget_limit")
_CHARGE_KEY: Final = web.RequestKey("request_charge", Charge)
#: The Content-Encodings of a body that aiohttp decodes before the handler reads it
#: (its ``http_parser``: one coding, ASCII, any case). ``br`` and ``zstd`` need the
#: optional Brotli and backports.zstd packages; without them aiohttp's parser refuses
#: the request itself (400, text) before any handler runs.
_DECODED_ENCODINGS: Final = frozenset({"gzip", "deflate", "br", "zstd"})
_CLOSE_KEY: Final = web.RequestKey("close_after_answer", bool)
_log = get_logger("gateway.server")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: Header lines of an answer: pairs (repeats kept, in order) or a dict.
Headers = Sequence[tuple[str, str]] | dict[str, str]


@dataclass(slots=True)
class Answer:
    """One whole answer, as its API shapes it: HTTP ``status`` (and ``reason`` phrase,
    None for the standard one), ``headers``, ``body`` bytes and ``content_type`` (None: the
    headers say it, or nothing does). ``length``: a Content-Length to state other than the
    body's (a HEAD's: the length a GET would get, RFC 9110 section 9.3.2)."""

    status: int
    body: bytes
    headers: Headers = ()
    reason: str | None = None
    content_type: str | None = None
    length: str | None = None


@dataclass(slots=True)
class Head:
    """The status line and headers of a relayed stream, sent with its first bytes."""

    status: int
    headers: Headers
    reason: str | None = None


class Sidecar(Protocol):
    """What every API needs of the running sidecar (:class:`gateway.server.Gateway`): the
    policy in force, who may call, and the audited answer to a request refused before the
    pipeline. Each API's own ``Runtime`` adds its entry point."""

    @property
    def policy(self) -> PolicySet: ...

    @property
    def agents(self) -> Agents: ...

    def refused_early(
        self,
        exc: GatewayError,
        *,
        started: float,
        http_method: str,
        http_path: str,
        api: str = "envelope",
        audited: bool = True,
        identity: Identity | None = None,
        ids: tuple[str, str] | None = None,
    ) -> ExternalCallResponse: ...


class Exchange(Protocol):
    """One request of one API, from its call to its answer (the interface every API module
    implements; :func:`handler` drives it).

    ``started``: ``time.monotonic()`` when the request arrived. ``streams``: whether the
    call may relay a stream (:class:`gateway.api.writer.Stream` is then handed to
    :meth:`call`).
    """

    @property
    def started(self) -> float: ...

    @property
    def streams(self) -> bool: ...

    async def call(self, stream: Relay | None) -> tuple[int, ExternalCallResponse]:
        """Run the call: ``(HTTP status, answer)``; raises the GatewayError that refuses
        the request before the pipeline (the runtime not started, shut down)."""

    def answer(self, status: int, response: ExternalCallResponse) -> Answer:
        """The whole answer of a call that relayed no stream."""

    def refused(self, exc: GatewayError) -> Answer:
        """The answer (audited) to a request refused before the pipeline."""

    def head(self) -> Head:
        """The head of a relayed stream, at its first bytes."""

    def frame(self, chunk: bytes) -> bytes:
        """What to write of a relayed chunk of whole events now (``b""``: nothing yet)."""

    def end(self, status: int, response: ExternalCallResponse) -> bytes | None:
        """The last bytes of a relayed stream, or None to drop the connection unwritten
        (the agent stopped reading: a last write would hang too)."""


class Incoming:
    """The request as an API reads it (aiohttp's stays here): method, raw path, route
    parameters, headers (every line, names in any case), query items, and the body."""

    __slots__ = ("_request", "content_length", "headers", "method")

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.method: str = request.method
        self.headers: Mapping[str, str] = request.headers
        self.content_length: int | None = request.content_length

    @property
    def raw_path(self) -> str:
        """The path as sent (percent-encoding kept); for ``CONNECT``, whose target aiohttp
        reads as an authority (an empty path), the raw request target."""
        request = self._request  # an empty raw path is an empty path: no decoding to ask
        return request.rel_url.raw_path or request.raw_path

    @property
    def named_target(self) -> str:
        """The target a path under ``/proxy/`` or ``/mcp/`` names (its second segment,
        percent-decoded), also when the route did not match it; "" for none."""
        request = self._request
        path = request.path or request.raw_path.partition("?")[0]
        parts = path.split("/", 3)
        return unquote(parts[2]) if len(parts) > 2 else ""

    @property
    def transport(self) -> asyncio.Transport | None:
        """The connection the request came on (who is calling: its peer)."""
        return self._request.transport

    @property
    def route(self) -> Mapping[str, str]:
        return self._request.match_info

    @property
    def query(self) -> tuple[tuple[str, str], ...]:
        request = self._request  # no query string: no parse into a multidict
        return tuple(request.query.items()) if request.rel_url.raw_query_string else ()

    async def read(self, limit: int) -> bytes:
        """The body's bytes, as aiohttp decoded them from their Content-Encoding, read
        within the app's body timeout.

        Raises :class:`InvalidPayload`: 413 past ``limit`` bytes (decoded); 415 for a
        Content-Encoding aiohttp does not decode (``details.reason: content_encoding``);
        400 for a body that is not what its Content-Encoding says (same reason) or whose
        framing broke part-way (``framing``: a bad chunk or a connection closed early); 408
        when it does not arrive in time (``body_timeout``). After any of these but the first
        the connection is closed once the answer is sent: what follows on it cannot be
        trusted to start a request. Raises :class:`~gateway.errors.CapacityExceeded` (429,
        retryable) when the bodies in flight leave no room for this one, and
        :class:`InvalidPayload` 413 (``too_large_in_memory``) when it alone would hold more
        than ``server.max_inflight_request_bytes`` (:mod:`gateway.api.admission`).
        """
        request = self._request
        encodings = request.headers.getall("Content-Encoding", [])
        if not _decoded(encodings):
            _close_after_answer(request)
            raise InvalidPayload(
                f"Content-Encoding {', '.join(encodings)!r} is not supported: send the "
                "envelope as is, or encoded with one of gzip or deflate",
                details={
                    "reason": "content_encoding",
                    "content_encoding": ", ".join(encodings)[:128],
                    "supported": ["identity", "gzip", "deflate"],
                },
                http_status=415,
            )
        timeout_s = request.app.get(BODY_TIMEOUT_KEY, BODY_TIMEOUT_S)
        try:
            if request.content.is_eof():  # all of it has arrived: nothing to wait for
                return await _read_admitted(request, limit, self.content_length)
            async with asyncio.timeout(timeout_s):
                return await _read_admitted(request, limit, self.content_length)
        except web.HTTPRequestEntityTooLarge:  # aiohttp's own read, in an app with no budget
            raise too_large(None, limit) from None
        except TimeoutError:
            _close_after_answer(request)
            raise InvalidPayload(
                f"the envelope did not arrive within {timeout_s:g} s of its headers; "
                "send the whole body at once",
                details={"reason": "body_timeout", "timeout_s": timeout_s},
                http_status=408,
            ) from None
        except web.RequestPayloadError as exc:
            _close_after_answer(request)
            if isinstance(exc.__cause__, ContentEncodingError):
                raise InvalidPayload(
                    f"the body is not {', '.join(encodings)}-encoded data, as its "
                    "Content-Encoding says; send it as is, without the header, or encode it",
                    details={"reason": "content_encoding", "content_encoding": encodings[0]},
                ) from None
            raise InvalidPayload(
                "the request body could not be read: its framing broke part-way "
                "(Transfer-Encoding chunks or Content-Length)",
                details={"reason": "framing"},
            ) from None
        except ConnectionError:  # the agent hung up part-way: nobody reads this answer
            raise InvalidPayload(
                "the connection closed before the whole envelope arrived",
                details={"reason": "framing"},
            ) from None

    async def read_or_refusal(self, limit: int) -> tuple[bytes, GatewayError | None]:
        """The body (at most ``limit`` bytes), or ``b""`` and the refusal of it, for an API
        that passes the refusal to the pipeline so that it is audited as the call."""
        size = self.content_length
        if size is not None and size > limit:
            return b"", body_too_large(limit)
        try:
            return await self.read(limit), None
        except GatewayError as exc:
            return b"", exc


def handler(begin: Callable[[Incoming], Exchange], crash_event: str) -> Handler:
    """The aiohttp handler of one API: ``begin`` makes the request's :class:`Exchange`; its
    call runs, and its answer, refusal or stream is written here. An unexpected error is
    logged as ``crash_event`` and answered as the API's INTERNAL refusal."""

    async def handle(request: web.Request) -> web.StreamResponse:
        exchange = begin(Incoming(request))
        stream = Stream(request, exchange) if exchange.streams else None
        try:
            status, response = await exchange.call(stream)
            if stream is not None and stream.started:
                return await stream.finish(status, response)
            return respond(exchange.answer(status, response))
        except GatewayError as exc:  # refused before the pipeline (not started, shut down)
            return respond(exchange.refused(exc))
        except Exception:  # noqa: BLE001 - the answer must be the API's shape anyway
            _log.exception(crash_event)
            return respond(exchange.refused(InternalError("the sidecar failed unexpectedly")))

    return handle


#: The answer of an API to a request under its route family (``/proxy``, ``/mcp``) that
#: none of its routes matched, given the HTTP status aiohttp chose (404, 405).
Unmatched = Callable[[Incoming, int], Answer]
#: Route family prefix -> its :data:`Unmatched` (the calls application only).
EDGES_KEY: Final = web.AppKey[dict[str, Unmatched]]("edges")


def edge_answer(request: web.Request, exc: web.HTTPException) -> web.Response | None:
    """The answer to a request under a route family (``/proxy``, ``/mcp``) that none of
    its routes matched (aiohttp's 404 or 405, ``exc``): that family's API's (the calls
    application's :data:`EDGES_KEY`), in its shape; the path of a ``CONNECT`` (an
    authority to aiohttp) is its raw request target. None for any other error: the
    application's JSON errors answer it (the calls application's one middleware,
    :mod:`gateway.server.app`, calls this first)."""
    path = request.path or request.raw_path.partition("?")[0]
    for prefix, unmatched in request.app.get(EDGES_KEY, {}).items():
        if exc.status >= 400 and (path == prefix or path.startswith(prefix + "/")):
            answer = respond(unmatched(Incoming(request), exc.status))
            if "Allow" in exc.headers:  # a 405 must say what is allowed (RFC 9110)
                answer.headers["Allow"] = exc.headers["Allow"]
            return answer
    return None


class TargetRoute(web.AbstractResource):
    """``{prefix}/{target}/{path:.*}`` for every method, as aiohttp's own route of that
    pattern matches it (its ``match_info``: ``target`` and ``path``, ``%2F`` and ``%25``
    decoded; no match for an empty target, one holding ``{`` or ``}``, a path holding a
    line feed), without its regular expression: a prefix compared and one split, per
    request of the drop-in route. ``register(router, shortcuts)`` adds it.

    aiohttp's router looks a request's path up in its index of resources, then each of
    its parents in turn (``/proxy/openai/v1/chat/completions``, ``.../v1/chat``... up to
    ``/proxy``, where this route is indexed): ~8,000 instructions for an SDK's
    five-segment path (callgrind). A shortcut is this same route indexed under one whole
    path (``indexed``, e.g. a policy endpoint's ``/proxy/openai/v1/chat/completions``),
    so that a request for it is matched at the first look-up; it matches what this route
    matches, whatever the path (a path it does not index still reaches ``/proxy``)."""

    def __init__(self, prefix: str, handler: Handler, *, indexed: str | None = None) -> None:
        super().__init__()
        self._prefix = prefix
        self._under = prefix + "/"
        self._indexed = indexed
        self._route = web.ResourceRoute("*", handler, self)
        self._methods: Final = {"*"}

    def register(self, router: web.UrlDispatcher, shortcuts: Iterable[str] = ()) -> None:
        """Add this route to ``router``, and a shortcut for each path of ``shortcuts``
        under the prefix (others are left out: their own look-up would not find them)."""
        router.register_resource(self)
        handler = self._route.handler
        for path in shortcuts:
            if path.startswith(self._under) and _indexable(path):
                router.register_resource(TargetRoute(self._prefix, handler, indexed=path))

    @property
    def canonical(self) -> str:
        return self._indexed or self._prefix + "/{target}/{path}"

    def url_for(self, **parts: str) -> NoReturn:
        raise NotImplementedError("the drop-in route is matched, never built")

    async def resolve(
        self, request: web.Request
    ) -> tuple[web.UrlMappingMatchInfo | None, set[str]]:
        path = request.rel_url.path_safe  # what aiohttp's routes match: %2F and %25 kept
        if not path.startswith(self._under):
            return None, set()
        target, slash, rest = path[len(self._under) :].partition("/")
        if not slash or not target or "{" in target or "}" in target or "\n" in rest:
            return None, set()
        if "%" in path:  # as aiohttp decodes each part of a match
            target = target.replace("%2F", "/").replace("%25", "%")
            rest = rest.replace("%2F", "/").replace("%25", "%")
        return web.UrlMappingMatchInfo({"target": target, "path": rest}, self._route), self._methods

    def add_prefix(self, prefix: str) -> None:
        self._prefix = prefix + self._prefix
        self._under = self._prefix + "/"
        if self._indexed is not None:
            self._indexed = prefix + self._indexed

    def get_info(self) -> dict[str, str]:  # type: ignore[override]
        return {"prefix": self._prefix}

    def raw_match(self, path: str) -> bool:
        return path == self.canonical

    def __len__(self) -> int:
        return 1

    def __iter__(self) -> Iterator[web.AbstractRoute]:
        return iter((self._route,))


def _indexable(path: str) -> bool:
    """Whether aiohttp's router would look ``path`` up as it is: printable ASCII without
    ``%`` (a request's path is looked up decoded), ``{``, ``}`` (a pattern's marks) or a
    final ``/`` (index keys have none), and a target and a rest after the prefix."""
    return (
        path.isascii()
        and path.isprintable()
        and not any(mark in path for mark in "%{}? #")
        and not path.endswith("/")
        and path.count("/") >= 3
    )


# -- reading a request's body ---------------------------------------------------------


async def _read_admitted(request: web.Request, limit: int, declared: int | None) -> bytes:
    """The body, each byte charged to the app's :class:`ByteBudget` before it is held:
    Content-Length (``declared``) x :data:`~gateway.api.admission.COPIES` before the
    first read, the bytes as they arrive (chunked or coded bodies), :func:`~gateway.api.
    admission.held_bytes` once whole. Raises the refusal of :meth:`Charge.grow_to` as
    soon as a charge does not fit (the rest is not read), :class:`InvalidPayload` 413
    past ``limit`` bytes; the charge is given back by the middleware that made it
    (:func:`charge`) once answered."""
    charge = request.get(_CHARGE_KEY)
    if charge is None:
        budget = request.app.get(BUDGET_KEY)
        if budget is None:  # an app without a budget (the ops listener reads no bodies)
            return await request.read()
        limit_now = request.app.get(BUDGET_LIMIT_KEY)
        if limit_now is not None:  # the policy in force: the key is hot
            budget.limit_bytes = limit_now()
        charge = request[_CHARGE_KEY] = budget.charge()
    if declared:  # the Content-Length (Incoming read it: a property parsing the header)
        charge.grow_to(COPIES * declared)
    content = request.content
    if content.is_eof():  # the whole body is buffered (decoded): one read, no chunks
        body = content.read_nowait()
        if len(body) > limit:
            raise too_large(None, limit)
        if len(body) != declared:  # else charged just above
            charge.grow_to(COPIES * len(body))
        charge.grow_to(held_bytes(body))
        return body
    chunks: list[bytes] = []
    size = 0
    async for chunk in content.iter_any():
        size += len(chunk)
        if size > limit:
            raise too_large(None, limit)
        charge.grow_to(COPIES * size)
        chunks.append(chunk)
    # One copy while joining, as aiohttp's own read makes; the pieces go right after.
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    del chunks
    charge.grow_to(held_bytes(body))
    return body


def charge(request: web.Request, budget: ByteBudget) -> Charge:
    """A new charge in ``budget`` for ``request``'s body, for :func:`_read_admitted` to
    grow: the calls application's middleware makes it before the handler runs and gives
    it back (:meth:`Charge.release`) once the answer is written, whatever happened."""
    # Its close flag too (unset: False): close_if_asked reads it for every answer, and a
    # key missing from the request's mapping costs a KeyError raised and caught in Python.
    request[_CLOSE_KEY] = False
    made = request[_CHARGE_KEY] = budget.charge()
    return made


def _decoded(encodings: list[str]) -> bool:
    """True if aiohttp has decoded a body sent with these Content-Encoding values (or
    there is nothing to decode: none, empty, or ``identity``)."""
    if not encodings:
        return True
    if len(encodings) > 1:
        return False
    encoding = encodings[0]
    return encoding.isascii() and encoding.lower() in _DECODED_ENCODINGS | {"", "identity"}


def _close_after_answer(request: web.Request) -> None:
    request[_CLOSE_KEY] = True


async def close_if_asked(request: web.Request, response: web.StreamResponse) -> None:
    """Send ``Connection: close`` and close after this answer, when its request's body
    could not be read whole: nothing more on that connection is read as a request (an
    ``on_response_prepare`` hook of the calls app)."""
    if request.get(_CLOSE_KEY):
        response.force_close()
        # This hook runs after aiohttp has chosen the headers, before it writes them.
        response.headers["Connection"] = "close"


def too_large(size: int | None, limit: int) -> InvalidPayload:
    """The refusal (413) of an envelope of ``size`` bytes (None: unknown, past ``limit``)."""
    said = f"{size} bytes" if size is not None else "larger than the limit"
    return InvalidPayload(
        f"the envelope is {said}; this sidecar accepts at most {limit} bytes "
        "(server.max_request_bytes in the policy)",
        details={"reason": "too_large", "limit_bytes": limit},
        http_status=413,
    )


def body_too_large(limit: int) -> InvalidPayload:
    """The refusal (413) of a drop-in or MCP body whose Content-Length is past ``limit``."""
    return InvalidPayload(
        f"the request body is larger than this sidecar accepts ({limit} bytes, "
        "server.max_request_bytes in the policy)",
        details={"reason": "too_large", "limit_bytes": limit},
        http_status=413,
    )
