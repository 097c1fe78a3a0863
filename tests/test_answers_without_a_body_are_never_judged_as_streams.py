"""An answer that has no body by definition (to a HEAD request, RFC 9110 section 9.3.2:
the headers a GET would get, ``Content-Type: text/event-stream`` included; a 204) is
never relayed or judged as a stream: it has no events and no terminal marker to
wait for. It is passed on as a success on every route, with or without ``Accept:
text/event-stream``, as the assembled path already judged it; one audit record.
"""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web

from tests.conftest import compile_policy, envelope, openai_target
from tests.test_stream_relay import _final

SSE = b'data: {"choices":[]}\n\ndata: [DONE]\n\n'


async def _event_stream_headers(request: web.Request) -> web.StreamResponse:
    status = int(request.query.get("status", "200"))
    return web.Response(status=status, body=SSE, content_type="text/event-stream")


#: name -> (method, status the upstream answers with)
BODYLESS = {"head": ("HEAD", 200), "no-content": ("GET", 204)}


@pytest.mark.parametrize("accept", [True, False], ids=["stream-asked", "no-accept"])
@pytest.mark.parametrize("route", ["envelope", "drop-in"])
@pytest.mark.parametrize("case", list(BODYLESS))
async def test_a_bodyless_answer_with_an_event_stream_type_is_a_success(
    upstream_factory: Any, sidecar_factory: Any, case: str, route: str, accept: bool
) -> None:
    method, status = BODYLESS[case]
    up = await upstream_factory(_event_stream_headers)
    endpoints = [{"path": "/v1/events", "methods": ["GET", "HEAD"]}]
    sc = await sidecar_factory(
        compile_policy({"fake-openai": openai_target(up.url, endpoints=endpoints)})
    )
    headers = {"Accept": "text/event-stream"} if accept else {}
    if route == "envelope":
        env = envelope(method=method, endpoint="/v1/events", parameters={"status": status})
        async with sc.session.post(sc.url + "/v1/calls", json=env, headers=headers) as resp:
            raw = await resp.read()
            answer = resp.content_type
        if answer == "application/json":
            assert resp.status == 200, raw
        else:
            assert _final(raw)["success"] is True, raw
    else:
        url = f"{sc.url}/proxy/fake-openai/v1/events?status={status}"
        async with sc.session.request(method, url, headers=headers) as resp:
            assert resp.status == status, await resp.read()
            assert "x-egress-error-code" not in resp.headers
            assert await resp.read() == b""
    assert up.hits == 1
    [record] = sc.audit_records()
    assert record["error_code"] is None
    assert record["status_code"] == status
