"""The policy's ``models:`` key, on a target and on an agent: which models a call may ask
for, which alias is pinned to which snapshot, and what a drifted answer does (design.md,
"Models under control").

```yaml
targets:
  openai:
    usage: openai
    models:
      allow: [gpt-4o-2024-08-06, gpt-4o-mini*]   # names and globs (* ? [...])
      pin: {gpt-4o: gpt-4o-2024-08-06}           # alias -> snapshot, before sending
      on_drift: refuse                           # or record (the default)
      mode: enforce                              # or shadow: allow is recorded, never refuses
agents:
  planner:
    uid: 1001
    models: {allow: [gpt-4o-mini*]}              # on every target it calls, with the target's
```

:func:`choose` is the decision (pure): the requested model is pinned (the agent's pins,
then the target's, each followed to its end), and the model to send must be in every
``allow`` that applies. :func:`model_problems` and :func:`model_warnings` are what
``validate`` says of the key.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints

from gateway.policy import defaults as d
from gateway.policy.budgets import Mode, ModelName
from gateway.policy.stores import StrictModel

#: An ``allow`` entry: a model name or a glob (``*``, ``?``, ``[...]``; fnmatch, case
#: sensitive).
ModelGlob = Annotated[
    str, StringConstraints(pattern=r"^[A-Za-z0-9*?\[][A-Za-z0-9._:/@+\-*?\[\]!]{0,127}$")
]
OnDrift = Literal["record", "refuse"]


class ModelsSpec(StrictModel):
    """``allow`` (None: any model), ``pin`` (alias -> snapshot), ``on_drift`` and
    ``mode`` (``shadow``: a model outside ``allow`` is recorded, not refused)."""

    allow: list[ModelGlob] | None = Field(
        None, max_length=d.MAX_MODEL_RULES
    )  # models a call may send (names, globs); absent: any; another is PERMISSION_DENIED
    pin: dict[ModelName, ModelName] = Field(
        default_factory=dict, max_length=d.MAX_MODEL_RULES
    )  # alias -> snapshot: the request names the snapshot before it is sent
    on_drift: OnDrift = "record"  # an answer naming another model: record it, or refuse it
    mode: Mode = "enforce"  # shadow: a model outside allow is recorded, not refused

    def allows(self, model: str) -> bool:
        """Whether ``model`` is in ``allow`` (every model when ``allow`` is absent)."""
        return self.allow is None or any(fnmatch.fnmatchcase(model, g) for g in self.allow)


@dataclass(frozen=True, slots=True)
class ModelChoice:
    """What :func:`choose` decided: the model ``requested``, the one to ``sent`` (after
    the pins), whether a drifted answer is refused, and the rules that refuse the model
    (``denied_by``: ``enforce`` rules; ``shadow_by``: ``shadow`` ones, which only record;
    each a rule's owner, ``target:NAME`` or ``agent:NAME``)."""

    requested: str
    sent: str
    refuse_drift: bool
    denied_by: tuple[str, ...] = ()
    shadow_by: tuple[str, ...] = ()


def pinned(pin: Mapping[str, str], model: str) -> str:
    """``model`` after ``pin``, followed to its end (``a -> b -> c`` gives ``c``); a
    cycle (refused by ``validate``) stops where it would repeat."""
    seen = {model}
    while (nxt := pin.get(model)) is not None and nxt not in seen:
        seen.add(nxt)
        model = nxt
    return model


def choose(rules: Sequence[tuple[str, ModelsSpec]], requested: str) -> ModelChoice:
    """The decision on a call asking for ``requested`` under ``rules`` (``(owner,
    spec)`` pairs, the agent's before the target's): pins applied in that order, then
    every ``allow`` checked against the model to send."""
    sent = requested
    for _, spec in rules:
        sent = pinned(spec.pin, sent)
    denied = tuple(o for o, s in rules if s.mode == "enforce" and not s.allows(sent))
    shadow = tuple(o for o, s in rules if s.mode == "shadow" and not s.allows(sent))
    refuse = any(s.on_drift == "refuse" for _, s in rules)
    return ModelChoice(requested, sent, refuse, denied, shadow)


def is_glob(pattern: str) -> bool:
    """Whether an ``allow`` entry is a glob rather than a name."""
    return any(c in pattern for c in "*?[")


def _cycle(pin: Mapping[str, str], start: str) -> list[str] | None:
    path = [start]
    model = start
    while (nxt := pin.get(model)) is not None:
        if nxt == start:
            return [*path, nxt]
        if nxt in path:
            return None  # a cycle further on: reported from its own members
        path.append(nxt)
        model = nxt
    return None


def spec_problems(spec: ModelsSpec, where: tuple[str, ...]) -> list[tuple[tuple[str, ...], str]]:
    """A pin cycle and a pin to a model outside ``allow``: (key path, message) pairs."""
    problems: list[tuple[tuple[str, ...], str]] = []
    for alias in spec.pin:
        cycle = _cycle(spec.pin, alias)
        if cycle is not None and alias == min(cycle):  # each cycle once
            message = "pin cycle: " + " -> ".join(cycle)
            problems.append(((*where, "pin", alias), message))
        elif cycle is None and not spec.allows(end := pinned(spec.pin, alias)):
            message = f"pins {alias!r} to {end!r}, which 'allow' does not allow"
            problems.append(((*where, "pin", alias), message))
    return problems


def model_problems(
    targets: Mapping[str, Any], agents: Mapping[str, Any]
) -> list[tuple[tuple[str, ...], str]]:
    """Every ``models:`` key's problems (:func:`spec_problems`), and ``models`` on a
    target that reads no provider's dialect (``usage: none``: its model is unknown)."""
    problems: list[tuple[tuple[str, ...], str]] = []
    for name, target in targets.items():
        spec: ModelsSpec | None = target.models
        if spec is None:
            continue
        if target.usage == "none":
            message = "needs 'usage' (openai, anthropic or gemini): how the model is read"
            problems.append((("targets", name, "models"), message))
        problems += spec_problems(spec, ("targets", name, "models"))
    for name, agent in agents.items():
        if agent.models is not None:
            problems += spec_problems(agent.models, ("agents", name, "models"))
    return problems


def model_warnings(
    targets: Mapping[str, Any],
    agents: Mapping[str, Any],
    known: Callable[[str], Iterable[str]],
) -> list[tuple[tuple[str, ...], str]]:
    """``allow`` globs that match no model the price table knows (``known(usage)``: the
    model names known for a target's dialect, or for any with ``"*"``), likely a typo."""
    warnings: list[tuple[tuple[str, ...], str]] = []
    specs = [(("targets", n), t.usage, t.models) for n, t in targets.items()]
    specs += [(("agents", n), "*", a.models) for n, a in agents.items()]
    for where, usage, spec in specs:
        globs = [(i, g) for i, g in enumerate(spec.allow or ()) if is_glob(g)] if spec else []
        if not globs:
            continue
        names = list(known(usage))  # the price table is read only for a glob to check
        for i, glob in globs:
            if not any(fnmatch.fnmatchcase(n, glob) for n in names):
                message = f"{glob!r} matches no model the price table knows"
                warnings.append(((*where, "models", "allow", str(i)), message))
    return warnings
