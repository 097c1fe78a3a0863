"""``EgressClient``: the envelope API over a blocking ``httpx.Client``."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Any, Self, Unpack

import httpx

from egress_client import _core
from egress_client._core import CallOptions
from egress_client.errors import EgressError, error_for
from egress_client.models import ExternalCallRequest, ExternalCallResponse, HttpMethod
from egress_client.retry import RetryPolicy, retry_wait
from egress_client.sse import ServerSentEvent, SSEDecoder


class EgressClient:
    """A client of one sidecar. ``base_url`` defaults to ``$EGRESS_GATEWAY_URL`` (or
    ``$GATEWAY_URL``) or ``http://127.0.0.1:8181``; ``agent_id`` is put in envelopes that
    name none: a claim the sidecar checks (it knows who calls; another agent's id is
    refused PERMISSION_DENIED, ``agent_mismatch``), so leave it None or set your own.
    ``http_client`` is used as given and not closed here; without it the client owns one
    (close it, or use ``with``).
    The HTTP timeout of a call is its envelope ``timeout`` plus ``timeout_margin_s``;
    connecting to the sidecar is bounded by ``connect_timeout_s``.

    Every method raises pydantic's ``ValidationError`` (a ``ValueError``) for an
    envelope the sidecar would refuse, before sending it, and an :class:`EgressError`
    when the sidecar cannot be reached or did not answer.
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        agent_id: str | None = None,
        http_client: httpx.Client | None = None,
        connect_timeout_s: float = 5.0,
        timeout_margin_s: float = 5.0,
        max_event_chars: int = 16 * 1024 * 1024,
    ) -> None:
        self.base_url = _core.base_url(base_url)
        self.agent_id = agent_id
        self._own = http_client is None
        self._http = http_client if http_client is not None else httpx.Client()
        self._connect_s = connect_timeout_s
        self._margin_s = timeout_margin_s
        self._max_event_chars = max_event_chars
        self._rng = random.Random()  # noqa: S311 - jitter, not secrets

    def close(self) -> None:
        """Close the HTTP client this client made (idempotent)."""
        if self._own:
            self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def request(
        self,
        target: str,
        endpoint: str,
        method: HttpMethod,
        parameters: Mapping[str, Any] | None = None,
        **options: Unpack[CallOptions],
    ) -> ExternalCallRequest:
        """The envelope :meth:`call` would send (ids resolved, validated)."""
        return _core.build_request(
            target, endpoint, method, parameters, options, default_agent_id=self.agent_id
        )

    def call(
        self,
        target: str,
        endpoint: str,
        method: HttpMethod,
        parameters: Mapping[str, Any] | None = None,
        **options: Unpack[CallOptions],
    ) -> ExternalCallResponse:
        """One call through the sidecar: ``target`` is a target of its policy,
        ``endpoint`` a path on it, ``parameters`` the query (GET/HEAD/DELETE) or JSON
        body. Returns the sidecar's answer, failures included (``.raise_for_error()``
        raises the typed exception)."""
        return self.send(self.request(target, endpoint, method, parameters, **options))

    def send(self, request: ExternalCallRequest) -> ExternalCallResponse:
        """Send a built envelope; returns the sidecar's answer."""
        try:
            answer = self._http.post(
                self.base_url + _core.CALLS_PATH,
                content=_core.payload(request),
                headers=_core.http_headers(stream=False),
                timeout=_core.http_timeout(
                    request, connect_s=self._connect_s, margin_s=self._margin_s
                ),
            )
        except httpx.RequestError as exc:
            raise _core.transport_error(exc, request) from exc
        return _core.decode_answer(
            answer.status_code, answer.headers.get("content-type", ""), answer.content
        )

    def stream(
        self,
        target: str,
        endpoint: str,
        method: HttpMethod,
        parameters: Mapping[str, Any] | None = None,
        **options: Unpack[CallOptions],
    ) -> CallStream:
        """A streamed call (``Accept: text/event-stream``), used as a context manager::

            with client.stream("openai", "/v1/chat/completions", "POST", body) as stream:
                for event in stream:          # the upstream's events, as they arrive
                    ...
            stream.response                   # the final ExternalCallResponse

        Refused before the upstream streamed (policy, limits, an upstream error), the
        call yields no event and ``response`` is the sidecar's JSON answer.
        """
        request = self.request(target, endpoint, method, parameters, **options)
        return CallStream(self, request)

    def call_with_retries(
        self,
        target: str,
        endpoint: str,
        method: HttpMethod,
        parameters: Mapping[str, Any] | None = None,
        *,
        deadline_s: float = 60.0,
        retry: RetryPolicy | None = None,
        **options: Unpack[CallOptions],
    ) -> ExternalCallResponse:
        """:meth:`call`, tried again while the error says it may help, within
        ``deadline_s`` seconds in all: returns the successful answer or raises the last
        :class:`EgressError` (:mod:`egress_client.retry` says when it waits and how
        long). Every attempt sends the same envelope (same ids and idempotency key, so
        the sidecar replays an answer it already has), its ``timeout`` cut to the time
        left."""
        policy = retry or RetryPolicy()
        deadline = time.monotonic() + deadline_s
        request = self.request(target, endpoint, method, parameters, **options)
        attempt = 0
        while True:
            attempt += 1
            left = deadline - time.monotonic()
            try:
                response = self.send(
                    request.model_copy(update={"timeout": min(request.timeout, max(left, 0.001))})
                )
                if response.success:
                    return response
                error = error_for(response)
            except EgressError as exc:
                error = exc
            wait = retry_wait(error, attempt, deadline - time.monotonic(), policy, self._rng)
            if wait is None:
                raise error
            time.sleep(wait)


class CallStream:
    """One streamed call: iterate it for the upstream's events; ``response`` is the
    final :class:`ExternalCallResponse` once the iteration has ended (None before).
    Raises :class:`egress_client.errors.StreamInterrupted` when the sidecar's stream
    ends without its final event (the sidecar was stopped mid-way), and
    :class:`egress_client.errors.ResponseTooLarge` for one event over the client's
    ``max_event_chars`` (memory stays bounded whatever the stream sends)."""

    def __init__(self, client: EgressClient, request: ExternalCallRequest) -> None:
        self.request = request
        self.response: ExternalCallResponse | None = None
        self._client = client
        self._http: httpx.Response | None = None
        self._final = _core.FinalEvent()
        self._events: Iterator[ServerSentEvent] | None = None

    def __enter__(self) -> Self:
        client = self._client
        built = client._http.build_request(
            "POST",
            client.base_url + _core.CALLS_PATH,
            content=_core.payload(self.request),
            headers=_core.http_headers(stream=True),
            timeout=_core.http_timeout(
                self.request, connect_s=client._connect_s, margin_s=client._margin_s
            ),
        )
        try:
            self._http = client._http.send(built, stream=True)
        except httpx.RequestError as exc:
            raise _core.transport_error(exc, self.request) from exc
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._http is not None:
            self._http.close()  # hanging up closes the upstream request at the sidecar

    def __iter__(self) -> Iterator[ServerSentEvent]:
        if self._http is None:
            raise RuntimeError("use the stream in a `with` block")
        if self._events is None:  # one reading of the answer, however often iterated
            self._events = self._read(self._http)
        return self._events

    def _read(self, answer: httpx.Response) -> Iterator[ServerSentEvent]:
        content_type = answer.headers.get("content-type", "")
        if not content_type.startswith(_core.EVENT_STREAM):  # refused before the stream
            try:
                body = answer.read()
            except httpx.RequestError as exc:
                raise _core.transport_error(exc, self.request) from exc
            self.response = _core.decode_answer(answer.status_code, content_type, body)
            return
        decoder = SSEDecoder(max_event_chars=self._client._max_event_chars)
        try:
            for chunk in answer.iter_bytes():
                yield from self._final.push(decoder.feed(chunk))
            yield from self._final.push(decoder.close())
        except httpx.RequestError as exc:
            raise _core.stream_cut(self._final.relayed) from exc
        except ValueError as exc:  # one event over max_event_chars
            raise _core.event_too_large(str(exc)) from exc
        self.response = self._final.response()

    def final(self) -> ExternalCallResponse:
        """Read (and drop) the events not iterated yet; return the final response."""
        for _ in self:
            pass
        assert self.response is not None
        return self.response
