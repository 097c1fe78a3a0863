"""The compiled policy the pipeline reads: parsed URLs, origins, endpoint matchers.

A :class:`PolicySet` is built once from a validated :class:`Policy` and replaced whole on
reload, never mutated.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Final

from gateway.envelope import HttpMethod
from gateway.policy.a2a import CARD_PATHS
from gateway.policy.mcp import MCP_METHODS
from gateway.policy.models import TargetSpec
from gateway.policy.root import Policy
from gateway.urls import URL

_UNSEEN: Final = object()
_GET: Final[frozenset[HttpMethod]] = frozenset({"GET"})
_POST: Final[frozenset[HttpMethod]] = frozenset({"POST"})
#: Distinct (endpoint, method) verdicts remembered per target, for endpoints of at most
#: _MAX_REMEMBERED_PATH characters: at most ~0.4 MB per target whatever agents send.
_MAX_VERDICTS: Final = 1024
_MAX_REMEMBERED_PATH: Final = 256


@dataclass(frozen=True, slots=True)
class CompiledTarget:
    """A target ready for the hot path: parsed URL, origin, matcher, header sets. An MCP
    target's ``base_url`` is its origin and its endpoint the policy's path
    (:func:`mcp_endpoint`)."""

    name: str
    spec: TargetSpec
    base_url: URL
    origin: URL
    permitted_refs: frozenset[str]
    forward_headers: frozenset[str]
    _rules: tuple[tuple[tuple[str, ...], bool, frozenset[str]], ...] = field(repr=False)
    #: Per rule: its path pattern and whether it is ``mode: shadow``; empty when no rule is.
    _shadow: tuple[tuple[str, bool], ...] = field(default=(), repr=False)
    #: Verdicts of :meth:`allows` already computed (the rules never change; bounded).
    _verdicts: dict[tuple[str, str], bool | None] = field(
        default_factory=dict, repr=False, compare=False
    )
    #: Upstream URLs already built per endpoint (:func:`gateway.policy.egress.
    #: upstream_url`: base_url and path never change; bounded as the verdicts).
    _urls: dict[str, URL] = field(default_factory=dict, repr=False, compare=False)
    #: Egress decisions already made, by (secret reference, shadow rule): both come from
    #: this target's policy, so the entries are bounded by it (:mod:`gateway.policy.egress`).
    decisions: dict[tuple[str | None, str | None], Any] = field(
        default_factory=dict, repr=False, compare=False
    )
    #: The longest one attempt may take (seconds): ``timeout_s``, or the target's
    #: ``first_byte_timeout_s`` when shorter (a silent upstream gives way to a fallback;
    #: it bounds a streamed answer's headers, a whole answer all of it).
    attempt_timeout_s: float = field(init=False, repr=False, compare=False)
    #: The key pool (``credential.refs``; empty: none), read on every call.
    key_pool: tuple[str, ...] = field(init=False, repr=False, compare=False)
    #: ``call_chain.propagate``: whether the chain's headers go out to this target.
    propagate_chain: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        first_byte = self.spec.first_byte_timeout_s
        cap = self.spec.timeout_s if first_byte is None else min(first_byte, self.spec.timeout_s)
        object.__setattr__(self, "attempt_timeout_s", cap)  # frozen: set once, here
        credential = self.spec.credential
        object.__setattr__(self, "key_pool", tuple(credential.refs) if credential else ())
        object.__setattr__(self, "propagate_chain", self.spec.call_chain.propagate)

    def allows(self, path: str, method: str) -> bool | None:
        """True if allowed, False if the path matches but not the method, None if no rule."""
        if len(path) > _MAX_REMEMBERED_PATH:
            return self._match(path, method)  # agent-chosen and long: not kept in memory
        key = (path, method)
        verdict = self._verdicts.get(key, _UNSEEN)
        if verdict is _UNSEEN:
            if len(self._verdicts) >= _MAX_VERDICTS:
                self._verdicts.clear()
            verdict = self._verdicts[key] = self._match(path, method)
        return verdict  # type: ignore[return-value]

    def known_url(self, endpoint: str) -> URL | None:
        """The upstream URL remembered for ``endpoint`` (:meth:`remember_url`), or None."""
        return self._urls.get(endpoint)

    def remember_url(self, endpoint: str, url: URL) -> None:
        """Keep ``url`` as ``endpoint``'s upstream URL (endpoints of at most 256
        characters, 1,024 per target, all dropped when full)."""
        if len(endpoint) > _MAX_REMEMBERED_PATH:
            return
        if len(self._urls) >= _MAX_VERDICTS:
            self._urls.clear()
        self._urls[endpoint] = url

    def shadow_rule(self, path: str, method: str) -> str | None:
        """The path pattern of the ``mode: shadow`` rule that alone allows ``method`` on
        ``path`` (no enforced rule does), or None: the call's "would deny"."""
        if not self._shadow:
            return None
        segments = tuple(path.strip("/").split("/")) if path.strip("/") else ()
        found = None
        for (pattern, tail, methods), (rule_path, shadow) in zip(
            self._rules, self._shadow, strict=True
        ):
            if method in methods and _segments_match(pattern, tail, segments):
                if not shadow:
                    return None
                found = found or rule_path
        return found

    def _match(self, path: str, method: str) -> bool | None:
        segments = tuple(path.strip("/").split("/")) if path.strip("/") else ()
        path_matched = False
        for pattern, tail, methods in self._rules:
            if _segments_match(pattern, tail, segments):
                if method in methods:
                    return True
                path_matched = True
        return False if path_matched else None


def _segments_match(pattern: tuple[str, ...], tail: bool, segments: tuple[str, ...]) -> bool:
    if tail:
        if len(segments) < len(pattern):
            return False
        segments = segments[: len(pattern)]
    elif len(segments) != len(pattern):
        return False
    return all(p in ("*", s) for p, s in zip(pattern, segments, strict=True))


def _compile_target(name: str, spec: TargetSpec) -> CompiledTarget:
    rules = []
    for rule in spec.endpoints or ():
        parts = tuple(p for p in rule.path.strip("/").split("/") if p)
        tail = bool(parts) and parts[-1] == "**"
        if tail:
            parts = parts[:-1]
        rules.append((parts, tail, frozenset(rule.methods)))
    if spec.database is not None:
        # Each statement is one endpoint, /NAME: GET for a read, POST for a write. The
        # DSN (no credential in it) stands for the base URL, so records name the host.
        for statement, stmt in spec.database.statements.items():
            rules.append(
                ((statement,), False, frozenset({"GET" if stmt.mode == "read" else "POST"}))
            )
    base = URL(spec.base_url or (spec.database.dsn if spec.database else ""))
    if spec.mcp is not None:
        # The MCP endpoint is base_url itself: its path becomes the one endpoint (so an
        # envelope names it, and the URL is exactly base_url), on the bare origin.
        segments = tuple(p for p in base.raw_path.split("/") if p)
        rules.append((segments, False, MCP_METHODS))
        base = base.origin()
    if spec.a2a is not None:  # the card's paths (GET) and the JSON-RPC endpoint (POST)
        rules += [(tuple(p.strip("/").split("/")), False, _GET) for p in CARD_PATHS]
        rpc = tuple(p for p in spec.a2a.rpc_path.split("/") if p)
        rules.append((rpc, False, _POST))
    return CompiledTarget(
        name=name,
        spec=spec,
        base_url=base,
        origin=base.origin(),
        permitted_refs=spec.credential.permitted_refs() if spec.credential else frozenset(),
        forward_headers=frozenset(h.lower() for h in spec.forward_headers),
        _rules=tuple(rules),
        _shadow=(
            tuple((r.path, r.mode == "shadow") for r in spec.endpoints)
            if spec.endpoints and any(r.mode == "shadow" for r in spec.endpoints)
            else ()
        ),
    )


def mcp_endpoint(target: CompiledTarget) -> str:
    """The endpoint of an MCP target: the path of its policy ``base_url`` (``/`` if none),
    percent-encoded as written."""
    return URL(target.spec.base_url or "").raw_path or "/"


@dataclass(frozen=True, slots=True)
class PolicySet:
    """The compiled policy the pipeline reads; replaced whole on reload, never mutated."""

    policy: Policy
    source: str
    targets: dict[str, CompiledTarget]
    #: SHA-256 (hex) of the policy file's text (``policy_sha256`` in audit records); of
    #: the policy's JSON for a policy that came from no file.
    sha256: str = ""

    @classmethod
    def compile(
        cls, policy: Policy, source: str = "<memory>", *, sha256: str | None = None
    ) -> PolicySet:
        if sha256 is None:
            sha256 = hashlib.sha256(policy.model_dump_json().encode()).hexdigest()
        targets = {n: _compile_target(n, t) for n, t in policy.targets.items()}
        if policy.inbound is not None and INBOUND_TARGET not in targets:
            targets[INBOUND_TARGET] = _compile_target(INBOUND_TARGET, _inbound(policy))
        return cls(policy=policy, source=source, targets=targets, sha256=sha256)


#: The target of the inbound route (``/a2a/in/{path}``): the agent's own A2A server.
INBOUND_TARGET: Final = "a2a-inbound"


def _inbound(policy: Policy) -> TargetSpec:
    """The policy's ``inbound`` as a target: any path, GET and POST, one attempt (the
    caller's sidecar retries), no breaker (it is this sidecar's own agent)."""
    assert policy.inbound is not None
    return TargetSpec.model_validate(
        {
            "base_url": policy.inbound.agent_url,
            "endpoints": [{"path": "/**", "methods": ["GET", "POST"]}],
            "timeout_s": policy.inbound.timeout_s,
            "retry": {"max_retries": 0},
            "circuit_breaker": None,
        }
    )
