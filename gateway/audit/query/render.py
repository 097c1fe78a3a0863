"""Output of the audit query tool: ``rich`` tables, a trace timeline, JSON.

Tables have fixed column widths so that rows printed batch by batch (streaming, or
``--follow``) line up under one header; on a terminal narrower than the whole call table
the less telling columns are left out and the call column narrowed
(:func:`fit_columns`), so that a row stays one line. Cell text is never read as ``rich``
markup.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import IO, Any, Final

from rich import box
from rich.console import Console
from rich.table import Table

from gateway.audit.query.filters import Record, record_time
from gateway.audit.query.reader import dumps
from gateway.audit.query.summary import GroupStats, ModelStats, Summary
from gateway.terminal import inert

#: (header, width, justify)
_CALL_COLUMNS: Final = (
    ("time (UTC)", 23, "left"),
    ("agent", 14, "left"),
    ("target", 12, "left"),
    ("call", 36, "left"),
    ("status", 6, "right"),
    ("outcome", 22, "left"),
    ("tries", 5, "right"),
    ("latency ms", 10, "right"),
    ("tokens", 8, "right"),
    ("trace", 24, "left"),
)
#: How the call table gives way on a narrow terminal, step by step until a row fits:
#: (index in _CALL_COLUMNS, narrowest width; 0 leaves the column out). Agent, tries,
#: trace and tokens go first, then the call narrows, then latency goes, then outcome and
#: target narrow (``--format json`` keeps everything).
_GIVE_WAY: Final = ((1, 0), (6, 0), (9, 0), (8, 0), (3, 16), (7, 0), (5, 14), (2, 8))
_BAR_WIDTH: Final = 32
_WIDE: Final = 240


def make_console(out: IO[str]) -> Console:
    """A console on ``out``: plain text and wide lines unless ``out`` is a terminal."""
    terminal = out.isatty()
    return Console(
        file=out,
        width=None if terminal else _WIDE,
        markup=False,
        highlight=False,
        emoji=False,
        soft_wrap=False,
    )


def _text(value: Any) -> str:
    return "-" if value is None else inert(str(value))  # what agents wrote: never raw


def _ms(value: Any) -> str:
    return f"{value:.1f}" if isinstance(value, int | float) else "-"


def outcome(record: Record) -> str:
    """``ok``, ``shadow_denied`` (answered, and a ``mode: shadow`` rule would have
    refused it), or the error code; `` (replay)`` for replayed results."""
    if record.get("success") is True:
        text = "shadow_denied" if record.get("decision") == "shadow_denied" else "ok"
    else:
        text = _text(record.get("error_code"))
    return f"{text} (replay)" if record.get("replayed") is True else text


def _call(record: Record) -> str:
    return f"{_text(record.get('method'))} {_text(record.get('endpoint'))}"


def _time(record: Record) -> str:
    stamp = record.get("timestamp")
    return stamp.replace("T", " ")[:23] if isinstance(stamp, str) else "-"


def call_row(record: Record) -> list[str]:
    """The cells of one call in the ``show`` table."""
    return [
        _time(record),
        _text(record.get("agent_id")),
        _text(record.get("target_system")),
        _call(record),
        _text(record.get("status_code")),
        outcome(record),
        _text(record.get("attempts")),
        _ms(record.get("latency_ms")),
        _text(record.get("tokens_used")),
        _text(record.get("trace_id")),
    ]


def fit_columns(width: int) -> list[tuple[int, int]]:
    """The call table's columns for a console ``width`` characters wide: (index in
    _CALL_COLUMNS, width) pairs, in order, after the steps of _GIVE_WAY that a row needs
    to fit; a console too narrow even then gets the narrowest table (rich cuts it)."""
    widths = {i: w for i, (_, w, _) in enumerate(_CALL_COLUMNS)}

    def excess() -> int:  # between two columns: a padding, the box's divider, a padding
        return sum(widths.values()) + 3 * (len(widths) - 1) - width

    for index, narrowest in _GIVE_WAY:
        if excess() <= 0:
            break
        if narrowest:
            widths[index] = max(narrowest, widths[index] - excess())
        else:
            del widths[index]
    # Room left by the last column left out goes back to the call (METHOD /path).
    widths[3] = min(_CALL_COLUMNS[3][1], widths[3] + max(0, -excess()))
    return sorted(widths.items())


def _calls_table(header: bool, columns: list[tuple[int, int]]) -> Table:
    table = Table(box=box.SIMPLE_HEAD, show_header=header, show_edge=False, pad_edge=False)
    for index, width in columns:
        title, _, justify = _CALL_COLUMNS[index]
        table.add_column(
            title,
            width=width,
            no_wrap=True,
            overflow="ellipsis",
            justify=justify,  # type: ignore[arg-type]
        )
    return table


class CallTable:
    """Prints call records as table rows, ``batch`` at a time, the header once."""

    def __init__(self, console: Console, batch: int = 500) -> None:
        self._console = console
        self._batch = batch
        self._rows: list[list[str]] = []
        self._header = True
        # Chosen once, so that every batch lines up under the one header.
        self._columns = fit_columns(console.width)

    def add(self, record: Record) -> None:
        self._rows.append(call_row(record))
        if len(self._rows) >= self._batch:
            self.flush()

    def flush(self) -> None:
        if not self._rows:
            return
        table = _calls_table(self._header, self._columns)
        for row in self._rows:
            table.add_row(*(row[i] for i, _ in self._columns))
        self._console.print(table)
        self._console.file.flush()
        self._rows.clear()
        self._header = False


def write_json_line(out: IO[str], record: Record) -> None:
    """One record as one JSON line."""
    out.write(dumps(record) + "\n")


def _percent(stats: GroupStats) -> str:
    return f"{100 * stats.succeeded / stats.calls:.1f}" if stats.calls else "-"


def _codes(stats: GroupStats, top: int = 3) -> str:
    ordered = sorted(stats.error_codes.items(), key=lambda kv: (-kv[1], kv[0]))
    text = ", ".join(f"{code} {count}" for code, count in ordered[:top])
    return text + (f", +{len(ordered) - top} more" if len(ordered) > top else "")


#: Summary columns: (header, right-justified, in the compact table too).
_SUMMARY_COLUMNS: Final = (
    ("calls", True, True),
    ("ok %", True, True),
    ("shadow", True, True),
    ("replays", True, False),
    ("errors", False, True),
    ("p50 ms", True, False),
    ("p95 ms", True, True),
    ("p99 ms", True, False),
    ("retries", True, False),
    ("tok in", True, True),
    ("tok out", True, True),
    ("tok cached", True, False),
    ("rl waits (ms)", True, False),
    ("breaker opens", True, False),
    ("spend USD", True, True),
)


def _summary_cells(stats: GroupStats) -> dict[str, str]:
    figures = stats.to_dict()
    latency = figures["latency_ms"]
    waits = figures["rate_limit_waits"]
    unknown = f" (+{stats.cost_unknown} ?)" if stats.cost_unknown else ""
    return {
        "calls": str(stats.calls),
        "ok %": _percent(stats),
        "shadow": str(stats.shadow_denied),
        "replays": str(stats.replays),
        "errors": _codes(stats),
        "p50 ms": _ms(latency["p50"]),
        "p95 ms": _ms(latency["p95"]),
        "p99 ms": _ms(latency["p99"]),
        "retries": str(stats.retries),
        "tok in": str(stats.tokens_input),
        "tok out": str(stats.tokens_output),
        "tok cached": str(stats.tokens_cached),
        "rl waits (ms)": f"{waits['count']} ({waits['total_ms']:.0f})",
        "breaker opens": str(stats.breaker_opens),
        "spend USD": f"{stats.cost_usd:.6f}{unknown}",
    }


def _summary_table(
    title: str, groups: dict[str, GroupStats], total: GroupStats, *, compact: bool = False
) -> Table:
    """The table of ``groups`` and an ``all`` row; ``compact``: the columns that matter
    most only (calls, ok %, shadow denials, errors, p95, tokens, spend)."""
    columns = [(name, right) for name, right, brief in _SUMMARY_COLUMNS if brief or not compact]
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column(title.split()[-1], no_wrap=True)
    for name, right in columns:
        if right:
            table.add_column(name, justify="right")
        else:
            table.add_column(name, overflow="fold")
    rows = sorted(groups.items())
    for index, (name, stats) in enumerate([*rows, ("all", total)]):
        cells = _summary_cells(stats)
        last = index == len(rows) - 1
        table.add_row(inert(name), *(cells[c] for c, _ in columns), end_section=last)
    return table


def _fitting_table(
    console: Console, title: str, groups: dict[str, GroupStats], total: GroupStats
) -> Table:
    """The full table if it fits the console's width, else the compact one."""
    table = _summary_table(title, groups, total)
    unbounded = console.options.update_width(_WIDE * 4)  # its natural width, not squeezed
    if console.measure(table, options=unbounded).maximum <= console.width:
        return table
    return _summary_table(title, groups, total, compact=True)


def _models_table(models: dict[str, ModelStats]) -> Table:
    table = Table(title="Calls by model", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("model", no_wrap=True)
    table.add_column("calls", justify="right")
    table.add_column("spend USD", justify="right")
    table.add_column("drifted", justify="right")
    table.add_column("answered instead", overflow="fold")
    for name, stats in sorted(models.items()):
        drift = ", ".join(f"{model} {count}" for model, count in sorted(stats.drift.items()))
        drifted = sum(stats.drift.values())
        table.add_row(
            inert(name), str(stats.calls), f"{stats.cost_usd:.6f}", str(drifted), inert(drift)
        )
    return table


def print_summary(console: Console, summary: Summary) -> None:
    """Tables by agent and by target, each with an ``all`` row (the compact columns when
    the full table does not fit the terminal; a pipe or file gets the full one), then by
    model (when any call named one)."""
    console.print(_fitting_table(console, "Calls by agent", summary.agents(), summary.total()))
    console.print(_fitting_table(console, "Calls by target", summary.targets(), summary.total()))
    if summary.models:
        console.print(_models_table(summary.models))


def timeline(calls: Iterable[Record]) -> list[tuple[float, Record]]:
    """``(start offset in ms from the first call's start, record)`` in start order.

    A call started at ``timestamp`` (its end) minus ``latency_ms``. Records without a
    readable timestamp are left out.
    """
    started = []
    for record in calls:
        end = record_time(record)
        if end is None:
            continue
        latency = record.get("latency_ms")
        ms = latency if isinstance(latency, int | float) else 0.0
        started.append((end - timedelta(milliseconds=ms), record))
    started.sort(key=lambda item: item[0])
    if not started:
        return []
    origin = started[0][0]
    return [((start - origin) / timedelta(milliseconds=1), rec) for start, rec in started]


def _bar(start: float, length: float, span: float) -> str:
    if span <= 0:
        return "█" * _BAR_WIDTH
    left = min(int(start / span * _BAR_WIDTH), _BAR_WIDTH - 1)
    right = max(left + 1, min(round((start + length) / span * _BAR_WIDTH), _BAR_WIDTH))
    return " " * left + "█" * (right - left) + " " * (_BAR_WIDTH - right)


def print_timeline(console: Console, trace_id: str, steps: Sequence[tuple[float, Record]]) -> None:
    """The calls of one trace as a table with a bar per call on a common time axis."""
    span = max((offset + (_number(rec.get("latency_ms"))) for offset, rec in steps), default=0.0)
    # The agents the trace crossed: those that wrote the records, and those named in the
    # records' call chains (agents calling agents; their own logs may be elsewhere).
    chains = [rec.get("call_chain") for _, rec in steps]
    named = {a for chain in chains if isinstance(chain, list) for a in chain if isinstance(a, str)}
    agents = sorted({_text(rec.get("agent_id")) for _, rec in steps} | named)
    title = f"trace {trace_id}: {len(steps)} calls over {span:.1f} ms (agents: {', '.join(agents)})"
    table = Table(title=inert(title), title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for name, justify in (("start ms", "right"), ("duration ms", "right"), ("", "left")):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for name in ("target", "call", "outcome", "tries", "tokens", "correlation", "chain"):
        table.add_column(name, no_wrap=True, overflow="ellipsis")
    for offset, rec in steps:
        duration = _number(rec.get("latency_ms"))
        table.add_row(
            f"+{offset:.1f}",
            _ms(duration),
            _bar(offset, duration, span),
            _text(rec.get("target_system")),
            _call(rec),
            outcome(rec),
            _text(rec.get("attempts")),
            _text(rec.get("tokens_used")),
            _text(rec.get("correlation_id")),
            _chain(rec.get("call_chain")),
        )
    console.print(table)


def _chain(value: Any) -> str:
    """A record's call chain as ``planner > executor`` ("-" when it has none)."""
    if not isinstance(value, list) or not value:
        return "-"
    return " > ".join(_text(agent) for agent in value)


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) else 0.0
