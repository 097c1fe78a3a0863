"""genai-prices' token rates for the providers the sidecar prices, as a small table.

genai-prices keeps its data as Python objects (``genai_prices.data``, every provider's
models, 1.1 MB of source) and importing the package loads its update client (httpx2):
~5 MiB of resident memory in every sidecar that prices calls, for the three providers
it asks about (``openai``, ``anthropic``, ``google``: :data:`PROVIDERS`). So the data is
read in another process (:func:`main`), which prints, for those providers and the ones
they fall back to, each model's match rules and its token rates with the day each
applies from (:func:`extract`), as JSON (~30 KB). The sidecar keeps that table
(:class:`Table`) and never imports the library.

The table is found, in order: next to this module (``genai_prices.json``, written when
the image is built: ``main(["--write"])``), in the user's cache directory
(``$XDG_CACHE_HOME`` or ``~/.cache``, ``egress-gateway/``), else extracted then (once per
process, ~0.5 s of CPU in a child process) and saved there when it can be. Each copy
names the library data it was read from (the size and SHA-256 of its data file); one
that does not match the installed library is not used.

:meth:`Table.rates` answers as genai-prices' ``find_provider_model`` and
``get_prices`` would (``tests/test_price_table_matches_genai_prices.py`` compares both
for every model of the table), at the UTC day of the call: the model lookup is
case-insensitive, tries the provider's models in order, then its fallback providers',
then the model with a compact date (``-20251211``) written with dashes; the prices in
force are the last ones whose start date is past (a time-of-day price is taken as
genai-prices takes it at 00:00 UTC, the time the sidecar has always asked at).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from datetime import date
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Final

__all__ = ["FORMAT", "PROVIDERS", "Table", "extract", "library_key", "load"]

#: The providers of the sidecar's dialects (``Dialect.price_provider``).
PROVIDERS: Final = ("openai", "anthropic", "google")
#: The table's layout; a copy in another layout is not used.
FORMAT: Final = 1
_PACKAGED: Final = Path(__file__).with_name("genai_prices.json")
_EXTRACT_TIMEOUT_S: Final = 120
# genai-prices' own rule (types._COMPACT_DATE_RE): ``-YYYYMMDD`` before ``-``, ``:`` or the end.
_COMPACT_DATE: Final = re.compile(r"(-)(20\d{2})(0[1-9]|1[0-2])(0[1-9]|[12]\d|3[01])(?=-|:|$)")

#: One price of a model: (start day ``YYYY-MM-DD``, None: always, ``"never"``), then
#: None (not priced by tokens alone) or [base rates, [[tier start, tier rates], ...]];
#: rates: [input, output, cached, cache write or None], USD per million tokens.
Price = list[Any]


class Table:
    """The rates of :data:`PROVIDERS`' models; built from :func:`extract`'s document."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.key: str = doc["key"]
        self.providers: dict[str, dict[str, Any]] = doc["providers"]

    def knows(self, provider: str) -> bool:
        """True when ``provider`` is in the table (else ask the library)."""
        return provider in self.providers

    def rates(self, provider: str, model: str, day: str) -> tuple[str, Price] | None:
        """The model id genai-prices finds for ``model`` at ``provider`` and its price in
        force on ``day`` (``YYYY-MM-DD``, UTC), or None when it finds no model."""
        ref = model.lower()
        found = self._find(provider, ref)
        if found is None:
            dashed = _COMPACT_DATE.sub(_dashed, ref)
            if dashed != ref:
                found = self._find(provider, dashed)
        if found is None:
            return None
        model_id, prices = found[0], found[2]
        chosen = prices[0]
        for price in reversed(prices):  # the last price in force wins
            start = price[0]
            if start is None or (start != "never" and day >= start):
                chosen = price
                break
        return model_id, chosen[1]

    def _find(self, provider: str, ref: str) -> list[Any] | None:
        entry = self.providers[provider]
        for model in entry["models"]:
            if _match(model[1], ref):
                return model  # type: ignore[no-any-return]
        for fallback in entry["fallbacks"]:  # one step, as genai-prices falls back
            for model in self.providers.get(fallback, {}).get("models", ()):
                if _match(model[1], ref):
                    return model  # type: ignore[no-any-return]
        return None


def _match(rule: list[Any], text: str) -> bool:
    """genai-prices' match clauses on a lower-cased ``text`` (patterns stored lower-cased)."""
    kind, arg = rule
    if kind == "equals":
        return text == arg  # type: ignore[no-any-return]
    if kind == "starts_with":
        return text.startswith(arg)
    if kind == "ends_with":
        return text.endswith(arg)
    if kind == "contains":
        return arg in text
    if kind == "regex":
        return re.search(arg, text) is not None
    if kind == "or":
        return any(_match(sub, text) for sub in arg)
    return all(_match(sub, text) for sub in arg)  # "and"


def _dashed(found: re.Match[str]) -> str:
    year, month, day = (int(found.group(i)) for i in range(2, 5))
    try:
        date(year, month, day)
    except ValueError:
        return found.group(0)
    return f"{found.group(1)}{year:04d}-{month:02d}-{day:02d}"


def library_key() -> str | None:
    """Which genai-prices data is installed (its data file's size and SHA-256), without
    importing it; None when it is not installed."""
    try:
        spec = find_spec("genai_prices")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    data = Path(next(iter(spec.submodule_search_locations))) / "data.py"
    try:
        stat = data.stat()
        return _content_key(str(data), stat.st_size, stat.st_mtime_ns)
    except OSError:
        return None


@functools.cache  # hashed once per file version (path, size, mtime) in a process
def _content_key(path: str, size: int, mtime_ns: int) -> str:
    """The key of a data file by its content: a copy of the table stays valid in an
    image whose files were copied with other mtimes, or in another location."""
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:32]
    return f"genai-prices:{size}:{digest}:f{FORMAT}"


def load(key: str) -> Table:
    """The table of the library ``key`` (:func:`library_key`): packaged, cached, or
    extracted now in a child process (then cached when the directory is writable).
    Raises RuntimeError when the extraction fails."""
    cache = _cache_path(key)
    for path in (_PACKAGED, cache):
        doc = None if path is None else _read(path)
        if doc is not None and doc.get("key") == key:
            return Table(doc)
    text = _extract_in_child()
    doc = json.loads(text)
    if doc.get("key") != key:
        raise RuntimeError("genai-prices changed while its prices were read")
    if cache is not None:
        _save(cache, text)
    return Table(doc)


def _cache_path(key: str) -> Path | None:
    """Where the table of ``key`` is cached; None without a home directory."""
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = str(Path.home() / ".cache")
        except RuntimeError:  # no HOME and no passwd entry: nothing to cache in
            return None
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(base) / "egress-gateway" / f"genai-prices-{digest}.json"


def _read(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _save(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically; a read-only directory is no error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".prices-")
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(tmp, path)
    except OSError:
        return


def _extract_in_child() -> str:
    # A child process: the library's objects and imports never enter the sidecar's heap.
    root = str(Path(__file__).resolve().parents[2])
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    )
    done = subprocess.run(
        [sys.executable, "-c", "from gateway.cost.table import main; main([])"],
        capture_output=True,
        text=True,
        env=env,
        timeout=_EXTRACT_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"reading genai-prices' data failed: {done.stderr.strip()[-500:]}")
    return done.stdout


def extract() -> dict[str, Any]:
    """The table's document, read from the installed genai-prices (imports it)."""
    from genai_prices import data_snapshot

    key = library_key()
    providers = {p.id: p for p in data_snapshot.get_snapshot().providers}
    wanted = list(PROVIDERS)
    for name in PROVIDERS:
        wanted += providers[name].fallback_model_providers or []
    out: dict[str, Any] = {}
    for name in dict.fromkeys(wanted):
        provider = providers[name]
        out[name] = {
            "fallbacks": list(provider.fallback_model_providers or []),
            "models": [[str(m.id), _rule(m.match), _prices(m)] for m in provider.models],
        }
    return {"key": key, "providers": out}


def _rule(clause: Any) -> list[Any]:
    """A genai-prices match clause as ``[kind, argument]`` (patterns lower-cased)."""
    for kind in ("equals", "starts_with", "ends_with", "contains"):
        if hasattr(clause, kind):
            return [kind, str(getattr(clause, kind)).lower()]
    if hasattr(clause, "regex"):
        return ["regex", str(clause.regex)]
    if hasattr(clause, "or_"):
        return ["or", [_rule(sub) for sub in clause.or_]]
    if hasattr(clause, "and_"):
        return ["and", [_rule(sub) for sub in clause.and_]]
    raise TypeError(f"unknown genai-prices match clause {type(clause).__name__}")


def _prices(model: Any) -> list[Price]:
    """A model's prices in genai-prices' order, each with when it applies."""
    from datetime import UTC, datetime

    from gateway.cost.prices import token_rates

    midnight = datetime(2000, 1, 1, tzinfo=UTC)
    if not isinstance(model.prices, list):
        return [[None, token_rates(model.prices)]]
    out: list[Price] = []
    for conditional in model.prices:
        constraint = conditional.constraint
        when: str | None
        if constraint is None:
            when = None
        elif hasattr(constraint, "start_date"):
            when = constraint.start_date.isoformat()
        elif hasattr(constraint, "start_time"):  # the same answer at every 00:00 UTC
            when = None if constraint.active(midnight) else "never"
        else:
            raise TypeError(f"unknown genai-prices constraint {type(constraint).__name__}")
        out.append([when, token_rates(conditional.prices)])
    return out


def main(argv: list[str]) -> int:
    """Print the table, or with ``["--write"]`` write it next to this module (for an
    image whose sidecars then never read the library: the Dockerfile runs
    ``python -c "from gateway.cost.table import main; main(['--write'])"``)."""
    text = json.dumps(extract(), separators=(",", ":"))
    if argv == ["--write"]:
        _PACKAGED.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0
