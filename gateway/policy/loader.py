"""Loading a policy file: YAML -> validated :class:`Policy` -> :class:`PolicySet`.

Errors name the file, the YAML line, the key path and, for a misspelt key, the closest
known key. ``load_policy`` raises :class:`PolicyError` carrying every problem found.
Duplicate keys are refused (PyYAML would silently keep the last one).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Final

import yaml
from pydantic import BaseModel, ValidationError

from gateway.policy.compiled import PolicySet
from gateway.policy.models import Policy


class PolicyError(Exception):
    """A policy file that cannot be used. ``problems`` lists every error, each naming
    the file and the key path (and the YAML line where known)."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__("\n".join(problems))


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (PyYAML silently keeps the last)."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"found duplicate key {key!r}",
                key_node.start_mark,
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_mapping,
)


def _line_of(root: yaml.Node | None, loc: tuple[int | str, ...]) -> int | None:
    node = root
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                if key_node.value == str(part):
                    line = key_node.start_mark.line + 1
                    node = value_node
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if part >= len(node.value):
                return line
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def _known_keys(loc: tuple[int | str, ...]) -> list[str]:
    model: Any = Policy
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if fields is None:
            return []
        if isinstance(part, int) or part not in fields:
            # Inside a dict or list of models: descend to the item type.
            continue
        annotation = fields[part].annotation
        model = _model_in(annotation)
    fields = getattr(model, "model_fields", None)
    return list(fields) if fields else []


def _model_in(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _format_errors(source: str, root: yaml.Node | None, exc: ValidationError) -> list[str]:
    problems = []
    for err in exc.errors(include_url=False):
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        # pydantic puts union member names in loc; keep only real keys.
        loc = tuple(p for p in loc if not (isinstance(p, str) and ("[" in p or p in _UNION_TAGS)))
        key = ".".join(str(p) for p in loc) or "(top level)"
        line = _line_of(root, loc)
        where = f"{source}:{line}" if line else source
        if err["type"] == "extra_forbidden":
            parent = loc[:-1]
            known = _known_keys(parent)
            close = difflib.get_close_matches(str(loc[-1]), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            msg = f"unknown key{hint}; known keys here: {', '.join(known)}"
        else:
            msg = err["msg"].removeprefix("Value error, ")
            if (not loc and "\n" in msg) or msg.startswith(("targets.", "rate_limit_groups.")):
                # Cross-reference problems carry their own key paths, one a line.
                for item in msg.split("\n"):
                    item_key, _, item_msg = item.partition(": ")
                    item_loc = tuple(int(p) if p.isdigit() else p for p in item_key.split("."))
                    item_line = _line_of(root, item_loc)
                    item_where = f"{source}:{item_line}" if item_line else source
                    problems.append(f"{item_where}: {item_key}: {item_msg}")
                continue
        problems.append(f"{where}: {key}: {msg}")
    return problems


_UNION_TAGS: Final = frozenset({"int", "str", "literal['timeout','connect']"})


def parse_policy(text: str, source: str = "<memory>") -> Policy:
    """Parse and validate policy YAML text. Raises :class:`PolicyError`."""
    try:
        root = yaml.compose(text, Loader=_UniqueKeyLoader)
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        problem = getattr(exc, "problem", None) or str(exc)
        raise PolicyError(source, [f"{where}: not valid YAML: {problem}"]) from None
    if not isinstance(data, dict):
        raise PolicyError(source, [f"{source}: the policy must be a YAML mapping"])
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        raise PolicyError(source, _format_errors(source, root, exc)) from None


def load_policy(path: str | os.PathLike[str]) -> PolicySet:
    """Read, validate and compile the policy at ``path``. Raises :class:`PolicyError`."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(source, [f"{source}: cannot read the policy: {exc.strerror}"]) from None
    except UnicodeDecodeError:
        raise PolicyError(source, [f"{source}: the policy is not UTF-8 text"]) from None
    return PolicySet.compile(parse_policy(text, source), source)
