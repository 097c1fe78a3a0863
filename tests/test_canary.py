"""A canary secret, used in every kind of call, appears in no log line, answer or error."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, quote_plus

from aiohttp import web
from yarl import URL

from tests.conftest import compile_policy, envelope

CANARY = "canary-SECRET-9f3b1c7e-NOT-REAL"


def _pieces(secret: str, size: int = 12) -> list[str]:
    return [secret[i : i + size] for i in range(len(secret) - size + 1)]


async def test_canary_never_leaves_the_outgoing_request(
    upstream_factory, sidecar_factory, monkeypatch, unused_tcp_port
):
    monkeypatch.setenv("CANARY_KEY", CANARY)
    never = asyncio.Event()

    async def upstream(request: web.Request) -> web.StreamResponse:
        mode = request.path.rsplit("/", 1)[-1]
        echo = {
            "seen_header": request.headers.get("Authorization"),
            "seen_query": request.query_string,
            "url": str(request.url),
        }
        if mode == "ok":
            return web.json_response(echo)
        if mode == "html":
            return web.Response(status=500, text=f"<pre>{echo}</pre>", content_type="text/html")
        if mode == "denied":
            return web.json_response(echo, status=401)
        if mode == "redirect":
            return web.Response(
                status=307, headers={"Location": f"http://127.0.0.1:1/x?key={CANARY}"}
            )
        if mode == "drop":
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        await never.wait()
        return web.Response()

    up = await upstream_factory(upstream)
    endpoints = [{"path": "/v1/*", "methods": ["GET", "POST"]}]
    targets = {
        "in-header": {
            "base_url": up.url,
            "endpoints": endpoints,
            "credential": {
                "header": "Authorization",
                "format": "Bearer {secret}",
                "default_ref": "env://CANARY_KEY",
            },
        },
        "in-query": {
            "base_url": up.url,
            "endpoints": endpoints,
            "credential": {"query_param": "key", "default_ref": "env://CANARY_KEY"},
        },
        "refused": {
            "base_url": f"http://127.0.0.1:{unused_tcp_port}",
            "endpoints": endpoints,
            "credential": {"query_param": "key", "default_ref": "env://CANARY_KEY"},
        },
    }
    sc = await sidecar_factory(compile_policy(targets))
    answers = []
    for target in ("in-header", "in-query"):
        for mode in ("ok", "html", "denied", "redirect", "drop", "hang"):
            for method in ("GET", "POST"):
                _, answer = await sc.call(
                    envelope(
                        target_system=target,
                        endpoint=f"/v1/{mode}",
                        method=method,
                        api_key_ref=...,
                        timeout=0.3,
                        max_retries=1,
                        parameters={},
                    )
                )
                answers.append(answer)
    _, answer = await sc.call(
        envelope(target_system="refused", endpoint="/v1/ok", api_key_ref=..., max_retries=1)
    )
    answers.append(answer)

    # The canary was really used on the wire, in both placements.
    assert any(s.headers.get("Authorization") == f"Bearer {CANARY}" for s in up.seen)
    assert any(s.query.get("key") == CANARY for s in up.seen)
    emitted = json.dumps(answers) + sc.log.getvalue()
    for piece in _pieces(CANARY):
        assert piece not in emitted, piece
    # And it was scrubbed, not just absent: the echoing upstream's answers were redacted.
    assert "[REDACTED]" in json.dumps(answers)
    codes = {a["error"]["code"] for a in answers if a["error"]}
    assert {
        "DEPENDENCY_FAILED",
        "PERMISSION_DENIED",
        "EGRESS_DENIED",
        "OUTCOME_UNKNOWN",
        "AGENT_TIMEOUT",
    } <= codes


# -- a query_param credential, in every form the sidecar may write it --

#: Keys holding what percent-encoding, JSON and repr change: "+", "/", "=", a space,
#: non-ASCII, a quote, a backslash, "%", "&", "#", "?".
ODD_KEYS: dict[str, str] = {
    "ODD_KEY_1": "gk+fake/TEST=0004 NOTREAL-é€-canary-7d1e",
    "ODD_KEY_2": 'gk"fake\\TEST%41&amp;#x?y-canary-3b9f',
}


def _lower_hex(text: str) -> str:
    return re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), text)


def renderings(value: str) -> list[str]:
    """``value`` as an echoing upstream or a writer of the sidecar may show it, computed
    here independently of gateway.redaction: raw; as aiohttp put it on the wire (yarl's
    query encoding) and as aiohttp's ``request.query_string`` shows it; ``quote`` and
    ``quote_plus``; each with lower-case hex too; ``repr``; all of those JSON-escaped
    (ASCII or not) and with ``/`` as ``\\/``."""
    url = URL("http://h/").extend_query([("key", value)])
    percent = [
        url.raw_query_string.removeprefix("key="),
        url.query_string.removeprefix("key="),
        quote(value, safe=""),
        quote(value),
        quote_plus(value),
    ]
    forms = [value, *percent, *(_lower_hex(p) for p in percent)]
    forms += [repr(value)[1:-1], repr(value.encode())[2:-1]]
    escaped = [json.dumps(f, ensure_ascii=a)[1:-1] for f in forms for a in (True, False)]
    return forms + escaped + [f.replace("/", "\\/") for f in forms + escaped]


#: What the echoing upstream shows, by the agent's ``show`` parameter.
_SHOWN: dict[str, Callable[[web.Request], str]] = {
    "raw_path": lambda r: r.raw_path,
    "lower_hex": lambda r: _lower_hex(r.raw_path),
    "query_string": lambda r: r.query_string,
    "decoded": lambda r: r.query.get("key", ""),
    "url": lambda r: str(r.url),
    "json_ascii": lambda r: json.dumps(dict(r.query)),
    "json_slash": lambda r: json.dumps(dict(r.query), ensure_ascii=False).replace("/", "\\/"),
    "repr": lambda r: repr(dict(r.query)),
}
_STATUS = {"ok": 200, "bad": 400, "denied": 401, "boom": 500, "busy": 503}


async def test_a_query_credential_never_leaves_in_any_encoding(
    upstream_factory, sidecar_factory, monkeypatch
):
    for name, value in ODD_KEYS.items():
        monkeypatch.setenv(name, value)

    async def echo(request: web.Request) -> web.StreamResponse:
        status_name, _, kind = request.path.rsplit("/", 1)[-1].partition("-")
        status = _STATUS[status_name]
        if kind == "json":  # every form at once: JSON data is never cut
            shown = {name: show(request) for name, show in _SHOWN.items()}
            shown["headers"] = json.dumps(dict(request.headers))
            return web.json_response(shown, status=status)
        text = f"request {_SHOWN[request.query['show']](request)} failed"
        if kind == "html":
            return web.Response(status=status, text=f"<pre>{text}</pre>", content_type="text/html")
        return web.Response(status=status, text=text)

    up = await upstream_factory(echo)
    targets = {
        name.lower().replace("_", "-"): {
            "base_url": up.url,
            "endpoints": [{"path": "/v1/*", "methods": ["GET", "POST"]}],
            "credential": {"query_param": "key", "default_ref": f"env://{name}"},
            "retry": {"max_retries": 0},
            "circuit_breaker": None,  # every answer must come from the echoing upstream
        }
        for name in ODD_KEYS
    }
    sc = await sidecar_factory(compile_policy(targets))
    bodies: list[str] = []
    codes: set[str] = set()
    for target in targets:
        for status_name in _STATUS:
            calls = [("GET", f"/v1/{status_name}-json", {"alt": "json"})]
            calls.append(("POST", f"/v1/{status_name}-json", {"msg": "hi"}))
            calls += [
                ("GET", f"/v1/{status_name}-{kind}", {"show": show})
                for kind in ("text", "html")
                for show in _SHOWN
            ]
            for method, endpoint, parameters in calls:
                async with sc.session.post(
                    sc.url + "/v1/calls",
                    json=envelope(
                        target_system=target,
                        endpoint=endpoint,
                        method=method,
                        parameters=parameters,
                        api_key_ref=...,
                        max_retries=0,
                    ),
                ) as resp:
                    body = await resp.text()
                bodies.append(body)
                answer = json.loads(body)
                codes.add(answer["error"]["code"] if answer["error"] else "OK")

    # The keys were really used, exactly, on the wire.
    for name, value in ODD_KEYS.items():
        assert any(s.query.get("key") == value for s in up.seen), name
    assert all(list(s.query).count("key") == 1 for s in up.seen)
    assert codes == {"OK", "UPSTREAM_REJECTED", "PERMISSION_DENIED", "DEPENDENCY_FAILED"}
    emitted = "".join(bodies) + sc.log.getvalue()
    assert "[REDACTED]" in "".join(bodies)  # scrubbed, not merely absent
    for value in ODD_KEYS.values():
        for form in renderings(value):
            for piece in _pieces(form):
                if piece in emitted:
                    i = emitted.index(piece)
                    raise AssertionError((form, piece, emitted[max(0, i - 300) : i + 100]))


async def test_an_agent_parameter_named_like_the_query_credential_is_refused(
    upstream_factory, sidecar_factory, monkeypatch
):
    monkeypatch.setenv("CANARY_KEY", CANARY)
    up = await upstream_factory()
    target = {
        "base_url": up.url,
        "endpoints": [{"path": "/v1beta/models/*", "methods": ["GET", "POST", "DELETE"]}],
        "credential": {"query_param": "key", "default_ref": "env://CANARY_KEY"},
    }
    sc = await sidecar_factory(compile_policy({"fake-gemini": target}))

    def call(method: str, parameters: dict[str, Any]) -> dict[str, Any]:
        return envelope(
            target_system="fake-gemini",
            endpoint="/v1beta/models/m",
            method=method,
            parameters=parameters,
            api_key_ref=...,
        )

    names = ["key", "KEY", "k%65y", "key[]", "\uff4b\uff45\uff59"]  # fullwidth
    for method in ("GET", "DELETE"):
        for name in names:
            status, answer = await sc.call(call(method, {"alt": "json", name: "agent-key"}))
            assert status == 403
            assert answer["error"]["code"] == "PERMISSION_DENIED"
            assert answer["error"]["retryable"] is False
            assert answer["error"]["details"] == {
                "reason": "credential_parameter",
                "parameter": name,
            }
    assert up.hits == 0  # nothing forwarded
    records = sc.audit_records()
    assert len(records) == 2 * len(names)
    assert {r["decision"] for r in records} == {"denied"}
    # In a POST the parameters are the JSON body: the query holds the credential alone.
    status, _ = await sc.call(call("POST", {"key": "agent-key"}))
    assert status == 200
    assert up.seen[-1].query == {"key": CANARY}
    assert up.seen[-1].json() == {"key": "agent-key"}
    status, _ = await sc.call(call("GET", {"monkey": "1"}))
    assert status == 200
    assert up.seen[-1].query == {"monkey": "1", "key": CANARY}
