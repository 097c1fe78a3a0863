"""A policy file's YAML read into plain data, bounded, each key's line remembered.

The YAML is read by PyYAML's safe loader, changed so that:

* duplicate keys are refused (PyYAML would silently keep the last one); keys must be
  plain scalars (``? [a, b]`` is refused, not a ``TypeError``);
* merge keys (``<<: *defaults``, https://yaml.org/type/merge.html) work: the mapping's
  own keys win, then earlier merged mappings over later ones; an error in a merged key
  names the line where that key is written;
* the work is bounded: at most ``MAX_NESTING`` levels and ``MAX_NODES`` values, an
  alias counting as many values as it stands for (so a "billion laughs" file is refused
  in milliseconds), no alias cycles;
* a scalar PyYAML cannot convert (``!!int x``, the date ``2024-02-30``, an integer of
  more than 4300 digits) is a problem on its line.

:func:`read_yaml` gives the root node, the :class:`Document` (whose
:meth:`~Document.line_of` finds the line of a key path, as pydantic reports one) and the
data; it raises :class:`Problem` (line, key path, message), and nothing else, whatever
the text holds. :mod:`gateway.policy.loader` turns a problem into a
``FILE:LINE: key.path: problem`` line.
"""

from __future__ import annotations

import re
from typing import Any, Final, TypeAlias

import yaml

#: Levels of nesting (aliases and merges included). A policy's deepest key path is 7
#: (``targets.t.endpoints.0.methods.0``); PyYAML's composer recurses, two frames a level.
MAX_NESTING: Final = 32
#: Values in the document (each alias counting as what it stands for): about 3 s of
#: PyYAML composing, and what pydantic then walks; real policies hold a few hundred.
MAX_NODES: Final = 100_000

KeyPath = tuple[int | str, ...]

_MAP_TAG: Final = "tag:yaml.org,2002:map"
_SEQ_TAG: Final = "tag:yaml.org,2002:seq"
_STR_TAG: Final = "tag:yaml.org,2002:str"
_MERGE_TAG: Final = "tag:yaml.org,2002:merge"
_INT_TAG: Final = "tag:yaml.org,2002:int"
_DIGITS: Final = re.compile(r"[-+]?[0-9_]+")
_VALUE_TAG: Final = "tag:yaml.org,2002:value"
#: A composed YAML node (the root :func:`read_yaml` gives, for :meth:`Document.line_of`).
Node: TypeAlias = yaml.Node


class Problem(Exception):
    """One problem found while reading the YAML, before any model sees it."""

    def __init__(self, line: int, path: KeyPath, message: str) -> None:
        super().__init__(message)
        self.line, self.path, self.message = line, path, message


def shown(text: str, limit: int) -> str:
    """``text`` on one line: control characters escaped, cut to ``limit`` characters."""
    if not text.isprintable():  # str.isprintable: what shows as itself, on one line
        text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def mark_line(mark: Any) -> int:
    return int(mark.line) + 1 if mark is not None else 1


class _Loader(yaml.SafeLoader):
    """SafeLoader whose composer bounds nesting and node count, remembers the key path
    it is composing (so a syntax error can name where it is) and the line of each alias
    in a list (PyYAML hands back the anchored node, whose line is the anchor's)."""

    def __init__(self, text: str) -> None:
        self.key_path: list[int | str] = []
        #: (id(sequence node), index) -> line of an alias item.
        self.alias_lines: dict[tuple[int, int], int] = {}
        self._depth = 0
        self._nodes = 0
        super().__init__(text)

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        self._depth += 1
        self._nodes += 1
        event = self.peek_event()  # type: ignore[no-untyped-call]
        if self._depth > MAX_NESTING or self._nodes > MAX_NODES:
            too_many = (
                f"{MAX_NESTING} levels of nesting"
                if self._depth > MAX_NESTING
                else f"{MAX_NODES} values"
            )
            raise Problem(
                mark_line(event.start_mark),
                tuple(self.key_path),
                f"more than {too_many} (a policy needs far fewer)",
            )
        if isinstance(event, yaml.AliasEvent) and isinstance(parent, yaml.SequenceNode):
            self.alias_lines[(id(parent), index)] = mark_line(event.start_mark)
        pushed = parent is not None and index is not None
        if pushed:
            self.key_path.append(index if isinstance(index, int) else _key_text(index))
        node = super().compose_node(parent, index)
        # Popped only on success: after an error the path still says where it was.
        if pushed:
            self.key_path.pop()
        self._depth -= 1
        return node


def _key_text(node: yaml.Node) -> str:
    return str(node.value) if isinstance(node, yaml.ScalarNode) else "?"


class Document:
    """Builds plain data from the composed node graph: merges applied, duplicate and
    non-scalar keys refused, aliases shared (not copied) yet counted in full, cycles
    refused. Keeps, per mapping node, its effective keys' nodes for error lines."""

    def __init__(self, loader: _Loader) -> None:
        self._loader = loader
        #: id(mapping node) -> {key: (key node, value node)}, merged keys included.
        self.entries: dict[int, dict[Any, tuple[yaml.Node, yaml.Node]]] = {}
        self._built: dict[int, tuple[Any, int, int]] = {}  # id -> (value, nodes, height)
        self._open: set[int] = set()
        self._nodes = 0

    def build(self, node: yaml.Node, path: KeyPath, line: int, depth: int = 1) -> Any:
        """The value of ``node``, written at key path ``path`` on ``line`` (where an
        alias to it is, for an alias), ``depth`` levels down."""
        done = self._built.get(id(node))
        if done is not None:
            value, nodes, height = done
            self._count(nodes, line, path)
            if depth + height - 1 > MAX_NESTING:
                raise _too_deep(line, path)
            return value
        if id(node) in self._open:
            raise Problem(line, path, "an alias refers to a node that contains it (a cycle)")
        if depth > MAX_NESTING:
            raise _too_deep(line, path)
        before = self._nodes
        self._count(1, line, path)
        self._open.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            value, height = self._scalar(node, path), 1
        elif isinstance(node, yaml.SequenceNode):
            value, height = self._sequence(node, path, depth)
        elif isinstance(node, yaml.MappingNode):
            value, height = self._mapping(node, path, depth)
        else:  # pragma: no cover - PyYAML composes only these three
            raise TypeError(node)
        self._open.discard(id(node))
        self._built[id(node)] = (value, self._nodes - before, height)
        return value

    def _count(self, nodes: int, line: int, path: KeyPath) -> None:
        self._nodes += nodes
        if self._nodes > MAX_NODES:
            raise Problem(
                line, path, f"the document expands to more than {MAX_NODES} values through aliases"
            )

    def _scalar(self, node: yaml.ScalarNode, path: KeyPath) -> Any:
        try:
            return self._loader.construct_object(node, deep=True)
        except yaml.MarkedYAMLError as exc:
            raise Problem(
                mark_line(exc.problem_mark or node.start_mark),
                path,
                f"not valid YAML: {exc.problem or exc.context}",
            ) from None
        except (ValueError, TypeError, LookupError, AttributeError, ArithmeticError):
            # PyYAML's converters raise these for values their tag cannot hold, and int()
            # for more than sys.get_int_max_str_digits() (4300) digits.
            if node.tag == _INT_TAG and _DIGITS.fullmatch(node.value):
                problem = "the number has too many digits"
            else:
                problem = f"{shown(node.value, 40)!r} is not a valid {_tag(node.tag)}"
            raise Problem(mark_line(node.start_mark), path, f"not valid YAML: {problem}") from None

    def _sequence(self, node: yaml.SequenceNode, path: KeyPath, depth: int) -> tuple[Any, int]:
        if node.tag != _SEQ_TAG:
            raise _tag_problem(node, path)
        items, height = [], 0
        for i, item in enumerate(node.value):
            items.append(self.build(item, (*path, i), self.item_line(node, i), depth + 1))
            height = max(height, self._built[id(item)][2])
        return items, height + 1

    def item_line(self, node: yaml.SequenceNode, index: int) -> int:
        """The line of item ``index`` of ``node`` as written (an alias's own line)."""
        line = self._loader.alias_lines.get((id(node), index))
        return line if line is not None else mark_line(node.value[index].start_mark)

    def _mapping(self, node: yaml.MappingNode, path: KeyPath, depth: int) -> tuple[Any, int]:
        if node.tag != _MAP_TAG:
            raise _tag_problem(node, path)
        own: dict[Any, tuple[yaml.Node, yaml.Node]] = {}
        merged: dict[Any, tuple[yaml.Node, yaml.Node]] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                line = mark_line(key_node.start_mark)
                for source in _merge_sources(value_node, path, line):
                    # Not counted here: its values are counted below, as this mapping's.
                    counted = self._nodes
                    self.build(source, path, line, depth + 1)
                    self._nodes = counted
                    for key, pair in self.entries[id(source)].items():
                        merged.setdefault(key, pair)  # earlier mappings win
                continue
            key = self._key(key_node, path)
            if key in own:
                first = mark_line(own[key][0].start_mark)
                raise Problem(
                    mark_line(key_node.start_mark),
                    (*path, key),
                    f"duplicate key (first on line {first})",
                )
            own[key] = (key_node, value_node)
        entries = merged | own  # the mapping's own keys win
        self.entries[id(node)] = entries
        data, height = {}, 0
        for key, (key_node, value_node) in entries.items():
            line = mark_line(key_node.start_mark)
            data[key] = self.build(value_node, (*path, key), line, depth + 1)
            height = max(height, self._built[id(value_node)][2])
        return data, height + 1

    def _key(self, node: yaml.Node, path: KeyPath) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            raise Problem(
                mark_line(node.start_mark),
                path,
                "a key must be a plain value such as a name, not a list or a mapping",
            )
        if node.tag == _VALUE_TAG:  # '=' as a key: a string, as PyYAML reads it
            node.tag = _STR_TAG
        return self._scalar(node, path)  # PyYAML's scalars are all hashable

    def line_of(self, root: yaml.Node, loc: KeyPath) -> int:
        """The line of the key at ``loc`` (as pydantic reports it), or of its nearest
        parent written in the file."""
        node, line = root, mark_line(root.start_mark)
        for part in loc:
            if isinstance(node, yaml.MappingNode):
                pair = _find(self.entries.get(id(node), {}), part)
                if pair is None:
                    return line
                line, node = mark_line(pair[0].start_mark), pair[1]
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
                if part >= len(node.value):
                    return line
                line, node = self.item_line(node, part), node.value[part]
            else:
                return line
        return line


def _too_deep(line: int, path: KeyPath) -> Problem:
    return Problem(line, path, f"more than {MAX_NESTING} levels of nesting, aliases included")


def _merge_sources(value: yaml.Node, path: KeyPath, line: int) -> list[yaml.MappingNode]:
    sources = []
    for source in value.value if isinstance(value, yaml.SequenceNode) else [value]:
        if not isinstance(source, yaml.MappingNode):
            raise Problem(
                line,
                path,
                "a merge key '<<' takes a mapping or a list of mappings (e.g. *defaults)",
            )
        sources.append(source)
    return sources


def _tag_problem(node: yaml.Node, path: KeyPath) -> Problem:
    return Problem(
        mark_line(node.start_mark),
        path,
        f"the YAML tag {_tag(node.tag)} is not used in policies (write a plain mapping or list)",
    )


def _find(
    entries: dict[Any, tuple[yaml.Node, yaml.Node]], part: int | str
) -> tuple[yaml.Node, yaml.Node] | None:
    if part in entries:
        return entries[part]
    # pydantic reports a key that is not a string by its str() (or an int as itself).
    return next((pair for key, pair in entries.items() if str(key) == str(part)), None)


def _tag(tag: str) -> str:
    return tag.replace("tag:yaml.org,2002:", "!!")


def read_yaml(text: str) -> tuple[yaml.Node, Document, Any]:
    """Compose and build ``text``: (root node, document, data). Raises Problem."""
    loader: _Loader | None = None
    try:
        loader = _Loader(text)
        root = loader.get_single_node()
        if root is None:
            raise Problem(1, (), "the policy is empty: it must be a YAML mapping")
        if not isinstance(root, yaml.MappingNode):
            raise Problem(mark_line(root.start_mark), (), "the policy must be a YAML mapping")
        document = Document(loader)
        return root, document, document.build(root, (), mark_line(root.start_mark))
    except yaml.reader.ReaderError as exc:
        char = exc.character
        shown = f"U+{char:04X}" if isinstance(char, int) else repr(char)
        line = text.count("\n", 0, exc.position) + 1
        raise Problem(line, (), f"not valid YAML: the character {shown} is not allowed") from None
    except yaml.MarkedYAMLError as exc:
        path = tuple(loader.key_path) if loader is not None else ()
        problem = exc.problem or "unreadable"
        if exc.context and not exc.context.startswith("while "):
            # "found duplicate anchor 'a'; first occurrence" / "second occurrence"
            problem = f"{exc.context} on line {mark_line(exc.context_mark)}, {problem} here"
        raise Problem(mark_line(exc.problem_mark), path, f"not valid YAML: {problem}") from None
    except yaml.YAMLError as exc:  # pragma: no cover - every PyYAML error we know is above
        raise Problem(1, (), f"not valid YAML: {exc}") from None
    finally:
        if loader is not None:
            loader.dispose()
