"""``egress-gateway audit``: query, summarise and verify audit logs (argparse).

    egress-gateway audit show    [FILE...] [filters] [--format table|json] [--follow] [--limit N]
    egress-gateway audit summary [FILE...] [filters] [--format table|json]
    egress-gateway audit trace   TRACE_ID [FILE...] [filters] [--format table|json]
    egress-gateway audit verify  FILE... [--format text|json]

FILE is a JSON-lines audit log, gzip or not; ``-`` or none reads stdin. Filters:
``--trace --correlation --agent --target --endpoint --code`` (repeatable, exact or
``fnmatch`` pattern), ``--failed``, ``--since/--until`` (ISO 8601 or ``15m``, ``2h``,
``1d``), ``--min-latency`` (ms). Malformed lines are reported on stderr with file and
line number and skipped. Exit status: 0 done, 1 verification failed or trace not found,
2 usage or input error (argparse's own convention).
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any, Final

from gateway.audit.query.filters import Filters, Predicate, Record, parse_when
from gateway.audit.query.reader import STDIN, Malformed, entries, follow, records
from gateway.audit.query.summary import summarize
from gateway.audit.query.verify import verify

_MAX_REPORTED: Final = 50
#: The module docstring as ``--help`` shows it: plain text, without reST's double
#: backquotes.
_DESCRIPTION: Final = (__doc__ or "").replace("``", "").replace(" (argparse)", "", 1)

# The commands import gateway.audit.query.render (and rich, 3 MiB of RSS) when they run, not
# at module level: `egress-gateway serve` builds this parser too, and never prints a table.


def _when(text: str) -> Any:
    try:
        return parse_when(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_inputs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "files", nargs="*", metavar="FILE", help="audit log(s), gzip or not; '-' or none: stdin"
    )


def _add_filters(parser: argparse.ArgumentParser, *, with_trace: bool = True) -> None:
    group = parser.add_argument_group("filters (repeat a text filter to match any value)")
    texts = [
        ("--correlation", "correlation_id"),
        ("--agent", "agent_id"),
        ("--target", "target_system"),
        ("--endpoint", "endpoint (path)"),
        ("--code", "error code, e.g. CAPACITY_EXCEEDED"),
        ("--decision", "allowed, denied, invalid, replayed or shadow_denied"),
        ("--policy", "policy_sha256, the digest of the policy that decided (a prefix: ab12*)"),
    ]
    if with_trace:
        texts.insert(0, ("--trace", "trace_id"))
    for flag, what in texts:
        group.add_argument(flag, action="append", metavar="VALUE", help=f"{what}; * ? [] glob")
    group.add_argument("--failed", action="store_true", help="only calls that did not succeed")
    group.add_argument("--since", type=_when, metavar="WHEN", help="ISO 8601 or 15m, 2h, 1d")
    group.add_argument("--until", type=_when, metavar="WHEN", help="ISO 8601 or 15m, 2h, 1d")
    group.add_argument("--min-latency", type=float, metavar="MS", help="latency_ms at least MS")


def add_commands(subparsers: Any) -> None:
    """Add ``show``, ``summary``, ``trace``, ``verify`` to an argparse subparsers object."""
    show = subparsers.add_parser("show", help="matching call records as a table or JSON lines")
    _add_inputs(show)
    _add_filters(show)
    show.add_argument("--format", choices=("table", "json"), default="table")
    show.add_argument("--follow", action="store_true", help="keep reading as the log grows")
    show.add_argument("--limit", type=int, metavar="N", help="stop after N matching records")

    summary = subparsers.add_parser("summary", help="figures per agent and per target")
    _add_inputs(summary)
    _add_filters(summary)
    summary.add_argument("--format", choices=("table", "json"), default="table")

    trace = subparsers.add_parser("trace", help="one trace's calls in time order")
    trace.add_argument("trace_id", metavar="TRACE_ID")
    _add_inputs(trace)
    _add_filters(trace, with_trace=False)
    trace.add_argument("--format", choices=("table", "json"), default="table")

    check = subparsers.add_parser("verify", help="check the hash chain (audit.chain: true)")
    check.add_argument("files", nargs="+", metavar="FILE", help="in order: oldest file first")
    check.add_argument("--format", choices=("text", "json"), default="text")

    for name, parser in (("show", show), ("summary", summary), ("trace", trace), ("verify", check)):
        parser.set_defaults(func=run, audit_command=name)


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``audit`` command; after parsing, ``args.func(args)`` runs it (exit code)."""
    audit = subparsers.add_parser(
        "audit",
        help="query, summarise and verify audit logs",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_commands(audit.add_subparsers(dest="audit_command", required=True, metavar="COMMAND"))
    assert isinstance(audit, argparse.ArgumentParser)
    return audit


@dataclass
class _IO:
    stdout: IO[str]
    stderr: IO[str]
    stdin: IO[bytes] | None
    stop: threading.Event
    malformed: int = 0

    def report(self, bad: Malformed) -> None:
        self.malformed += 1
        if self.malformed <= _MAX_REPORTED:
            self.stderr.write(f"{bad}\n")

    def close(self) -> None:
        if self.malformed:
            self.stderr.write(f"{self.malformed} malformed line(s) skipped\n")


def run(
    args: argparse.Namespace,
    *,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    stdin: IO[bytes] | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Run a parsed ``audit`` command; returns the exit status (0, 1 or 2)."""
    io = _IO(stdout or sys.stdout, stderr or sys.stderr, stdin, stop or threading.Event())
    files = list(args.files) or [STDIN]
    if STDIN in files and stdin is None and _interactive(sys.stdin):
        io.stderr.write("error: no input: give FILE... or pipe a log into stdin\n")
        return 2
    command = {"show": _show, "summary": _summary, "trace": _trace, "verify": _verify}
    try:
        return command[args.audit_command](args, files, io)
    except OSError as exc:
        io.stderr.write(f"error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        return 0
    finally:
        io.close()


def _interactive(stream: IO[str] | None) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (OSError, ValueError):  # closed, or a test runner's placeholder
        return False


def _filters(args: argparse.Namespace, trace: tuple[str, ...] | None = None) -> Filters:
    def values(name: str) -> tuple[str, ...]:
        return tuple(getattr(args, name, None) or ())

    return Filters(
        trace=trace if trace is not None else values("trace"),
        correlation=values("correlation"),
        agent=values("agent"),
        target=values("target"),
        endpoint=values("endpoint"),
        code=values("code"),
        decision=values("decision"),
        policy=values("policy"),
        failed=args.failed,
        since=args.since,
        until=args.until,
        min_latency_ms=args.min_latency,
    )


def _matching(
    args: argparse.Namespace, files: list[str], io: _IO, match: Predicate
) -> Iterator[Record]:
    stream: Iterator[Record]
    if args.follow:
        if len(files) != 1:
            raise OSError("--follow takes exactly one FILE")
        stream = (
            (rec for _, _, rec in entries(files, io.report, stdin=io.stdin))
            if files[0] == STDIN
            else (rec for _, _, rec in follow(files[0], io.stop, io.report))
        )
    else:
        stream = records(files, io.report, stdin=io.stdin)
    count = 0
    for record in stream:
        if match(record):
            yield record
            count += 1
            if args.limit is not None and count >= args.limit:
                return


def _show(args: argparse.Namespace, files: list[str], io: _IO) -> int:
    from gateway.audit.query import render

    match = _filters(args).call_predicate()
    if args.format == "json":
        for record in _matching(args, files, io, match):
            render.write_json_line(io.stdout, record)
            if args.follow:
                io.stdout.flush()
        return 0
    table = render.CallTable(render.make_console(io.stdout), batch=1 if args.follow else 500)
    try:
        for record in _matching(args, files, io, match):
            table.add(record)
    finally:
        table.flush()
    return 0


def _summary(args: argparse.Namespace, files: list[str], io: _IO) -> int:
    from gateway.audit.query import render

    filters = _filters(args)
    result = summarize(
        records(files, io.report, stdin=io.stdin, exact=False),  # sums: the fastest parser
        filters.call_filter(),
        filters.event_filter(),
    )
    if args.format == "json":
        render.write_json_line(io.stdout, result.to_dict())
    else:
        render.print_summary(render.make_console(io.stdout), result)
    return 0


def _trace(args: argparse.Namespace, files: list[str], io: _IO) -> int:
    from gateway.audit.query import render

    match = _filters(args, trace=(args.trace_id,)).call_predicate()
    steps = render.timeline(r for r in records(files, io.report, stdin=io.stdin) if match(r))
    if not steps:
        io.stderr.write(f"no calls for trace {args.trace_id}\n")
        return 1
    if args.format == "json":
        for offset, record in steps:
            render.write_json_line(io.stdout, {"start_offset_ms": offset, **record})
    else:
        render.print_timeline(render.make_console(io.stdout), args.trace_id, steps)
    return 0


def _verify(args: argparse.Namespace, files: list[str], io: _IO) -> int:
    from gateway.audit.query import render

    result = verify(files, stdin=io.stdin)
    if args.format == "json":
        render.write_json_line(io.stdout, result.to_dict())
        return 0 if result.ok else 1
    for note in result.notes:
        io.stdout.write(f"note: {note}\n")
    if result.ok:
        io.stdout.write(
            f"OK: {result.chained} chained record(s) in {result.chains} chain(s) verified"
            f" ({result.unchained} unchained line(s) ignored)\n"
        )
        return 0
    if result.breaks:
        io.stdout.write(f"FAILED: first break at {result.breaks[0]}\n")
        for extra in result.breaks[1:_MAX_REPORTED]:
            io.stdout.write(f"  also: {extra}\n")
    else:
        io.stdout.write("FAILED: nothing to verify\n")
    return 1


def main(
    argv: list[str] | None = None,
    *,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    stdin: IO[bytes] | None = None,
    stop: threading.Event | None = None,
) -> int:
    """``python -m gateway.audit.query COMMAND ...``: the ``audit`` commands on their own."""
    parser = argparse.ArgumentParser(
        prog="python -m gateway.audit.query",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_commands(parser.add_subparsers(dest="audit_command", required=True, metavar="COMMAND"))
    args = parser.parse_args(argv)
    return run(args, stdout=stdout, stderr=stderr, stdin=stdin, stop=stop)
