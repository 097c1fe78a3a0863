"""``egress-gateway approvals list|show|approve|deny``, ``dead-letters
list|show|replay|discard`` and ``console``: the operator's desk, through a sidecar's ops
listener (:mod:`gateway.server.desk`).

    egress-gateway approvals list                 # pending requests, newest first
    egress-gateway approvals show apr_3f...       # the exact call: target, tool, arguments
    egress-gateway approvals approve apr_3f...    # or deny
    egress-gateway dead-letters list
    egress-gateway dead-letters replay dl_9a...   # once, with the call's idempotency key
    egress-gateway console --listen 127.0.0.1:8190

The sidecar is found at ``--ops-url``, else ``EGRESS_GATEWAY_OPS_URL``, else
``http://127.0.0.1:8182``. The operator token is read from ``--token-file``, else
``EGRESS_OPERATOR_TOKEN`` (never from a flag: command lines are visible to every
process). ``list`` prints one line per item, the others the sidecar's JSON answer.
Exit codes: 0 done, 1 refused or unreachable (the sidecar's answer on stderr), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import IO, Any, Final

from gateway.terminal import inert

OPS_URL_ENV: Final = "EGRESS_GATEWAY_OPS_URL"
TOKEN_ENV: Final = "EGRESS_OPERATOR_TOKEN"  # noqa: S105 - a variable's name
DEFAULT_OPS_URL: Final = "http://127.0.0.1:8182"
_ACTIONS: Final = {
    "approvals": {"list": None, "show": None, "approve": "approve", "deny": "deny"},
    "dead-letters": {"list": None, "show": None, "replay": "replay", "discard": "discard"},
}
_PATHS: Final = {"approvals": "/v1/approvals", "dead-letters": "/v1/dead-letters"}


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ops-url", default=None, help=f"the ops listener (env {OPS_URL_ENV})")
    p.add_argument("--token-file", default=None, help=f"operator token file (env {TOKEN_ENV})")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait")


def register(sub: Any) -> None:
    """Add ``approvals``, ``dead-letters`` and ``console`` to the sub-command parser."""
    helps = {
        "approvals": "list, show, approve or deny calls held for a person's approval",
        "dead-letters": "list, show, replay or discard calls that failed for good",
    }
    for noun, actions in _ACTIONS.items():
        p = sub.add_parser(noun, help=helps[noun])
        p.add_argument("action", choices=list(actions))
        p.add_argument("id", nargs="?", help="the request's or dead letter's id")
        p.add_argument("--state", default=None, help="list only this state (approvals)")
        _common(p)
        p.set_defaults(func=_run, noun=noun)
    p = sub.add_parser("console", help="serve the operator's web console")
    p.add_argument("--listen", default="127.0.0.1:8190", help="HOST:PORT to serve on")
    _common(p)
    p.set_defaults(func=_console)


def token(args: argparse.Namespace) -> str | None:
    """The operator token: ``--token-file``, else ``EGRESS_OPERATOR_TOKEN``."""
    if args.token_file:
        return Path(args.token_file).read_text().strip()
    return os.environ.get(TOKEN_ENV) or None


def ops_url(args: argparse.Namespace) -> str:
    """The ops listener's base URL (flag, environment, default)."""
    return str(args.ops_url or os.environ.get(OPS_URL_ENV) or DEFAULT_OPS_URL).rstrip("/")


def _request(args: argparse.Namespace, method: str, path: str) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    secret = token(args)
    if secret:
        headers["Authorization"] = f"Bearer {secret}"
    req = urllib.request.Request(  # noqa: S310 - the URL is the operator's sidecar
        ops_url(args) + path, data=b"{}" if method == "POST" else None, method=method,
        headers=headers,
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as resp:  # noqa: S310
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _run(args: argparse.Namespace, out: IO[str] | None = None) -> int:
    out = out or sys.stdout
    action = _ACTIONS[args.noun][args.action]
    if args.action != "list" and not args.id:
        print(f"egress-gateway {args.noun} {args.action}: an id is required", file=sys.stderr)
        return 2
    path = _PATHS[args.noun]
    if args.action == "list":
        query = {"state": args.state} if args.state else {}
        path += "?" + urllib.parse.urlencode(query) if query else ""
    else:
        path += "/" + urllib.parse.quote(args.id, safe="")
        path += f"/{action}" if action else ""
    try:
        status, raw = _request(args, "POST" if action else "GET", path)
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        reason = getattr(exc, "reason", exc)
        print(f"cannot reach the sidecar at {ops_url(args)}: {reason}", file=sys.stderr)
        return 1
    text = raw.decode("utf-8", errors="replace")
    if status != 200:
        print(inert(text, keep="\n"), file=sys.stderr)
        return 1
    if args.action == "list":
        for line in _lines(args.noun, json.loads(text)):
            print(inert(line), file=out)
    else:
        # JSON escapes C0 controls inside its strings: its own raw newlines are its layout.
        shown = json.dumps(json.loads(text), indent=2, ensure_ascii=False)
        print(inert(shown, keep="\n"), file=out)
    return 0


def _lines(noun: str, answer: dict[str, Any]) -> list[str]:
    """One line per item: id, state or error, target, what, who, when."""
    if noun == "approvals":
        return [
            f"{a['id']}  {a['state']:<8}  {a['target']}  {a['kind']} {a['name']}  "
            f"agent={a['agent']} trace={a['trace']}  {_when(a['requested_at'])}"
            for a in answer["approvals"]
        ]
    return [
        f"{d['id']}  {d['error']['code']:<18}  {d['target']}  "
        f"{d['request'].get('method', '')} {d['request'].get('endpoint', '')}  "
        f"trace={d['trace_id']}  {_when(d['created_at'])}"
        for d in answer["dead_letters"]
    ]


def _when(epoch_s: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch_s))


def _console(args: argparse.Namespace) -> int:
    from gateway.console.server import run_console

    host, _, port = args.listen.rpartition(":")
    return run_console(ops_url(args), host=host or "127.0.0.1", port=int(port))
