"""``egress-gateway console``: the operator's web page, a small aiohttp.web server of its
own (docs/console.md).

It reads and acts through one sidecar's ops routes (:mod:`gateway.server.desk`) with
the operator's token: approvals (shared by every sidecar on the same Redis with
``approvals.scope: cluster``), that sidecar's dead letters, stop switches, budgets,
breakers and the recent calls of its audit file. Server-rendered
(:mod:`gateway.console.page`); no build step.

Sessions: ``POST /login`` checks the token against the sidecar (``GET
/v1/desk/overview``) and keeps it in this process's memory under a random session id,
sent back as an ``HttpOnly``, ``SameSite=Strict`` cookie; the browser never holds the
token. Sessions end at ``POST /logout`` or after :data:`SESSION_TTL_S`. Every POST form
carries the session's CSRF token (compared in constant time), and a POST whose
``Origin`` is another site is refused (403). Answers carry a strict
Content-Security-Policy (scripts and styles from this server only, no frames).
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Final

import aiohttp
from aiohttp import web

from gateway.console import page

COOKIE: Final = "egw_console"
#: A session lives this long (seconds) after sign-in.
SESSION_TTL_S: Final = 8 * 3600.0
#: Sessions kept at most (the oldest forgotten first).
MAX_SESSIONS: Final = 256
#: Sign-in forms whose CSRF token is kept at most (the oldest forgotten first): anyone
#: who reaches the port may ask for the form, so their number is bounded.
MAX_LOGIN_FORMS: Final = 1024
#: Seconds to wait for the sidecar's ops routes.
OPS_TIMEOUT_S: Final = 30.0
_HEADERS: Final = {
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; script-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


@dataclass
class Session:
    token: str
    csrf: str
    started: float


class Console:
    """The console's state: the sidecar's ops URL, the HTTP client, the sessions."""

    def __init__(self, ops_url: str) -> None:
        self.ops_url = ops_url.rstrip("/")
        self.sessions: dict[str, Session] = {}
        self.login_csrf: dict[str, float] = {}  # a login form's token -> when issued
        self.client: aiohttp.ClientSession | None = None

    async def ops(self, token: str, method: str, path: str) -> tuple[int, Any]:
        """One request to the ops routes: ``(status, JSON answer)``; 502 when unreachable."""
        assert self.client is not None
        headers = {"Authorization": f"Bearer {token}"}
        try:
            async with self.client.request(
                method,
                self.ops_url + path,
                headers=headers,
                data=b"{}" if method == "POST" else None,
            ) as resp:
                return resp.status, await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            message = f"the sidecar at {self.ops_url} did not answer ({type(exc).__name__})"
            return 502, {"error": {"message": message}}

    def session(self, request: web.Request) -> Session | None:
        sid = request.cookies.get(COOKIE, "")
        found = self.sessions.get(sid)
        if found is None or time.monotonic() - found.started > SESSION_TTL_S:
            self.sessions.pop(sid, None)
            return None
        return found

    def open_session(self, token: str) -> tuple[str, Session]:
        while len(self.sessions) >= MAX_SESSIONS:
            self.sessions.pop(next(iter(self.sessions)))
        sid = secrets.token_urlsafe(32)
        self.sessions[sid] = Session(token, secrets.token_urlsafe(32), time.monotonic())
        return sid, self.sessions[sid]


_CONSOLE: Final = web.AppKey("console", Console)


def create_console_app(ops_url: str) -> web.Application:
    """The console's application, talking to the ops listener at ``ops_url``."""
    app = web.Application(middlewares=[_security])
    console = app[_CONSOLE] = Console(ops_url)

    async def client(_: web.Application) -> AsyncIterator[None]:
        timeout = aiohttp.ClientTimeout(total=OPS_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            console.client = session
            yield

    app.cleanup_ctx.append(client)
    app.router.add_get("/", _desk)
    app.router.add_get("/login", _login_form)
    app.router.add_post("/login", _login)
    app.router.add_post("/logout", _logout)
    app.router.add_post("/{kind:approvals|dead-letters}/{id}/{action}", _act)
    app.router.add_get("/static/console.css", _static(page.CSS, "text/css"))
    app.router.add_get("/static/console.js", _static(page.JS, "text/javascript"))
    return app


@web.middleware
async def _security(request: web.Request, handler: Any) -> web.StreamResponse:
    origin = request.headers.get("Origin")
    if request.method == "POST" and origin not in (None, f"{request.scheme}://{request.host}"):
        raise web.HTTPForbidden(text="cross-site form posts are refused")
    response: web.StreamResponse = await handler(request)
    response.headers.update(_HEADERS)
    return response


def _static(text: str, content_type: str) -> Any:
    async def serve(_: web.Request) -> web.Response:
        return web.Response(text=text, content_type=content_type)

    return serve


def _html(text: str, status: int = 200) -> web.Response:
    return web.Response(text=text, status=status, content_type="text/html", charset="utf-8")


async def _login_form(request: web.Request, error: str | None = None) -> web.Response:
    console = request.app[_CONSOLE]
    now = time.monotonic()
    forms = console.login_csrf  # oldest first (insertion order)
    while forms and (len(forms) >= MAX_LOGIN_FORMS or now - next(iter(forms.values())) > 3600):
        del forms[next(iter(forms))]
    csrf = secrets.token_urlsafe(24)
    console.login_csrf[csrf] = now
    return _html(page.login_page(error, csrf), 401 if error else 200)


async def _login(request: web.Request) -> web.StreamResponse:
    console = request.app[_CONSOLE]
    form = await request.post()
    csrf, token = str(form.get("csrf", "")), str(form.get("token", "")).strip()
    if console.login_csrf.pop(csrf, None) is None:
        return await _login_form(request, "The form expired; sign in again.")
    status, answer = await console.ops(token, "GET", "/v1/desk/overview") if token else (401, {})
    if status != 200:
        message = (answer.get("error") or {}).get("message") or "The token was refused."
        return await _login_form(request, f"Not signed in: {message}")
    sid, _ = console.open_session(token)
    response = web.HTTPSeeOther("/")
    response.set_cookie(COOKIE, sid, httponly=True, samesite="Strict", path="/")
    raise response


def _checked(request: web.Request, form: Any) -> Session:
    """The request's session when its form carries the session's CSRF token; else 303
    to the login page, or 403."""
    session = request.app[_CONSOLE].session(request)
    if session is None:
        raise web.HTTPSeeOther("/login")
    if not hmac.compare_digest(str(form.get("csrf", "")).encode(), session.csrf.encode()):
        raise web.HTTPForbidden(text="the form's CSRF token is missing or wrong")
    return session


async def _logout(request: web.Request) -> web.StreamResponse:
    _checked(request, await request.post())
    request.app[_CONSOLE].sessions.pop(request.cookies.get(COOKIE, ""), None)
    response = web.HTTPSeeOther("/login")
    response.del_cookie(COOKIE, path="/")
    raise response


async def _act(request: web.Request) -> web.StreamResponse:
    session = _checked(request, await request.post())
    kind, item, action = (request.match_info[k] for k in ("kind", "id", "action"))
    allowed = {"approvals": ("approve", "deny"), "dead-letters": ("replay", "discard")}
    if action not in allowed[kind]:
        raise web.HTTPNotFound()
    path = f"/v1/{kind}/{urllib.parse.quote(item, safe='')}/{action}"
    status, answer = await request.app[_CONSOLE].ops(session.token, "POST", path)
    if status == 200:
        message, error = _done(kind, item, action, answer), "0"
    else:
        message, error = (answer.get("error") or {}).get("message") or f"HTTP {status}", "1"
    query = urllib.parse.urlencode({"msg": message, "err": error})
    raise web.HTTPSeeOther(f"/?{query}")


def _done(kind: str, item: str, action: str, answer: dict[str, Any]) -> str:
    if kind == "approvals":
        return f"{item}: {answer.get('state')} by {answer.get('decided_by')}"
    if action == "replay":
        response = answer.get("response") or {}
        outcome = (
            "succeeded" if response.get("success") else (response.get("error") or {}).get("code")
        )
        return f"{item} replayed: HTTP {answer.get('status')}, {outcome}"
    return f"{item} discarded"


async def _desk(request: web.Request) -> web.StreamResponse:
    console = request.app[_CONSOLE]
    session = console.session(request)
    if session is None:
        raise web.HTTPSeeOther("/login")
    agent, trace = request.query.get("agent", "")[:256], request.query.get("trace", "")[:256]
    calls_query = urllib.parse.urlencode(
        {k: v for k, v in (("agent", agent), ("trace", trace)) if v}
    )
    paths = (
        "/v1/desk/overview",
        "/v1/approvals",
        "/v1/dead-letters",
        f"/v1/desk/calls?{calls_query}",
    )
    answers = await asyncio.gather(*(console.ops(session.token, "GET", p) for p in paths))
    if any(status == 401 for status, _ in answers):  # the token was rotated or removed
        console.sessions.pop(request.cookies.get(COOKIE, ""), None)
        raise web.HTTPSeeOther("/login")
    failed = [a for status, a in answers if status != 200]
    if failed:
        message = (failed[0].get("error") or {}).get("message", "the sidecar failed")
        return _html(page.login_page(f"The sidecar answered with an error: {message}", ""), 502)
    (_, overview), (_, approvals), (_, letters), (_, calls) = answers
    data = {
        "overview": overview,
        "approvals": approvals["approvals"],
        "dead_letters": letters["dead_letters"],
        "calls": calls,
        "agent": agent,
        "trace": trace,
    }
    flash = request.query.get("msg")
    return _html(page.desk_page(data, session.csrf, flash, request.query.get("err") == "1"))


def run_console(ops_url: str, *, host: str, port: int) -> int:
    """Serve the console until interrupted; 0."""
    print(f"egress-gateway console on http://{host}:{port}/ (sidecar ops API {ops_url})")
    web.run_app(create_console_app(ops_url), host=host, port=port, print=None)
    return 0
