"""Forwarding one attempt to the upstream: the aiohttp client's session and requests
(with :mod:`gateway.upstream.resolver`, which checks the addresses it connects to).

One :class:`Upstream` (one ``ClientSession``) serves the whole process. For each attempt
it builds the request from the policy's ``base_url`` plus the checked endpoint, injects
the credential (a header with the target's ``format``, or a query parameter), sends it
with connect and read timeouts inside the attempt's budget, and reads the body up to the
response size limit (gzip and deflate are decoded by aiohttp; the limit applies to the
decoded size, so a compressed bomb is stopped too).

Egress: every address a host name resolves to is checked against the policy's ``egress``
block inside the connector's resolver, before any connection is opened; IP literals are
checked before the request. Redirects are never followed to another origin (the answer
is EGRESS_DENIED and no byte, header or credential goes there); same-origin redirects
(307/308 for any method, 301/302/303 for GET/HEAD) are followed at most
:data:`MAX_REDIRECTS` times and only to allowlisted paths; a Location that is not a
clean http(s) reference is refused (:func:`gateway.policy.egress.redirect_hop`). Every hop
is built afresh from the envelope and the policy: the Location's own query, the policy's
credential, no userinfo, cookie or query credential of the upstream's choosing.

Errors: :class:`TransportError` for a failed attempt (with ``sent`` telling whether the
request may have reached the upstream); :class:`gateway.errors.EgressDenied`,
:class:`~gateway.errors.PermissionDenied`, :class:`~gateway.errors.ResponseTooLarge`, and
:class:`~gateway.errors.DependencyFailed` (not retryable) for an answer aiohttp's parser
refuses (aiohttp's exceptions are translated in :mod:`gateway.upstream.failures`; the
answer's reading helpers and :class:`UpstreamStream` are in :mod:`gateway.upstream.answers`).
No message holds a URL query or a credential: only ``scheme://host:port``.

Connections: each target holds at most its ``max_connections`` at once (an attempt holds
one until its answer is read, a relayed stream until it is closed). An attempt that finds
all busy waits up to the target's ``connection_wait_s`` (within its own timeout), then
gets :class:`~gateway.errors.CapacityExceeded` (retryable, ``details.reason``
"connection_pool_full"); each such wait is reported to ``on_pool_wait`` (the metrics).
aiohttp's own pool is not capped, so no attempt queues there unseen.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Final

import aiohttp
from aiohttp.abc import AbstractResolver, AbstractStreamWriter
from aiohttp.connector import Connection
from aiohttp.tracing import Trace

from gateway import __version__
from gateway.errors import CapacityExceeded, PermissionDenied
from gateway.policy import EgressSpec
from gateway.policy.egress import check_address, origin_label, redirect_hop
from gateway.upstream.answers import (
    CutStream,
    UpstreamStream,
    escaped,
    is_event_stream,
    not_what_its_coding_says,
    protocol_switch,
    too_large,
    unreadable_answer,
)
from gateway.upstream.codings import decoded, left_on_body
from gateway.upstream.failures import translate
from gateway.upstream.resolver import EgressResolver
from gateway.upstream.slots import Slots
from gateway.upstream.types import OutboundRequest, TransportError, UpstreamResponse
from gateway.urls import URL

MAX_REDIRECTS: Final = 5
CONNECT_TIMEOUT_CAP_S: Final = 10.0
_CONNECT_TIMEOUT: Final = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_CAP_S)
USER_AGENT: Final = f"egress-gateway/{__version__}"
_REDIRECTS: Final = frozenset({301, 302, 303, 307, 308})
_READ_CHUNK: Final = 64 * 1024
_LARGE_BODY: Final = 512 * 1024
#: The slices a large body is written in (asyncio's write high-water mark).
_SLICE_BYTES: Final = 64 * 1024
#: ``details.reason`` of the CAPACITY_EXCEEDED of an attempt that got no connection.
POOL_FULL: Final = "connection_pool_full"


class _SlicedBytes(aiohttp.payload.Payload):
    """A large request body written in :data:`_SLICE_BYTES` views of it, waiting for the
    socket to drain between them: aiohttp's ``io.BytesIO`` payload asks for the buffer
    of the BytesIO, which copies the whole body (one more copy per call in flight)."""

    _value: bytes

    def __init__(self, value: bytes) -> None:
        super().__init__(value, content_type="application/octet-stream")
        self._size = len(value)

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return self._value.decode(encoding, errors)

    async def as_bytes(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return self._value

    async def write(self, writer: AbstractStreamWriter) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(
        self, writer: AbstractStreamWriter, content_length: int | None
    ) -> None:
        with memoryview(self._value) as view:
            end = len(view) if content_length is None else min(content_length, len(view))
            for start in range(0, end, _SLICE_BYTES):
                await writer.write(view[start : min(start + _SLICE_BYTES, end)])


#: Pooled connections :class:`_PooledConnector` closes, at most, before one attempt.
_MAX_STALE_SKIPS: Final = 1024
_MAX_ALLOWED_HOSTS: Final = 1024  # hosts come from the policy; this only bounds reloads


@dataclass(slots=True)
class _Attempt:
    """Whether the current attempt reached the point where the upstream may have it."""

    sent: bool = False
    #: The upstream's status line arrived: a failure from then on lost a begun answer.
    answered: bool = False
    #: The target's connection slot this attempt holds (handed to a stream it opens).
    slot: Slots | None = None


#: The attempt the current task is sending (set by :meth:`Upstream.send`).
_ATTEMPT: ContextVar[_Attempt | None] = ContextVar("egress_attempt", default=None)


class _PooledConnector(aiohttp.TCPConnector):
    """aiohttp's connector, never handing out a pooled connection that holds bytes its
    upstream sent after its last answer ended (a whole message, or bytes past it: the
    protocol's ``should_close``). HTTP/1.1 pairs answers with requests by their order on
    the connection only (RFC 9112 section 9.3): such bytes would be read as the next
    call's answer (another call's body, or a 408 that some servers send before closing
    an idle connection while the request it was taken for is carried out) and shift
    every later answer on it by one. Go's client closes such a connection too
    ("Unsolicited response received on idle HTTP channel"). aiohttp checks this only
    when it pools a connection, not for bytes arriving while it waits in the pool."""

    async def connect(
        self,
        req: aiohttp.ClientRequest,
        traces: list[Trace],
        timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109 - aiohttp's signature
    ) -> Connection:
        # Each connection closed here leaves the pool for good and a new one holds no
        # bytes, so this ends within the pool's size (bounded by the target's slots).
        for _ in range(_MAX_STALE_SKIPS):
            conn = await super().connect(req, traces, timeout)
            protocol = conn.protocol
            if protocol is None or not protocol.should_close:
                return conn
            conn.close()
        raise aiohttp.ClientConnectionError("no pooled connection free of stray bytes")


class _MarkingRequest(aiohttp.ClientRequest):
    """aiohttp's request, marking the attempt as sent when aiohttp starts writing it on
    a connection it holds: from then on a failure may have reached the upstream (when in
    doubt, sent). Cheaper than a TraceConfig, whose signals run on every request."""

    async def send(self, conn: Connection) -> aiohttp.ClientResponse:
        attempt = _ATTEMPT.get()
        if attempt is not None:
            attempt.sent = True
        return await super().send(conn)


def _may_stream(method: str, resp: aiohttp.ClientResponse) -> bool:
    """Whether ``resp`` is a 2xx event stream to relay as it arrives: not an answer that
    has no body by definition (to a HEAD, RFC 9110 section 9.3.2, whose headers are a
    GET's; a 204), which has no events to relay and is judged read whole."""
    status = resp.status
    return status < 300 and status != 204 and method != "HEAD" and is_event_stream(resp)


def _refuse_coded_stream(resp: aiohttp.ClientResponse, url: URL) -> None:
    """Raise DEPENDENCY_FAILED (:func:`gateway.upstream.answers.unreadable`) for a 2xx
    event stream with a content coding aiohttp left on it, closing it unread: a stream
    is relayed as it comes, so a coded one could not be scrubbed."""
    if "Content-Encoding" in resp.headers and left_on_body(resp.headers) != ():
        resp.close()
        raise unreadable_answer(resp, url)


class Upstream:
    """The process's outbound HTTP client. Create with :meth:`start`, close with :meth:`aclose`."""

    def __init__(
        self,
        egress: EgressSpec,
        *,
        max_response_bytes: int,
        resolver: AbstractResolver | None = None,
        on_pool_wait: Callable[[str, float, bool], None] | None = None,
    ) -> None:
        self._resolver = EgressResolver(egress, resolver)
        self.max_response_bytes = max_response_bytes
        self._on_pool_wait = on_pool_wait
        #: Per target name: its ``max_connections`` and the slots counting them (a new
        #: limit gets new slots; attempts holding old ones release into those).
        self._slots: dict[str, tuple[int, Slots]] = {}
        self._session: aiohttp.ClientSession | None = None
        #: Attempts in flight per session; a session replaced by an egress change is
        #: closed when its last attempt ends.
        self._users: dict[aiohttp.ClientSession, int] = {}
        self._closing: set[asyncio.Task[None]] = set()
        #: Hosts of the egress policy in force that checked out as allowed (names or IP
        #: literals): the check is pure, so it is made once per host and policy.
        self._allowed_hosts: set[str] = set()

    @property
    def egress(self) -> EgressSpec:
        return self._resolver.egress

    @egress.setter
    def egress(self, value: EgressSpec) -> None:
        changed = value != self._resolver.egress
        self._resolver.egress = value
        self._allowed_hosts = set()
        if changed and self._session is not None:
            # Pooled keep-alive connections (and the DNS cache) were checked against the
            # old rules: new attempts get a new pool, so a tightened egress applies at
            # once; attempts in flight finish on the old one, which then closes.
            old, self._session = self._session, self._new_session()
            if not self._users.get(old):
                self._close_later(old)

    async def start(self) -> None:
        self._session = self._new_session()

    @property
    def closed(self) -> bool:
        """True before :meth:`start` and after :meth:`aclose`: no session is open."""
        return self._session is None and not self._users

    def _new_session(self) -> aiohttp.ClientSession:
        connector = _PooledConnector(
            resolver=self._resolver,
            # Uncapped: each target's slots (send()) bound its connections, with a
            # bounded, counted wait instead of aiohttp's silent queue.
            limit=0,
            limit_per_host=0,
            ttl_dns_cache=10,
        )
        return aiohttp.ClientSession(
            connector=connector,
            request_class=_MarkingRequest,
            headers={"User-Agent": USER_AGENT},
            cookie_jar=aiohttp.DummyCookieJar(),  # no state leaks between agents' calls
            auto_decompress=True,
            raise_for_status=False,
        )

    def _close_later(self, session: aiohttp.ClientSession) -> None:
        task = asyncio.get_running_loop().create_task(session.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def aclose(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()
        for old in list(self._users):
            await old.close()
        self._users.clear()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    async def send(
        self, request: OutboundRequest, *, timeout_s: float, stream: bool = False
    ) -> UpstreamResponse:
        """Send one attempt and read the answer, all within ``timeout_s`` seconds.

        With ``stream``, a 2xx ``text/event-stream`` answer is not read: it comes back
        with :attr:`UpstreamResponse.stream` open (its headers within ``timeout_s``, its
        body as it arrives); every other answer is read whole, as without ``stream``.
        """
        if self._session is None:
            raise RuntimeError("Upstream.start() was not called")
        started = time.monotonic()
        state = _Attempt()
        slot = self._slot(request.target.name, request.target.spec.max_connections)
        if not slot.take():  # all busy: wait, bounded
            await self._wait_for(slot, request, timeout_s)
        state.slot = slot
        token = _ATTEMPT.set(state)
        session = self._session
        users = self._users
        users[session] = users.get(session, 0) + 1
        try:
            async with asyncio.timeout(timeout_s - (time.monotonic() - started)):
                return await self._send(session, request, timeout_s, state, started, stream)
        except TimeoutError:
            raise TransportError(
                "timeout",
                sent=state.sent,
                message=f"{origin_label(request.url)} did not answer within {timeout_s:.3g} s",
                answered=state.answered,
            ) from None
        finally:
            if state.slot is not None:  # not handed to an open stream
                state.slot.release()
            _ATTEMPT.reset(token)
            left = users[session] - 1
            if left:
                users[session] = left
            else:
                del users[session]
                if session is not self._session and self._session is not None:
                    self._close_later(session)  # replaced by an egress change

    def _slot(self, target: str, limit: int) -> Slots:
        entry = self._slots.get(target)
        if entry is None or entry[0] != limit:
            entry = self._slots[target] = (limit, Slots(limit))
        return entry[1]

    async def _wait_for(self, slot: Slots, request: OutboundRequest, timeout_s: float) -> None:
        """Wait for a free connection of the target, up to its ``connection_wait_s``
        (within ``timeout_s``); CapacityExceeded past that."""
        target = request.target
        bound = min(target.spec.connection_wait_s, timeout_s)
        began = time.monotonic()
        try:
            async with asyncio.timeout(bound):
                await slot.wait()
        except TimeoutError:
            if self._on_pool_wait is not None:
                self._on_pool_wait(target.name, time.monotonic() - began, False)
            limit = target.spec.max_connections
            raise CapacityExceeded(
                f"target {target.name!r}: all {limit} connections stayed busy for {bound:.3g} s",
                details={"reason": POOL_FULL, "max_connections": limit},
            ) from None
        if self._on_pool_wait is not None:
            self._on_pool_wait(target.name, time.monotonic() - began, True)

    async def _send(
        self,
        session: aiohttp.ClientSession,
        request: OutboundRequest,
        timeout_s: float,
        state: _Attempt,
        started: float,
        stream: bool,
    ) -> UpstreamResponse:
        method, url, body = request.method, request.url, request.body
        # The attempt as a whole is bounded by send()'s asyncio.timeout; aiohttp's own
        # timeout only tells a slow connect apart (nothing sent: safe to retry).
        timeout = (
            _CONNECT_TIMEOUT
            if timeout_s >= CONNECT_TIMEOUT_CAP_S
            else aiohttp.ClientTimeout(total=None, sock_connect=timeout_s)
        )
        query = request.query
        for _hop in range(MAX_REDIRECTS + 1):
            self._check_literal(url)
            headers, params = self._outgoing(request, query, body is not None)
            try:
                # aiohttp warns that large bytes bodies may block the loop: a large one
                # is written in slices with the same Content-Length, never copied.
                data = body if body is None or len(body) <= _LARGE_BODY else _SlicedBytes(body)
                resp = await session.request(
                    method,
                    url,
                    params=params,
                    data=data,
                    headers=headers,
                    allow_redirects=False,
                    timeout=timeout,
                )
                state.answered = True
                if resp.status < 200:
                    return protocol_switch(resp, started)
                if stream and _may_stream(method, resp):
                    _refuse_coded_stream(resp, url)
                    return self._streamed(session, resp, url, started, state)
                async with resp:
                    if resp.status in _REDIRECTS and "Location" in resp.headers:
                        next_hop = self._redirect(request, url, method, resp)
                        if next_hop is not None:
                            # The Location's own query replaces the agent's (RFC 3986,
                            # section 5.2.2); only the credential is added again.
                            method, url = next_hop
                            query = None
                            if method in ("GET", "HEAD"):
                                body = None
                            state.sent = state.answered = False
                            continue
                    idle_s = request.target.spec.stream_idle_timeout_s
                    content, cut, idle = await self._whole(resp, url, idle_s)
                    return UpstreamResponse(
                        status=resp.status,
                        reason=resp.reason or "",
                        headers=resp.headers,
                        content_type=escaped(resp.headers.get("Content-Type")),
                        body=content,
                        elapsed_s=time.monotonic() - started,
                        cut=cut,
                        idle=idle,
                    )
            except aiohttp.ClientError as exc:
                raise translate(exc, url, state, request.target.name) from None
        raise _too_many_redirects(url)

    def _streamed(
        self,
        session: aiohttp.ClientSession,
        resp: aiohttp.ClientResponse,
        url: URL,
        started: float,
        state: _Attempt,
    ) -> UpstreamResponse:
        """A 2xx event stream, answered before its body: the body is relayed as it comes."""
        return UpstreamResponse(
            status=resp.status,
            reason=resp.reason or "",
            headers=resp.headers,
            content_type=escaped(resp.headers.get("Content-Type")),
            body=b"",
            elapsed_s=time.monotonic() - started,
            stream=self._stream(session, resp, url, state),
        )

    def _check_literal(self, url: URL) -> None:
        host = url.host or ""
        if host in self._allowed_hosts:
            return
        try:
            ipaddress.ip_address(host)
        except ValueError:
            pass  # a name: its addresses are checked by the resolver, at each resolution
        else:
            check_address(self.egress, host, host)
        if len(self._allowed_hosts) >= _MAX_ALLOWED_HOSTS:
            self._allowed_hosts.clear()
        self._allowed_hosts.add(host)

    @staticmethod
    def _outgoing(
        request: OutboundRequest, query: list[tuple[str, str]] | None, has_body: bool
    ) -> tuple[dict[str, str], list[tuple[str, str]] | None]:
        # Built afresh from the envelope and the policy at every hop: nothing an upstream
        # puts in a redirect (userinfo, cookies, a query credential) is carried over.
        headers = dict(request.headers)
        if has_body:
            headers["Content-Type"] = request.content_type
        query = list(query) if query is not None else None
        cred = request.credential
        if cred is not None:
            value = cred.secret.reveal()
            if cred.header is not None:
                headers[cred.header] = cred.format.replace("{secret}", value)
            elif cred.query_param is not None:
                query = (query or []) + [(cred.query_param, value)]
        return headers, query

    @staticmethod
    def _redirect(
        request: OutboundRequest, url: URL, method: str, resp: aiohttp.ClientResponse
    ) -> tuple[str, URL] | None:
        cred = request.credential
        next_url = redirect_hop(
            request.target,
            url,
            resp.headers.getall("Location"),
            method=method,
            status=resp.status,
            credential_param=cred.query_param if cred is not None else None,
        )
        return None if next_url is None else (method, next_url)

    def _stream(
        self,
        session: aiohttp.ClientSession,
        resp: aiohttp.ClientResponse,
        url: URL,
        state: _Attempt,
    ) -> UpstreamStream:
        # The session stays in use until the stream is closed (an egress change then
        # closes it, not before); so does the target's connection slot.
        users = self._users
        users[session] = users.get(session, 0) + 1
        slot, state.slot = state.slot, None

        def done() -> None:
            if slot is not None:
                slot.release()
            left = users.get(session, 1) - 1
            if left:
                users[session] = left
            else:
                users.pop(session, None)
                if session is not self._session and self._session is not None:
                    self._close_later(session)

        return UpstreamStream(resp, origin_label(url), done)

    async def _whole(
        self, resp: aiohttp.ClientResponse, url: URL, idle_s: float
    ) -> tuple[bytes, bool, bool]:
        """``(body, cut, idle)``: :meth:`_read`'s body, or a cut stream's part."""
        try:
            return await self._read(resp, url, idle_s), False, False
        except CutStream as partial:
            return partial.body, True, partial.idle

    async def _read(self, resp: aiohttp.ClientResponse, url: URL, idle_s: float) -> bytes:
        """The body, whole; a 2xx event stream (read whole: the agent asked for no
        stream) that falls silent for ``idle_s`` (its target's ``stream_idle_timeout_s``,
        as a relayed one) is :class:`CutStream` with what arrived, judged by its events."""
        limit = self.max_response_bytes
        declared = resp.content_length
        gap = idle_s if resp.status < 300 and is_event_stream(resp) else None
        if declared is not None:
            if declared > limit:
                raise too_large(url, limit, resp.status)
            if "Content-Encoding" not in resp.headers and gap is None:
                # At most Content-Length bytes, in one read; a compressed body may inflate
                # past the limit, so it is counted chunk by chunk below.
                return await resp.read()
        buf = bytearray()
        content = resp.content
        try:
            for _ in range(limit + 1):  # each read brings a byte at least, else ends it
                if gap is None:  # the usual: no timer per chunk
                    chunk = await content.read(_READ_CHUNK)
                else:
                    async with asyncio.timeout(gap):
                        chunk = await content.read(_READ_CHUNK)
                if not chunk:
                    break
                buf += chunk
                if len(buf) > limit:
                    raise too_large(url, limit, resp.status)
        except TimeoutError:  # only an event stream's gap: the attempt's bound is outside
            raise CutStream(bytes(buf), idle=True) from None
        except aiohttp.ClientPayloadError as exc:
            if not_what_its_coding_says(exc):
                raise unreadable_answer(resp, url) from None
            if resp.status < 300 and is_event_stream(resp):
                if "Content-Encoding" in resp.headers and left_on_body(resp.headers) != ():
                    # Part of a coded body cannot be undone, so it cannot be scrubbed.
                    raise unreadable_answer(resp, url) from None
                # A 2xx stream cut mid-way: what arrived is its answer, judged by its
                # events (STREAM_INTERRUPTED), not a failure to reach the upstream.
                raise CutStream(bytes(buf)) from None
            raise
        if buf and "Content-Encoding" in resp.headers:  # an empty body holds no secret
            left = left_on_body(resp.headers)
            if left is None:
                raise unreadable_answer(resp, url)
            if left:  # what aiohttp did not undo, undone here to be scrubbed
                return decoded(bytes(buf), left, url, limit, resp.status)
        return bytes(buf)


def _too_many_redirects(url: URL) -> PermissionDenied:
    return PermissionDenied(
        f"{origin_label(url)} redirected more than {MAX_REDIRECTS} times",
        details={"reason": "too_many_redirects"},
    )
