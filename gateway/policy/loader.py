"""Loading a policy file: YAML -> validated :class:`Policy` -> :class:`PolicySet`.

``load_policy`` raises :class:`PolicyError` and nothing else, whatever the file holds:
each problem is one printable line ``FILE:LINE: key.path: problem`` (``(top level)``
when no key is concerned; line 1 for a problem of the whole file). A file that is not
readable YAML has its first problem reported; a YAML one has every problem of its keys
and values reported at once. The file is at most ``MAX_POLICY_BYTES`` of UTF-8; its YAML
is read, bounded, by :mod:`gateway.policy.document` (duplicate keys refused, merge keys
applied, nesting and values counted); pydantic's errors are named here by key path and
line, with the known keys of a misspelt one.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

from pydantic import BaseModel, ValidationError

from gateway.policy.compiled import PolicySet
from gateway.policy.document import Document, KeyPath, Node, Problem, read_yaml, shown
from gateway.policy.extras import missing_extras
from gateway.policy.refs import parse_ref
from gateway.policy.root import Policy

#: The largest policy file read. PyYAML's pure-Python parser reads about 100-250 kB a
#: second; the shipped example is 4 kB for 4 targets, so a MiB is ~1,000 targets.
MAX_POLICY_BYTES: Final = 1024 * 1024
#: A shown key is cut to this many characters; each problem line to _MAX_LINE_CHARS.
_MAX_KEY_CHARS: Final = 64
_MAX_LINE_CHARS: Final = 1000
TOP_LEVEL: Final = "(top level)"
#: An agent token read at load is read this far (a token is a few dozen bytes).
MAX_TOKEN_BYTES: Final = 4096


class PolicyError(Exception):
    """A policy file that cannot be used. ``problems`` lists every error, each one line
    ``FILE:LINE: key.path: problem``; ``source`` is the file as given."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__("\n".join(problems))


def _problem_line(source: str, line: int, path: KeyPath, message: str) -> str:
    key = ".".join(shown(str(p), _MAX_KEY_CHARS) for p in path) or TOP_LEVEL
    return shown(f"{shown(source, 300)}:{line}: {key}: {message}", _MAX_LINE_CHARS)


def _known_keys(loc: KeyPath) -> list[str]:
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


#: What pydantic adds to an error's location besides keys: a validator function's name.
#: (A final "[key]" marks a dict key that is itself invalid: see _format_errors.)
_LOC_TAG: Final = re.compile(r"^function-(plain|after|before|wrap)\[.*\]$")


def _format_errors(source: str, root: Node, document: Document, exc: ValidationError) -> list[str]:
    problems = []
    for err in exc.errors(include_url=False):
        if err["type"] == "cross_reference":
            for loc, msg in err["ctx"]["problems"]:
                problems.append(_problem_line(source, document.line_of(root, loc), loc, msg))
            continue
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and _LOC_TAG.match(p)))
        msg = err["msg"].removeprefix("Value error, ")
        if loc and loc[-1] == "[key]":
            loc, msg = loc[:-1], f"invalid key: {msg}"
        elif err["type"] == "extra_forbidden":
            known = _known_keys(loc[:-1])
            close = difflib.get_close_matches(str(loc[-1])[:100], known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            msg = f"unknown key{hint}; known keys here: {', '.join(known)}"
        elif err["type"] == "float_type" and type(err.get("input")) is int:
            msg = "the number is too large"
        problems.append(_problem_line(source, document.line_of(root, loc), loc, msg))
    return problems


def parse_policy(text: str, source: str = "<memory>") -> Policy:
    """Parse and validate policy YAML text. Raises :class:`PolicyError` (and nothing
    else, whatever ``text`` holds)."""
    return _parse(text, source)[0]


def _parse(text: str, source: str) -> tuple[Policy, Node, Document]:
    try:
        root, document, data = read_yaml(text)
    except Problem as p:
        raise PolicyError(source, [_problem_line(source, p.line, p.path, p.message)]) from None
    try:
        return Policy.model_validate(data), root, document
    except ValidationError as exc:
        raise PolicyError(source, _format_errors(source, root, document, exc)) from None


def _token_problems(policy: Policy, environ: Mapping[str, str]) -> list[tuple[KeyPath, str]]:
    """The agents' tokens that cannot be read now (``file://`` unreadable or empty,
    ``env://`` unset or empty): (key path, message). Never shows a value."""
    problems: list[tuple[KeyPath, str]] = []
    for name, agent in policy.agents.items():
        if agent.token_ref is None:
            continue
        ref, where = parse_ref(agent.token_ref), ("agents", name, "token_ref")
        if ref.scheme == "file":
            try:
                with open(ref.path, "rb") as file:
                    empty = not file.read(MAX_TOKEN_BYTES).strip()
            except OSError as exc:
                problems.append((where, f"cannot read the agent token: {exc.strerror or exc}"))
                continue
        elif ref.scheme == "env":
            empty = not environ.get(ref.path, "").strip()
        else:
            continue  # vault:// is read at start, by the secret resolvers
        if empty:
            problems.append((where, f"the agent token {agent.token_ref!r} is empty"))
    return problems


def _read_text(path: str | os.PathLike[str]) -> str:
    """The text of the policy file at ``path``: at most ``MAX_POLICY_BYTES`` of UTF-8.
    Raises :class:`PolicyError` (unreadable, a directory, too large, not UTF-8)."""
    source = str(path)

    def fail(line: int, message: str) -> PolicyError:
        return PolicyError(source, [_problem_line(source, line, (), message)])

    try:
        with open(path, "rb") as file:
            raw = file.read(MAX_POLICY_BYTES + 1)
    except OSError as exc:
        raise fail(1, f"cannot read the policy: {exc.strerror or exc}") from None
    if len(raw) > MAX_POLICY_BYTES:
        raise fail(1, f"the policy is larger than {MAX_POLICY_BYTES} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise fail(line, f"the policy is not UTF-8 text (byte 0x{raw[exc.start]:02x})") from None


def problem_lines(
    path: str | os.PathLike[str], problems: Sequence[tuple[KeyPath, str]]
) -> list[str]:
    """``problems`` (key path, message) found later in the valid policy at ``path``, as
    ``FILE:LINE: key.path: problem`` lines (``validate --check-database``)."""
    source = str(path)
    _, root, document = _parse(_read_text(path), source)
    return [_problem_line(source, document.line_of(root, k), k, m) for k, m in problems]


def load_policy(path: str | os.PathLike[str]) -> PolicySet:
    """Read, validate and compile the policy at ``path``, with the SHA-256 of its text
    (``PolicySet.sha256``); the agents' ``file://`` and ``env://`` tokens must be
    readable and not empty, and the optional extras the policy uses installed
    (:func:`gateway.policy.extras.missing_extras`: a database target, ``a2a.card.verify``).
    Raises :class:`PolicyError` (and nothing else, whatever the file holds)."""
    source = str(path)
    text = _read_text(path)
    policy, root, document = _parse(text, source)
    problems = _token_problems(policy, os.environ) + missing_extras(policy)
    if problems:
        lines = [_problem_line(source, document.line_of(root, k), k, m) for k, m in problems]
        raise PolicyError(source, lines)
    digest = hashlib.sha256(text.encode()).hexdigest()
    return PolicySet.compile(policy, source, sha256=digest)
