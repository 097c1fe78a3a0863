"""``AsyncEgressClient``: the envelope API over an ``httpx.AsyncClient`` (asyncio)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Mapping
from types import TracebackType
from typing import Any, Self, Unpack

import httpx

from egress_client import _core
from egress_client._core import CallOptions
from egress_client.errors import EgressError, error_for
from egress_client.models import ExternalCallRequest, ExternalCallResponse, HttpMethod
from egress_client.retry import RetryPolicy, retry_wait
from egress_client.sse import ServerSentEvent, SSEDecoder


class AsyncEgressClient:
    """The asyncio twin of :class:`egress_client.EgressClient`: the same arguments, the
    same answers and errors; close it with ``await aclose()`` or ``async with``."""

    def __init__(
        self,
        base_url: str | None = None,
        *,
        agent_id: str | None = None,
        http_client: httpx.AsyncClient | None = None,
        connect_timeout_s: float = 5.0,
        timeout_margin_s: float = 5.0,
        max_event_chars: int = 16 * 1024 * 1024,
    ) -> None:
        self.base_url = _core.base_url(base_url)
        self.agent_id = agent_id
        self._own = http_client is None
        self._http = http_client if http_client is not None else httpx.AsyncClient()
        self._connect_s = connect_timeout_s
        self._margin_s = timeout_margin_s
        self._max_event_chars = max_event_chars
        self._rng = random.Random()  # noqa: S311 - jitter, not secrets

    async def aclose(self) -> None:
        """Close the HTTP client this client made (idempotent)."""
        if self._own:
            await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

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

    async def call(
        self,
        target: str,
        endpoint: str,
        method: HttpMethod,
        parameters: Mapping[str, Any] | None = None,
        **options: Unpack[CallOptions],
    ) -> ExternalCallResponse:
        """One call through the sidecar (see :meth:`egress_client.EgressClient.call`)."""
        return await self.send(self.request(target, endpoint, method, parameters, **options))

    async def send(self, request: ExternalCallRequest) -> ExternalCallResponse:
        """Send a built envelope; returns the sidecar's answer."""
        try:
            answer = await self._http.post(
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
    ) -> AsyncCallStream:
        """A streamed call, used as an async context manager::

        async with client.stream("openai", "/v1/chat/completions", "POST", body) as s:
            async for event in s:         # the upstream's events, as they arrive
                ...
        s.response                        # the final ExternalCallResponse
        """
        request = self.request(target, endpoint, method, parameters, **options)
        return AsyncCallStream(self, request)

    async def call_with_retries(
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
        """:meth:`call` tried again while the error says it may help, within
        ``deadline_s`` (see :meth:`egress_client.EgressClient.call_with_retries`)."""
        policy = retry or RetryPolicy()
        deadline = time.monotonic() + deadline_s
        request = self.request(target, endpoint, method, parameters, **options)
        attempt = 0
        while True:
            attempt += 1
            left = deadline - time.monotonic()
            try:
                response = await self.send(
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
            await asyncio.sleep(wait)


class AsyncCallStream:
    """One streamed call (see :class:`egress_client.client.CallStream`)."""

    def __init__(self, client: AsyncEgressClient, request: ExternalCallRequest) -> None:
        self.request = request
        self.response: ExternalCallResponse | None = None
        self._client = client
        self._http: httpx.Response | None = None
        self._final = _core.FinalEvent()
        self._events: AsyncIterator[ServerSentEvent] | None = None

    async def __aenter__(self) -> Self:
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
            self._http = await client._http.send(built, stream=True)
        except httpx.RequestError as exc:
            raise _core.transport_error(exc, self.request) from exc
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._http is not None:
            await self._http.aclose()  # hanging up closes the upstream request at the sidecar

    def __aiter__(self) -> AsyncIterator[ServerSentEvent]:
        if self._http is None:
            raise RuntimeError("use the stream in an `async with` block")
        if self._events is None:  # one reading of the answer, however often iterated
            self._events = self._read(self._http)
        return self._events

    async def _read(self, answer: httpx.Response) -> AsyncIterator[ServerSentEvent]:
        content_type = answer.headers.get("content-type", "")
        if not content_type.startswith(_core.EVENT_STREAM):  # refused before the stream
            try:
                body = await answer.aread()
            except httpx.RequestError as exc:
                raise _core.transport_error(exc, self.request) from exc
            self.response = _core.decode_answer(answer.status_code, content_type, body)
            return
        decoder = SSEDecoder(max_event_chars=self._client._max_event_chars)
        try:
            async for chunk in answer.aiter_bytes():
                for event in self._final.push(decoder.feed(chunk)):
                    yield event
            for event in self._final.push(decoder.close()):
                yield event
        except httpx.RequestError as exc:
            raise _core.stream_cut(self._final.relayed) from exc
        except ValueError as exc:  # one event over max_event_chars
            raise _core.event_too_large(str(exc)) from exc
        self.response = self._final.response()

    async def final(self) -> ExternalCallResponse:
        """Read (and drop) the events not iterated yet; return the final response."""
        async for _ in self:
            pass
        assert self.response is not None
        return self.response
