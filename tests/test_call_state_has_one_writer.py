"""A call's state has one writer: only gateway/call/record.py writes a CallContext (pure,
reads files).

The stages return small frozen results (an intake's :class:`gateway.call.record.Arrival`,
a hook's :class:`gateway.call.record.Checked`, the send stage's results...); the methods of
:class:`gateway.call.record.CallContext` are the only code that puts them into the context.
This test walks the syntax tree of every module of ``gateway/`` and fails on any write to a
context outside its owner module.

What counts as a context: the name ``ctx`` (the package's name for one), any name a module
annotates ``CallContext`` or binds to ``CallContext(...)``, and any ``X.ctx`` attribute (an
API's exchange keeps its call's context there). What counts as a write to one:

* an attribute store, augmented assignment, annotated assignment or ``del`` on it
  (``ctx.api = ...``, ``ctx.a, ctx.b = ...``, ``ctx.shadow_denied += ...``);
* ``setattr(ctx, ...)``, ``object.__setattr__(ctx, ...)``;
* an item store on one of its fields (``ctx.claimed["k"] = v``);
* a mutating method called on one of its fields (``ctx.warnings.append(...)``,
  ``extend``, ``insert``, ``update``, ``setdefault``, ``clear``, ``pop``, ``remove``...).

Not covered (said here so nobody takes the test for more than it is): a field read into a
local name and mutated through it (``w = ctx.warnings; w.append(...)``; no such alias
today); and the objects a field holds that have their own owner (the attempts' log,
written by :mod:`gateway.call.attempts`; an MCP exchange's outcomes, by
:mod:`gateway.call.mcp`; a database call's log, by :mod:`gateway.database`). Building a
context (``CallContext(...)``) is not a write.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gateway"
OWNER = "gateway/call/record.py"

#: Methods of list, dict and set that change the object they are called on.
MUTATORS = frozenset(
    {
        "append", "extend", "insert", "remove", "pop", "popitem", "clear", "update",
        "setdefault", "add", "discard", "sort", "reverse", "__setitem__", "__delitem__",
        "__iadd__",
    }
)  # fmt: skip


def _annotated_context(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    text = ast.unparse(annotation)
    return "CallContext" in text


def _context_names(tree: ast.AST) -> set[str]:
    """``ctx``, and the names the module annotates CallContext or binds to one."""
    names = {"ctx"}
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and _annotated_context(node.annotation):
            names.add(node.arg)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if _annotated_context(node.annotation):
                names.add(node.target.id)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if called == "CallContext":
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _is_context(node: ast.expr, names: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in names
    return isinstance(node, ast.Attribute) and node.attr == "ctx"


def _field_of_context(node: ast.expr, names: set[str]) -> bool:
    """``ctx.field``."""
    return isinstance(node, ast.Attribute) and _is_context(node.value, names)


def _stored(target: ast.expr) -> list[ast.expr]:
    """The expressions an assignment target stores into (a tuple's elements, unpacked)."""
    if isinstance(target, ast.Tuple | ast.List):
        return [e for element in target.elts for e in _stored(element)]
    if isinstance(target, ast.Starred):
        return _stored(target.value)
    return [target]


def _written(target: ast.expr, names: set[str]) -> bool:
    """Whether storing into ``target`` writes a context: its attribute, or an item of
    one of its fields."""
    if _field_of_context(target, names):
        return True
    return isinstance(target, ast.Subscript) and _field_of_context(target.value, names)


def writes(source: str) -> list[str]:
    """Each write to a CallContext in ``source``, as ``line: code`` (inside the class
    itself, ``self`` is one)."""
    tree = ast.parse(source)
    names = _context_names(tree)
    found = _found(tree, names)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "CallContext":
            found += [n for n in _found(node, names | {"self"}) if n not in found]
    return [f"{getattr(n, 'lineno', 0)}: {ast.unparse(n)}" for n in found]


def _calls_a_writer(node: ast.Call, names: set[str]) -> bool:
    """``setattr(ctx, ...)``, ``object.__setattr__(ctx, ...)``, ``ctx.field.append(...)``."""
    func = node.func
    if (isinstance(func, ast.Name) and func.id == "setattr") or (
        isinstance(func, ast.Attribute) and func.attr == "__setattr__"
    ):
        return bool(node.args) and _is_context(node.args[0], names)
    return isinstance(func, ast.Attribute) and (
        func.attr in MUTATORS and _field_of_context(func.value, names)
    )


def _found(tree: ast.AST, names: set[str]) -> list[ast.AST]:
    found: list[ast.AST] = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call) and _calls_a_writer(node, names):
            found.append(node)
        if any(_written(t, names) for target in targets for t in _stored(target)):
            found.append(node)
    return found


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize(
    "code",
    [
        "ctx.api = 'proxy'",
        "ctx.decision, ctx.cost_reason = 'denied', 'not_sent'",
        "data, ctx.usage = None, 1",
        "ctx.prior_attempts += 1",
        "ctx.shadow_denied += rules",
        "ctx.model: object = None",
        "del ctx.mcp",
        "setattr(ctx, 'api', 'mcp')",
        "object.__setattr__(ctx, 'api', 'mcp')",
        "ctx.warnings.append('w')",
        "ctx.shadow_denied.extend(rules)",
        "ctx.claimed.update(ids)",
        "ctx.claimed['trace_id'] = 't'",
        "self.ctx.api = 'mcp'",
        "exchange = ctx.mcp = make()",
        "def f(call: CallContext) -> None:\n    call.api = 'mcp'",
        "def f() -> None:\n    call = CallContext(0.0, 'a')\n    call.replayed = True",
    ],
)
def test_the_walker_finds_each_kind_of_write(code: str) -> None:
    assert len(writes(code)) == 1, code


@pytest.mark.parametrize(
    "code",
    [
        "x = ctx.api",
        "ctx.record()",
        "ctx.attempt_log.attempts",
        "self.ctx = CallContext(0.0, 'a')",
        "self.context.sni_callback = pick",  # an SSL context, not a call's
        "log.warnings.append('w')",
        "ctx.apply(result)",
    ],
)
def test_the_walker_leaves_reads_and_other_objects_alone(code: str) -> None:
    assert writes(code) == [], code


def test_the_owner_module_is_where_the_context_is_defined() -> None:
    source = (ROOT / OWNER).read_text()
    assert "class CallContext" in source
    assert writes(source), "the owner writes the context; the walker should see it"


def test_only_the_owner_writes_a_call_context() -> None:
    offenders = {
        str(path.relative_to(ROOT)): found
        for path in _modules()
        if str(path.relative_to(ROOT)) != OWNER and (found := writes(path.read_text()))
    }
    assert offenders == {}
