"""Command line: ``egress-gateway serve | validate | call | init | inject | demo | audit |
stop | resume`` (and ``approvals``, ``dead-letters``, ``console``); each family beside
what it commands (``validate``: :mod:`gateway.validate`; ``audit``, ``stop``/``resume``,
the operator's desk: their packages' ``cli``).

Process settings come from flags, or ``GATEWAY_*`` environment variables read once at
start-up: GATEWAY_POLICY, GATEWAY_HOST, GATEWAY_PORT, GATEWAY_OPS_HOST, GATEWAY_OPS_PORT,
GATEWAY_UNIX_SOCKET (a path: the calls API on a Unix socket too), GATEWAY_LOOP
(``auto``, ``asyncio`` or ``uvloop``: see :mod:`gateway.server.eventloop`),
GATEWAY_LOG_FORMAT (``json`` or ``console``; default console when stdout is a terminal),
GATEWAY_SHUTDOWN_ACCEPT_NEW_CALLS (``true`` or ``false``, over the policy's
``server.shutdown.accept_new_calls``), GATEWAY_BUDGET_JOURNAL (a file that keeps local
budget spend across a restart: :mod:`gateway.budgets.journal`). ``call`` finds the
sidecar at EGRESS_GATEWAY_URL, the variable the Helm chart sets in the agent's container
(GATEWAY_URL, its former name, still works with a deprecation note). Exit codes: 0
success, 1 a failed check or call, 2 usage; ``validate``'s warnings (stderr) leave the
exit code 0.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, Final

from gateway import __version__
from gateway import validate as validate_cli
from gateway.agents import cli as controls_cli
from gateway.audit.query import cli as audit_cli
from gateway.console import cli as desk_cli


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def _env_bool(name: str) -> bool | None:
    """``true``/``false`` (any case) from the environment; None when unset or empty.
    Raises ValueError naming the variable for anything else."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return None
    if value not in ("true", "false"):
        raise ValueError(f"{name} must be true or false, not {os.environ[name]!r}")
    return value == "true"


#: Where ``call`` finds the sidecar: the agent-side variable (set by the Helm chart), its
#: deprecated former name, and the default (the sidecar's calls listener).
URL_ENV: Final = "EGRESS_GATEWAY_URL"
DEPRECATED_URL_ENV: Final = "GATEWAY_URL"
DEFAULT_URL: Final = "http://127.0.0.1:8181"


def _sidecar_url(flag: str | None) -> str:
    """``--url``, else EGRESS_GATEWAY_URL, else GATEWAY_URL (with a note on stderr), else
    the default."""
    if flag:
        return flag
    if os.environ.get(URL_ENV):
        return os.environ[URL_ENV]
    if os.environ.get(DEPRECATED_URL_ENV):
        print(
            f"egress-gateway call: {DEPRECATED_URL_ENV} is deprecated, set {URL_ENV} "
            "(the variable the Helm chart sets for the agent)",
            file=sys.stderr,
        )
        return os.environ[DEPRECATED_URL_ENV]
    return DEFAULT_URL


#: Cyclic GC thresholds while serving (gen0 allocations, gen1 and gen2 multipliers).
GC_THRESHOLDS: Final = (50_000, 20, 20)


def _set_log_format(chosen: str | None) -> None:
    """``--log-format``, else GATEWAY_LOG_FORMAT, else ``console`` when stdout is a
    terminal (a person is reading) and ``json`` otherwise (a collector is). Raises
    ValueError for an unknown format."""
    from gateway.audit import set_log_format

    tty = sys.stdout.isatty()
    set_log_format(chosen or ("console" if tty else "json"), colors=tty)


def _cmd_serve(args: argparse.Namespace) -> int:
    from gateway.policy import PolicyError, load_policy
    from gateway.server import Gateway, eventloop, serve

    try:
        eventloop.loop_factory(os.environ.get("GATEWAY_LOOP"))
        accept_new_calls = _env_bool("GATEWAY_SHUTDOWN_ACCEPT_NEW_CALLS")
        _set_log_format(args.log_format or os.environ.get("GATEWAY_LOG_FORMAT"))
    except ValueError as exc:
        print(f"egress-gateway serve: {exc}", file=sys.stderr)
        return 2
    try:
        policy = load_policy(args.policy)
    except PolicyError as exc:
        print(exc, file=sys.stderr)
        return 1
    vault = validate_cli.vault_problem(policy)
    if vault is not None:  # found now, not as a traceback from the sidecar's startup
        print(f"{args.policy}: {vault}", file=sys.stderr)
        return 1
    server = policy.policy.server
    host = args.host or os.environ.get("GATEWAY_HOST") or server.host
    port = args.port if args.port is not None else _env_int("GATEWAY_PORT")
    ops_port = args.ops_port if args.ops_port is not None else _env_int("GATEWAY_OPS_PORT")
    # What is loaded by now (modules, models, the policy) lives as long as the process.
    # Frozen out of the cyclic GC's generations, it is not walked again by every full
    # collection, and a full collection stops the event loop: 86 ms -> 35 ms measured.
    gc.collect()
    gc.freeze()
    # Nearly all of a call's objects are freed by reference counting; the cyclic GC's
    # default thresholds (700, 10, 10) still walked the young and middle generations
    # thousands of times a second under load, ~10% of the CPU per call (bench: c16
    # ~315 -> ~270 us). Cycles are still collected, after 50,000 net allocations.
    gc.set_threshold(*GC_THRESHOLDS)
    eventloop.run(
        serve(
            Gateway(policy),
            host=host,
            port=port if port is not None else server.port,
            ops_host=args.ops_host or os.environ.get("GATEWAY_OPS_HOST") or server.ops_host,
            ops_port=ops_port if ops_port is not None else server.ops_port,
            accept_new_calls=accept_new_calls,
            unix_socket=args.unix_socket or os.environ.get("GATEWAY_UNIX_SOCKET") or None,
        ),
        os.environ.get("GATEWAY_LOOP"),
    )
    return 0


def _cmd_call(args: argparse.Namespace) -> int:
    raw = sys.stdin.buffer.read() if args.file == "-" else Path(args.file).read_bytes()
    url = _sidecar_url(args.url).rstrip("/") + "/v1/calls"
    headers = {"Content-Type": "application/json"}
    if args.stream:
        headers["Accept"] = "text/event-stream"
    req = urllib.request.Request(  # noqa: S310 - the URL is the operator's sidecar
        url, data=raw, method="POST", headers=headers
    )
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as resp:  # noqa: S310
            if resp.headers.get_content_type() == "text/event-stream":
                return _print_stream(resp)
            status, body = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read()
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        print(f"cannot reach the sidecar at {url}: {getattr(exc, 'reason', exc)}", file=sys.stderr)
        return 1
    try:
        answer = json.loads(body)
    except ValueError:
        print(body.decode("utf-8", errors="replace"))
    else:
        print(json.dumps(answer, indent=2, ensure_ascii=False))
        if isinstance(answer, dict) and answer.get("replayed") is True:
            # Without this a re-run example looks like a fresh call: it is not one.
            print(
                "egress-gateway call: replayed the stored answer of this idempotency key; "
                "the upstream was not called again",
                file=sys.stderr,
            )
    return 0 if status == 200 else 1


def _print_stream(resp: IO[bytes]) -> int:
    """Print a streamed answer's lines as they arrive; exit 0 when its final
    ``egress.response`` says success."""
    final = None
    last_event = ""
    for line in resp:
        text = line.decode("utf-8", errors="replace")
        sys.stdout.write(text)
        sys.stdout.flush()
        if text.startswith("event:"):
            last_event = text[6:].strip()
        elif text.startswith("data:") and last_event == "egress.response":
            final = json.loads(text[5:])
    if final is not None and final.get("replayed") is True:
        print("egress-gateway call: replayed the stored stream of this idempotency key; "
              "the upstream was not called again", file=sys.stderr)  # fmt: skip
    return 0 if final is not None and final.get("success") else 1


def _cmd_inject(args: argparse.Namespace) -> int:
    from gateway.inject import InjectionError, load_template
    from gateway.inject.server import run

    try:
        template = load_template(args.template)
    except InjectionError as exc:
        print(f"egress-gateway inject: {exc}", file=sys.stderr)
        return 1
    asyncio.run(run(template, host=args.host, port=args.port, cert=args.tls_cert, key=args.tls_key))
    return 0


def _cmd_init(args: argparse.Namespace) -> int:
    """Write a starter policy for the named providers (validated first); refuse to
    replace an existing file without --force."""
    from gateway.policy.starters import UnknownProvider, starter_policy

    try:
        text = starter_policy(args.providers or ["openai"], agent_id=args.agent_id)
    except UnknownProvider as exc:
        print(f"egress-gateway init: {exc}", file=sys.stderr)
        return 2
    if args.output == "-":
        sys.stdout.write(text)
        return 0
    out = Path(args.output)
    if out.exists() and not args.force:
        print(f"egress-gateway init: {out} exists (--force replaces it)", file=sys.stderr)
        return 1
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out}; next: egress-gateway serve --policy {out}", file=sys.stderr)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from gateway.demo import run_demo

    return asyncio.run(run_demo(policy_path=args.policy, examples_dir=args.examples))


def _add_serve(sub: Any) -> None:
    """The ``serve`` command and its flags (each also a ``GATEWAY_*`` variable)."""
    p = sub.add_parser("serve", help="run the sidecar")
    p.add_argument(
        "--policy",
        default=os.environ.get("GATEWAY_POLICY"),
        required="GATEWAY_POLICY" not in os.environ,
        help="policy YAML file (env GATEWAY_POLICY)",
    )
    p.add_argument("--host", help="calls listener address (default 127.0.0.1; env GATEWAY_HOST)")
    p.add_argument("--port", type=int, help="calls listener port (default 8181; env GATEWAY_PORT)")
    p.add_argument("--ops-host", help="health/metrics listener address (env GATEWAY_OPS_HOST)")
    p.add_argument(
        "--unix-socket",
        metavar="PATH",
        help="also serve the calls API on this Unix socket; its callers are known by their "
        "UID (env GATEWAY_UNIX_SOCKET)",
    )
    p.add_argument(
        "--ops-port",
        type=int,
        help="health/metrics listener port (default 8182; env GATEWAY_OPS_PORT)",
    )
    p.add_argument(
        "--log-format",
        choices=("json", "console"),
        help="json lines, or one readable line per call (default: console on a terminal, "
        "json otherwise; env GATEWAY_LOG_FORMAT)",
    )
    p.set_defaults(func=_cmd_serve)


def _add_init(sub: Any) -> None:
    p = sub.add_parser("init", help="write a starter policy for real providers")
    p.add_argument(
        "providers",
        nargs="*",
        metavar="PROVIDER",
        help="openai, anthropic, gemini (default openai)",
    )
    p.add_argument(
        "-o",
        "--output",
        default="policy.yaml",
        help="file to write (default: policy.yaml in the current directory), - for stdout",
    )
    p.add_argument("--agent-id", default="my-agent", help="the policy's agent_id")
    p.add_argument("--force", action="store_true", help="replace the file if it exists")
    p.set_defaults(func=_cmd_init)


def _add_inject(sub: Any) -> None:
    p = sub.add_parser("inject", help="serve the sidecar injection webhook (HTTPS)")
    p.add_argument("--template", required=True, help="injection template JSON (the chart's)")
    p.add_argument("--tls-cert", required=True, help="PEM certificate (chain) file")
    p.add_argument("--tls-key", required=True, help="PEM private key file")
    p.add_argument("--host", default="0.0.0.0", help="listen address (default 0.0.0.0)")  # noqa: S104
    p.add_argument("--port", type=int, default=8443, help="listen port (default 8443)")
    p.set_defaults(func=_cmd_inject)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="egress-gateway",
        description="Egress sidecar for AI agents: policy-checked, credential-injecting, "
        "audited outbound calls.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_serve(sub)

    validate_cli.register(sub)  # validate

    p = sub.add_parser("call", help="send one envelope to a running sidecar, print the answer")
    p.add_argument("file", nargs="?", default="-", help="envelope JSON file, or - for stdin")
    p.add_argument(
        "--url",
        default=None,
        help=f"the sidecar's base URL (env {URL_ENV}; default {DEFAULT_URL})",
    )
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the answer")
    p.add_argument(
        "--stream",
        action="store_true",
        help="ask for a stream (Accept: text/event-stream): print events as they arrive",
    )
    p.set_defaults(func=_cmd_call)

    audit_cli.register(sub)
    controls_cli.register(sub)  # stop, resume
    desk_cli.register(sub)  # approvals, dead-letters, console

    _add_init(sub)
    _add_inject(sub)

    p = sub.add_parser("demo", help="run the sidecar against local stand-ins for real APIs")
    p.add_argument("--policy", default="policies/demo.yaml")
    p.add_argument("--examples", default="examples")
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader has gone (``egress-gateway call ... | head``): stop quietly, as cat
        # does. Python's flush of stdout at exit would fail again and print a traceback,
        # so stdout points at /dev/null from here on.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a writer killed by it
    except OSError as exc:
        print(f"egress-gateway {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
