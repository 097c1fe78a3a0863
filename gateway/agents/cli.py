"""``egress-gateway stop`` and ``resume``: the operator's stop switch, through a sidecar's
ops listener (:mod:`gateway.server.ops`).

    egress-gateway stop --agent planner-01 --reason "looping on search, ticket 4411"
    egress-gateway stop --target openai --reason "provider incident"
    egress-gateway stop --all --reason "runaway spend"
    egress-gateway resume --agent planner-01 --reason "fixed in 1.4.2"

The sidecar is found at ``--ops-url``, else ``EGRESS_GATEWAY_OPS_URL``, else
``http://127.0.0.1:8182``. The operator token is read from ``--token-file``, else
``EGRESS_OPERATOR_TOKEN`` (never from a flag: command lines are visible to every process).
Exit codes: 0 done, 1 refused or unreachable (the sidecar's answer on stderr), 2 usage.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Final

OPS_URL_ENV: Final = "EGRESS_GATEWAY_OPS_URL"
TOKEN_ENV: Final = "EGRESS_OPERATOR_TOKEN"  # noqa: S105 - a variable's name
DEFAULT_OPS_URL: Final = "http://127.0.0.1:8182"


def register(sub: Any) -> None:
    """Add ``stop`` and ``resume`` to the ``egress-gateway`` sub-command parser."""
    for action, text in (
        ("stop", "stop an agent, a target or every call (AGENT_STOPPED until resumed)"),
        ("resume", "lift a stop"),
    ):
        p = sub.add_parser(action, help=text)
        which = p.add_mutually_exclusive_group(required=True)
        which.add_argument("--agent", help=f"the agent id to {action}")
        which.add_argument("--target", help=f"the target (policy name) to {action}")
        which.add_argument("--all", action="store_true", help="every call of the sidecars")
        p.add_argument("--reason", required=action == "stop", help="why (audited)")
        p.add_argument("--by", default=None, help="who asks (default: your user name)")
        p.add_argument("--ops-url", default=None, help=f"the ops listener (env {OPS_URL_ENV})")
        p.add_argument("--token-file", default=None, help=f"operator token file (env {TOKEN_ENV})")
        p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait")
        p.set_defaults(func=_run, action=action)


def _token(args: argparse.Namespace) -> str | None:
    if args.token_file:
        return Path(args.token_file).read_text().strip()
    return os.environ.get(TOKEN_ENV) or None


def _run(args: argparse.Namespace) -> int:
    scope = "agent" if args.agent else "target" if args.target else "all"
    body: dict[str, Any] = {"scope": scope, "name": args.agent or args.target or None}
    if args.reason is not None:
        body["reason"] = args.reason
    body["by"] = args.by or getpass.getuser()
    base = (args.ops_url or os.environ.get(OPS_URL_ENV) or DEFAULT_OPS_URL).rstrip("/")
    headers = {"Content-Type": "application/json"}
    token = _token(args)
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(  # noqa: S310 - the URL is the operator's sidecar
        f"{base}/v1/controls/{args.action}",
        data=json.dumps(body).encode(),
        method="POST",
        headers=headers,
    )
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as resp:  # noqa: S310
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        print(f"cannot reach the sidecar at {base}: {getattr(exc, 'reason', exc)}", file=sys.stderr)
        return 1
    text = raw.decode("utf-8", errors="replace")
    print(text, file=sys.stdout if status == 200 else sys.stderr)
    return 0 if status == 200 else 1
