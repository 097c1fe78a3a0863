"""The house keeps itself: library owners, package cycles, module sizes (pure, reads files).

Each third-party library is imported by its owner only (the same table as ruff's banned-API
rule, TID251, in pyproject.toml, which this test also holds to the table); the contract
(``envelope``, ``errors``) imports nothing else of the package; ``demo`` is imported by
nothing; no cycle between the package's parts; no module over 500 lines.
"""

from __future__ import annotations

import ast
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
            "gateway/server/app.py",
            "gateway/server/proxy.py",
            "gateway/server/mcp.py",
            "gateway/inject/server.py",
        }
    ),
    "yarl": frozenset({"gateway/urls.py"}),
    "multidict": frozenset({"gateway/ratelimit/headers.py"}),
    # The modelling library of the contract, the policy and the audit schema, and the two
    # places that translate its ValidationError into the sidecar's own errors.
    "pydantic": frozenset(
        {
            "gateway/envelope.py",
            "gateway/audit/schema.py",
            "gateway/policy/models.py",
            "gateway/policy/stores.py",
            "gateway/policy/budgets.py",
            "gateway/policy/mcp.py",
            "gateway/policy/loader.py",
            "gateway/call/intake.py",
        }
    ),
    "prometheus_client": frozenset({"gateway/metrics/__init__.py", "gateway/metrics/series.py"}),
    # Model prices (bundled data, never fetched at run time).
    "genai_prices": frozenset({"gateway/cost/prices.py"}),
    # pydantic's own core (its error types), used where the models are defined.
    "pydantic_core": frozenset({"gateway/policy/models.py"}),
    "structlog": frozenset({"gateway/audit/log.py"}),
    "yaml": frozenset({"gateway/policy/loader.py"}),
    "hvac": frozenset({"gateway/secrets/vault.py", "gateway/secrets/vault_auth.py"}),
    "pybreaker": frozenset({"gateway/breaker.py"}),
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
}
#: A program of its own beside the sidecar (its stand-in upstreams and console output):
#: it may import what it needs, and nothing imports it.
PROGRAMS = ("gateway/demo/",)
MAX_MODULE_LINES = 500


def _files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> Iterator[tuple[str, bool]]:
    """(imported module, only for type checking) for every import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
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


def _runtime_graph() -> dict[str, set[str]]:
    known = {_module(p) for p in _files()}
    graph: dict[str, set[str]] = {}
    for path in _files():
        source = _unit(_module(path))
        for name, typing_only in _imports(path):
            if typing_only or not name.startswith("gateway.") or name not in known:
                continue
            target = _unit(name)
            if target != source and target != "gateway":
                graph.setdefault(source, set()).add(target)
    return graph


def test_no_cycle_between_the_parts_of_the_package() -> None:
    graph = _runtime_graph()
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif len(path) < 12:
                visit(nxt, [*path, nxt])

    for start in sorted(graph):
        visit(start, [start])
    assert sorted({" -> ".join(c) for c in cycles}) == []


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
def test_modules_stay_small(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= MAX_MODULE_LINES
