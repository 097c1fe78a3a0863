"""The package's layers, type-only imports included (pure, reads files): what records a
call (telemetry, audit, metrics, the call record) sits below the pipeline (``call/``)
and imports nothing of it, and no two parts of the package import each other, even
only for type checking."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gateway"
#: Parts that record a call; the pipeline is above them.
BELOW_THE_PIPELINE = ("gateway.telemetry", "gateway.audit", "gateway.metrics", "gateway.record")


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _part(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _imported(path: Path) -> set[str]:
    """Every module of the package ``path`` imports, at run time or for type checking."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("gateway.")}


def _graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    known = {_module(p) for p in files}
    graph: dict[str, set[str]] = {}
    for path in files:
        source = _part(_module(path))
        for name in _imported(path) & known:
            target = _part(name)
            if target not in (source, "gateway"):
                graph.setdefault(source, set()).add(target)
    return graph


@pytest.mark.parametrize("part", BELOW_THE_PIPELINE)
def test_what_records_a_call_imports_nothing_of_the_pipeline(part: str) -> None:
    assert "gateway.call" not in _graph().get(part, set())


def test_no_cycle_between_the_parts_of_the_package_even_for_type_checking() -> None:
    graph = _graph()
    cycles: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                cycles.add(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif len(path) < 12:
                visit(nxt, [*path, nxt])

    for start in sorted(graph):
        visit(start, [start])
    assert sorted(cycles) == []
