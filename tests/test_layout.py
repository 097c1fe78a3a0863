"""The house keeps itself: library owners, package cycles, sizes (pure, reads files).

Each third-party library is imported by its owner only (the same table as ruff's banned-API
rule, TID251, in pyproject.toml, which this test also holds to the table); the contract
(``envelope``, ``errors``) imports nothing else of the package; ``demo`` is imported by
nothing; no cycle between the package's parts; no function body over 60 lines outside
declarations (but the named offenders of :data:`LONG_FUNCTIONS`, none today); no module
over 1000 lines, a backstop only: a module is split where a seam is, never to stay under a count.
"""

from __future__ import annotations

import ast
import functools
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gateway"

#: Third-party module -> the files that may import it (paths relative to the repository).
OWNERS: dict[str, frozenset[str]] = {
    "aiohttp": frozenset(
        {
            "gateway/upstream/client.py",
            "gateway/upstream/resolver.py",
            "gateway/upstream/answers.py",
            "gateway/upstream/failures.py",
            "gateway/server/app.py",
            "gateway/inject/server.py",
            "gateway/api/http.py",
            "gateway/api/writer.py",
            "gateway/server/listeners.py",
            "gateway/server/ops.py",
            "gateway/server/desk.py",
            "gateway/console/server.py",
        }
    ),
    "yarl": frozenset({"gateway/urls.py"}),
    # And istr: the identity headers' keys, read case-insensitively without lowering.
    "multidict": frozenset({"gateway/ratelimit/headers.py", "gateway/agents/identity.py"}),
    # The modelling library of the contract, the policy and the audit schema, and the two
    # places that translate its ValidationError into the sidecar's own errors.
    "pydantic": frozenset(
        {
            "gateway/envelope.py",
            "gateway/audit/schema.py",
            "gateway/policy/models.py",
            "gateway/policy/root.py",
            "gateway/policy/stores.py",
            "gateway/policy/budgets.py",
            "gateway/policy/agents.py",
            "gateway/policy/chain.py",
            "gateway/policy/controls.py",
            "gateway/policy/desk.py",
            "gateway/policy/mcp.py",
            "gateway/policy/a2a.py",
            "gateway/policy/modelrules.py",
            "gateway/policy/database.py",
            "gateway/policy/loader.py",
            "gateway/call/intake.py",
        }
    ),
    "prometheus_client": frozenset({"gateway/metrics/__init__.py", "gateway/metrics/series.py"}),
    # Model prices (bundled data, never fetched at run time).
    "genai_prices": frozenset({"gateway/cost/prices.py", "gateway/cost/table.py"}),
    # pydantic's own core: its error types, used where the models are defined, and its
    # string pattern (Rust's regex), the secret scrub's one search for many needles.
    "pydantic_core": frozenset(
        {"gateway/policy/models.py", "gateway/policy/root.py", "gateway/literals.py"}
    ),
    "structlog": frozenset({"gateway/audit/log.py"}),
    "yaml": frozenset({"gateway/policy/document.py"}),
    "hvac": frozenset({"gateway/secrets/vault.py", "gateway/secrets/vault_auth.py"}),
    "pybreaker": frozenset({"gateway/breaker.py"}),
    "asyncpg": frozenset({"gateway/database/postgres.py"}),
    "aiolimiter": frozenset({"gateway/ratelimit/local.py"}),
    "redis": frozenset({"gateway/stores/redis.py"}),
    "orjson": frozenset({"gateway/fastjson.py"}),
    "uvloop": frozenset({"gateway/server/eventloop.py"}),
    "rich": frozenset({"gateway/audit/query/render.py"}),
    # The SDK, the OTLP/HTTP exporters and the API: imported only when tracing is on
    # (otel.py) or audit lines are shipped over OTLP (otlp.py).
    "opentelemetry": frozenset({"gateway/telemetry/otel.py", "gateway/audit/otlp.py"}),
    # MCP's SDK: the tests' server and client only; the sidecar speaks MCP itself.
    "mcp": frozenset(),
    # A2A Agent Card signatures (JWS); A2A's SDK: the tests' agents and clients only.
    "jwt": frozenset({"gateway/agents/card.py"}),
    "a2a": frozenset(),
}
#: A program of its own beside the sidecar (its stand-in upstreams and console output):
#: it may import what it needs, and nothing imports it.
PROGRAMS = ("gateway/demo/",)
#: A backstop against a module that swallows several concerns, not a size to aim for: at
#: 500 the cap shaped the code (eleven modules sat at 450-499 lines and three were split by
#: size, not at a seam); twice today's largest module leaves room to split where a seam is.
MAX_MODULE_LINES = 1000
#: The most lines a function's body may take, its signature and docstring not counted.
MAX_FUNCTION_LINES = 60
#: Today's functions over :data:`MAX_FUNCTION_LINES` (``path::Class.function``), each to be
#: cut at its seams; an entry leaves this list as soon as its function is short enough (the
#: test says so), and nothing joins it.
LONG_FUNCTIONS: frozenset[str] = frozenset()


def _files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def _tree(path: Path) -> ast.Module:
    """The module's syntax tree, parsed once for all the rules (read only)."""
    return ast.parse(path.read_text(), str(path))


def _imports(path: Path) -> Iterator[tuple[str, bool]]:
    """(imported module, only for type checking) for every import in ``path``."""
    tree = _tree(path)
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                typing_only.update(id(n) for n in ast.walk(inner))
    package = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, id(node) in typing_only
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield base, id(node) in typing_only
            for alias in node.names:  # `from gateway import fastjson` imports a module
                yield f"{base}.{alias.name}", id(node) in typing_only


def _third_party(name: str) -> str | None:
    top = name.split(".")[0]
    if top in ("gateway", "__future__") or top in sys.stdlib_module_names:
        return None
    return top


def test_each_third_party_library_is_imported_by_its_owner_only() -> None:
    strays: list[str] = []
    for path in _files():
        rel = _rel(path)
        if rel.startswith(PROGRAMS):
            continue
        for name, _ in _imports(path):
            top = _third_party(name)
            if top is None:
                continue
            if top not in OWNERS:
                strays.append(f"{rel}: {name} (a library with no owner in OWNERS)")
            elif rel not in OWNERS[top]:
                strays.append(f"{rel}: {name} (owned by {', '.join(sorted(OWNERS[top]))})")
    assert sorted(set(strays)) == []


def test_ruffs_banned_api_rule_holds_the_same_table() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    assert "TID251" in config["select"] or "TID" in config["select"]
    banned = config["flake8-tidy-imports"]["banned-api"]
    assert set(banned) == set(OWNERS)
    ignored = {
        path
        for path, rules in config["per-file-ignores"].items()
        if "TID251" in rules and path.startswith("gateway/") and not path.startswith(PROGRAMS)
    }
    assert ignored == set().union(*OWNERS.values())


def _unit(module: str) -> str:
    """The part of the package a module belongs to: ``gateway.call``, ``gateway.upstream``."""
    return ".".join(module.split(".")[:2])


def _graph(*, typing_only_too: bool = False) -> dict[str, set[str]]:
    """Part -> the parts it imports (run-time imports; ``typing_only_too``: also those
    under ``if TYPE_CHECKING:``)."""
    known = {_module(p) for p in _files()}
    graph: dict[str, set[str]] = {}
    for path in _files():
        source = _unit(_module(path))
        for name, typing_only in _imports(path):
            if typing_only and not typing_only_too:
                continue
            if not name.startswith("gateway.") or name not in known:
                continue
            target = _unit(name)
            if target != source and target != "gateway":
                graph.setdefault(source, set()).add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif len(path) < 12:
                visit(nxt, [*path, nxt])

    for start in sorted(graph):
        visit(start, [start])
    return sorted({" -> ".join(c) for c in cycles})


def test_no_cycle_between_the_parts_of_the_package() -> None:
    assert _cycles(_graph()) == []


def test_the_contract_imports_nothing_else_of_the_package() -> None:
    known = {_module(p) for p in _files()} - {"gateway"}
    contract = {"gateway/envelope.py": set(), "gateway/errors.py": {"gateway.envelope"}}
    for rel, allowed in contract.items():
        inside = {n for n, _ in _imports(ROOT / rel) if n in known}
        assert inside <= allowed, rel


def test_nothing_imports_the_demo() -> None:
    importers = [
        _rel(path)
        for path in _files()
        if not _rel(path).startswith(PROGRAMS)
        and any(n == "gateway.demo" or n.startswith("gateway.demo.") for n, _ in _imports(path))
    ]
    assert importers == ["gateway/cli.py"]  # the `demo` command, imported when it runs


@pytest.mark.parametrize("path", _files(), ids=_rel)
def test_modules_stay_under_the_backstop(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= MAX_MODULE_LINES


def _declarations_only(body: list[ast.stmt]) -> bool:
    """True when every statement assigns a constructor call (a call of a capitalised name,
    ``self.calls = Counter(...)``): a list of declarations, however long, is not logic."""

    def constructed(value: ast.expr | None) -> bool:
        if not isinstance(value, ast.Call):
            return False
        name = value.func.attr if isinstance(value.func, ast.Attribute) else None
        name = value.func.id if isinstance(value.func, ast.Name) else name
        return name is not None and name[:1].isupper()

    return bool(body) and all(
        isinstance(s, ast.Assign | ast.AnnAssign) and constructed(s.value) for s in body
    )


def _function_lengths(path: Path, source: str | None = None) -> Iterator[tuple[str, int]]:
    """(``path::Class.function``, lines of its body without the docstring) for every
    function in ``path`` (or in ``source``, read as that file), nested ones included
    (they count in their parent too); 0 for a body of declarations only
    (:func:`_declarations_only`)."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                body = child.body
                if ast.get_docstring(child, clean=False) is not None:
                    body = body[1:]
                end = child.end_lineno or child.lineno
                name = f"{prefix}{child.name}"
                lines = (end - body[0].lineno + 1) if body else 0
                yield f"{_rel(path)}::{name}", 0 if _declarations_only(body) else lines
                yield from walk(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(_tree(path) if source is None else ast.parse(source, str(path)), "")


def test_no_function_body_over_60_lines() -> None:
    lengths = dict(pair for path in _files() for pair in _function_lengths(path))
    long = {name for name, lines in lengths.items() if lines > MAX_FUNCTION_LINES}
    assert sorted(long - LONG_FUNCTIONS) == [], "cut these at their seams"
    short_now = sorted(n for n in LONG_FUNCTIONS if lengths.get(n, 0) <= MAX_FUNCTION_LINES)
    assert short_now == [], "short enough (or gone): take them off LONG_FUNCTIONS"


def test_the_function_length_counts_the_body_only() -> None:
    """The rule's own arithmetic: signature and docstring do not count, nested bodies do."""
    module = PACKAGE / "_probe_for_the_count.py"
    source = '''def outer(
    a: int,
    b: int,
) -> int:
    """Doc.

    More doc.
    """
    x = a

    def inner() -> int:
        return b

    return x + inner()
'''
    lengths = dict(_function_lengths(module, source))
    assert lengths == {
        "gateway/_probe_for_the_count.py::outer": 6,
        "gateway/_probe_for_the_count.py::outer.inner": 1,
    }


def test_a_body_of_declarations_only_does_not_count() -> None:
    """Assignments of constructor calls are declarations; one other statement makes logic."""
    module = PACKAGE / "_probe_for_the_count.py"
    declared = "\n".join(f"        self.c{i} = Counter('c{i}', registry=r)" for i in range(70))
    source = f"""class Families:
    def declare(self, r: object) -> None:
        \"\"\"Doc.\"\"\"
{declared}

    def declare_and_act(self, r: object) -> None:
{declared}
        self.c0.inc()

    def compute(self, r: object) -> None:
{declared.replace("Counter(", "counter(")}
"""
    lengths = dict(_function_lengths(module, source))
    assert lengths == {
        "gateway/_probe_for_the_count.py::Families.declare": 0,
        "gateway/_probe_for_the_count.py::Families.declare_and_act": 71,
        "gateway/_probe_for_the_count.py::Families.compute": 70,
    }
