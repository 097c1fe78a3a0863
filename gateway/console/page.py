"""The console's HTML (pure: data in, text out; every value escaped).

One dense page in the manner of Prometheus' and Vault's own UIs: a dark bar, sections of
compact tables, monospace for ids and arguments, state shown as text and colour. Built
for the keyboard and screen readers: a skip link, landmarks, one ``h2`` per section,
captions and ``th scope``, a ``label`` for every field, real buttons in real forms (each
POST form carries the session's CSRF token), visible focus. A few lines of script only
refresh the page every 10 s when the operator ticks "auto-refresh".
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from html import escape
from typing import Any, Final

CSS: Final = """
:root{--bar:#1c2b36;--fg:#1b1f23;--muted:#586069;--line:#d1d5da;--ok:#1a7f37;--warn:#9a6700;
--bad:#cf222e;--link:#0550ae;font:13px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif}
body{margin:0;color:var(--fg);background:#f6f8fa}
a{color:var(--link)}
.skip{position:absolute;left:-9999px}.skip:focus{left:8px;top:8px;background:#fff;padding:4px}
header{background:var(--bar);color:#fff;display:flex;gap:16px;align-items:center;padding:6px 16px}
header h1{font-size:15px;margin:0;font-weight:600}header nav a{color:#c8e1ff;margin-right:12px}
header form{margin-left:auto}
main{padding:8px 16px 32px}
section{background:#fff;border:1px solid var(--line);border-radius:4px;margin:10px 0;
padding:6px 10px}
h2{font-size:14px;margin:4px 0 6px}
table{border-collapse:collapse;width:100%}caption{text-align:left;color:var(--muted);padding:2px 0}
th,td{border-bottom:1px solid var(--line);padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f1f3f5;font-weight:600;white-space:nowrap}
code,pre,.mono{font:12px/1.35 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
pre{margin:0;white-space:pre-wrap;word-break:break-all;max-width:48em}
.state{font-weight:600}.pending,.half-open{color:var(--warn)}.approved,.used,.closed{color:var(--ok)}
.denied,.expired,.open,.err{color:var(--bad)}
.muted{color:var(--muted)}
button,input{font:inherit}button{padding:1px 8px;border:1px solid #8c959f;border-radius:3px;
background:#f6f8fa;cursor:pointer}button.yes{border-color:var(--ok)}button.no{border-color:var(--bad)}
:focus-visible{outline:2px solid #0969da;outline-offset:1px}
.flash{border-left:4px solid var(--link);background:#ddf4ff;padding:6px 10px;margin:8px 0}
.flash.err{border-color:var(--bad);background:#ffebe9}
form.inline{display:inline}.filters{display:flex;gap:8px;align-items:end;margin-bottom:6px}
.filters label{display:flex;flex-direction:column;color:var(--muted)}
meter{width:120px}
"""
JS: Final = """
(function(){var box=document.getElementById('auto');if(!box)return;
box.checked=sessionStorage.getItem('auto')==='1';
box.addEventListener('change',function(){sessionStorage.setItem('auto',box.checked?'1':'0')});
setInterval(function(){if(box.checked&&!document.activeElement.closest('form.filters'))
location.reload()},10000)})();
"""


def _t(value: Any) -> str:
    return escape("" if value is None else str(value))


def _when(epoch_s: Any) -> str:
    if not isinstance(epoch_s, int | float):
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(epoch_s))


def _head(title: str) -> str:
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f'<title>{_t(title)}</title><link rel="stylesheet" href="/static/console.css"></head>'
    )


def login_page(error: str | None, csrf: str) -> str:
    """The login form (one labelled password field for the operator token)."""
    flash = f'<p class="flash err" role="alert">{_t(error)}</p>' if error else ""
    return (
        _head("Sign in - egress-gateway console")
        + '<body><header><h1>egress-gateway console</h1></header><main id="main">'
        + "<section><h2>Sign in</h2>"
        + flash
        + '<form method="post" action="/login">'
        + f'<input type="hidden" name="csrf" value="{_t(csrf)}">'
        + '<p><label for="token">Operator token</label><br>'
        + '<input id="token" name="token" type="password" autocomplete="current-password" '
        + 'required autofocus size="40"></p>'
        + '<p><button type="submit">Sign in</button></p></form>'
        + '<p class="muted">The token of an operator of the sidecar\'s policy '
        + "(<code>operators:</code>). It stays on this server; the browser keeps a "
        + "session cookie only.</p></section></main></body></html>"
    )


def _button(action: str, label: str, what: str, csrf: str, cls: str) -> str:
    return (
        f'<form class="inline" method="post" action="{_t(action)}">'
        f'<input type="hidden" name="csrf" value="{_t(csrf)}">'
        f'<button type="submit" class="{cls}" aria-label="{_t(label)} {_t(what)}">'
        f"{_t(label)}</button></form>"
    )


def _table(caption: str, heads: Iterable[str], rows: list[str], empty: str) -> str:
    if not rows:
        return f'<p class="muted">{_t(empty)}</p>'
    head = "".join(f'<th scope="col">{_t(h)}</th>' for h in heads)
    return (
        f"<table><caption>{_t(caption)}</caption><thead><tr>{head}</tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


def _args(value: Any) -> str:
    return f"<pre>{_t(json.dumps(value, indent=1, ensure_ascii=False, sort_keys=True))}</pre>"


def _pending(approvals: list[dict[str, Any]], csrf: str) -> str:
    rows = []
    for a in approvals:
        if a.get("state") != "pending":
            continue
        what = f"{a.get('kind')} {a.get('name')}"
        actions = _button(f"/approvals/{a['id']}/approve", "Approve", a["id"], csrf, "yes")
        actions += " " + _button(f"/approvals/{a['id']}/deny", "Deny", a["id"], csrf, "no")
        rows.append(
            f'<tr id="{_t(a["id"])}"><td class="mono">{_t(a["id"])}</td>'
            f"<td>{_when(a.get('requested_at'))}</td><td>{_t(a.get('target'))}</td>"
            f'<td>{_t(what)} <span class="muted">{_t(a.get("method"))}</span></td>'
            f"<td>{_args(a.get('arguments'))}</td>"
            f'<td>{_t(a.get("agent"))}<br><span class="mono muted">{_t(a.get("trace"))}</span></td>'
            f"<td>{_t(', '.join(a.get('approvers') or []) or 'any operator')}</td>"
            f"<td>{_when(a.get('expires_at'))}</td><td>{actions}</td></tr>"
        )
    heads = ("id", "requested", "target", "call", "arguments", "agent / trace", "approvers",
             "expires", "decide")  # fmt: skip
    return _table("Calls held until an operator decides", heads, rows, "No call waits.")


def _decided(approvals: list[dict[str, Any]]) -> str:
    rows = [
        f'<tr><td class="mono">{_t(a["id"])}</td>'
        f'<td class="state {_t(a.get("state"))}">{_t(a.get("state"))}</td>'
        f"<td>{_t(a.get('target'))}</td><td>{_t(a.get('kind'))} {_t(a.get('name'))}</td>"
        f"<td>{_t(a.get('decided_by'))}</td><td>{_when(a.get('decided_at'))}</td>"
        f"<td>{_when(a.get('used_at'))}</td></tr>"
        for a in approvals
        if a.get("state") != "pending"
    ]
    heads = ("id", "state", "target", "call", "decided by", "decided", "ran")
    return _table("Recent decisions", heads, rows, "No decisions yet.")


def _letters(letters: list[dict[str, Any]], csrf: str) -> str:
    rows = []
    for d in letters:
        req, err = d.get("request") or {}, d.get("error") or {}
        actions = _button(f"/dead-letters/{d['id']}/replay", "Replay", d["id"], csrf, "yes")
        actions += " " + _button(f"/dead-letters/{d['id']}/discard", "Discard", d["id"], csrf, "no")
        rows.append(
            f'<tr id="{_t(d["id"])}"><td class="mono">{_t(d["id"])}</td>'
            f"<td>{_when(d.get('created_at'))}</td><td>{_t(d.get('target'))}</td>"
            f"<td>{_t(req.get('method'))} <code>{_t(req.get('endpoint'))}</code>"
            f"<details><summary>request</summary>{_args(req)}</details></td>"
            f'<td><span class="err">{_t(err.get("code"))}</span> {_t(err.get("message"))}</td>'
            f"<td>{_t(d.get('attempts'))}</td>"
            f'<td class="mono">{_t(d.get("idempotency_key"))}</td>'
            f"<td>{_t(d.get('agent'))}<br>"
            f'<span class="mono muted">{_t(d.get("trace_id"))}</span></td>'
            f"<td>{actions}</td></tr>"
        )
    heads = ("id", "kept", "target", "request", "error", "attempts", "idempotency key",
             "agent / trace", "act")  # fmt: skip
    return _table("Calls that failed for good", heads, rows, "No dead letters.")


def _overview(overview: Mapping[str, Any]) -> str:
    stops = overview.get("stops")
    if stops is None:
        stop_html = '<p class="muted">This sidecar has no stop switch (read-only view).</p>'
    else:
        rows = [
            f"<tr><td>{_t(s.get('scope'))}</td><td>{_t(s.get('name'))}</td>"
            f"<td>{_t(s.get('reason'))}</td><td>{_t(s.get('by'))}</td></tr>"
            for s in stops
        ]
        stop_html = _table("Stops in force", ("scope", "name", "reason", "by"), rows, "No stop.")
    breakers = [
        f'<tr><td>{_t(name)}</td><td class="state {_t(state)}">{_t(state or "none")}</td></tr>'
        for name, state in (overview.get("breakers") or {}).items()
    ]
    budgets = [
        f"<tr><td>{_t(b['name'])}</td><td>{b['spent_usd']:.4f}</td><td>{b['limit_usd']:g}</td>"
        f'<td><meter min="0" max="{b["limit_usd"]}" value="{b["spent_usd"]}" '
        f'aria-label="{_t(b["name"])} spent">{b["spent_usd"]:.4f}</meter></td>'
        f"<td>{_t(b['window'])}, {_t(b['scope'])}</td></tr>"
        for b in overview.get("budgets") or []
    ]
    return (
        '<section aria-labelledby="h-stops"><h2 id="h-stops">Stop switches</h2>'
        + stop_html
        + '</section><section aria-labelledby="h-budgets"><h2 id="h-budgets">Budgets</h2>'
        + _table(
            "Spent against limits (USD)",
            ("budget", "spent", "limit", "", "window"),
            budgets,
            "No budgets in the policy.",
        )
        + '</section><section aria-labelledby="h-breakers"><h2 id="h-breakers">Circuit '
        + "breakers</h2>"
        + _table("State per target", ("target", "state"), breakers, "No targets.")
        + "</section>"
    )


def _calls(calls: Mapping[str, Any], agent: str, trace: str) -> str:
    rows = [
        f"<tr><td>{_t(c.get('timestamp'))}</td><td>{_t(c.get('agent_id'))}</td>"
        f'<td class="mono">{_t(c.get("trace_id"))}</td><td>{_t(c.get("target_system"))}</td>'
        f"<td>{_t(c.get('method'))} <code>{_t(c.get('endpoint'))}</code> "
        f"{_t(c.get('mcp_method') or '')} <code>{_t(c.get('mcp_tool') or '')}</code></td>"
        f"<td>{_t(c.get('status_code'))}</td>"
        f'<td class="{"" if c.get("success") else "err"}">{_t(c.get("error_code") or "OK")}</td>'
        f"<td>{_t(c.get('latency_ms'))}</td></tr>"
        for c in calls.get("calls") or []
    ]
    note = calls.get("note")
    filters = (
        '<form class="filters" method="get" action="/#calls" role="search">'
        f'<label for="agent">Agent<input id="agent" name="agent" value="{_t(agent)}"></label>'
        f'<label for="trace">Trace id<input id="trace" name="trace" value="{_t(trace)}"></label>'
        '<button type="submit">Show</button></form>'
    )
    heads = ("time", "agent", "trace", "target", "request", "status", "code", "latency ms")
    return (
        '<section id="calls" aria-labelledby="h-calls"><h2 id="h-calls">Recent calls</h2>'
        + filters
        + (f'<p class="muted">{_t(note)}</p>' if note else "")
        + _table("From the audit log, newest first", heads, rows, "No calls match.")
        + "</section>"
    )


def desk_page(data: Mapping[str, Any], csrf: str, flash: str | None, error: bool) -> str:
    """The console: ``data`` holds the ops routes' answers (``overview``, ``approvals``,
    ``dead_letters``, ``calls``) and the filters (``agent``, ``trace``)."""
    overview = data["overview"]
    approvals = data["approvals"]
    waiting = sum(1 for a in approvals if a.get("state") == "pending")
    note = (
        f'<p class="flash{" err" if error else ""}" role="status">{_t(flash)}</p>' if flash else ""
    )
    return (
        _head(f"({waiting}) egress-gateway console")
        + '<body><a class="skip" href="#main">Skip to content</a><header>'
        + f"<h1>egress-gateway console</h1><span>agent {_t(overview.get('agent_id'))}</span>"
        + '<nav aria-label="Sections"><a href="#h-approvals">Approvals</a>'
        + '<a href="#h-letters">Dead letters</a><a href="#h-stops">Stops</a>'
        + '<a href="#h-budgets">Budgets</a><a href="#h-calls">Calls</a></nav>'
        + f"<span>{_t(overview.get('operator'))}</span>"
        + '<label><input type="checkbox" id="auto"> auto-refresh</label>'
        + _button("/logout", "Sign out", "", csrf, "")
        + '</header><main id="main">'
        + note
        + '<section aria-labelledby="h-approvals">'
        + f'<h2 id="h-approvals">Approvals <span class="muted">({waiting} waiting)</span></h2>'
        + _pending(approvals, csrf)
        + _decided(approvals)
        + '</section><section aria-labelledby="h-letters"><h2 id="h-letters">Dead letters</h2>'
        + _letters(data["dead_letters"], csrf)
        + "</section>"
        + _overview(overview)
        + _calls(data["calls"], data.get("agent", ""), data.get("trace", ""))
        + '</main><script src="/static/console.js"></script></body></html>'
    )
