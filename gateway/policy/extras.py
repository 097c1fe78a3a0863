"""The optional extras a policy needs (pyproject.toml's ``[project.optional-dependencies]``):
a database target needs ``database`` (asyncpg), ``a2a.card.verify`` needs ``a2a`` (PyJWT
with cryptography), ``audit.otlp`` needs ``otel`` (the OpenTelemetry SDK and its OTLP/HTTP
exporter; tracing does not: without it the calls go untraced,
:func:`gateway.telemetry.start`). :func:`load_policy <gateway.policy.loader.load_policy>`
refuses a policy whose extra is not installed, so ``validate``, ``serve`` and a reload
name the extra to install instead of failing at start or at the first call. The image
installs every extra (requirements.lock).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from gateway.policy.root import Policy

KeyPath = tuple[str | int, ...]


def install_hint(extra: str) -> str:
    """The command that installs ``extra``: ``pip install 'egress-gateway[EXTRA]'``."""
    return f"pip install 'egress-gateway[{extra}]'"


def _asyncpg() -> None:
    importlib.import_module("asyncpg")


def _pyjwt_crypto() -> None:
    jwt = importlib.import_module("jwt")
    # PyJWT without `cryptography` has only the HMAC algorithms, none a card may use.
    if not importlib.import_module("jwt.algorithms").has_crypto:
        raise ImportError(f"PyJWT {jwt.__version__} is installed without cryptography")


def _otel_logs() -> None:
    # What gateway.audit.otlp imports: the SDK's logs and the OTLP/HTTP log exporter (the
    # SDK first: opentelemetry-api alone, which a client library may bring, is not it).
    importlib.import_module("opentelemetry.sdk")
    importlib.import_module("opentelemetry.sdk._logs")
    importlib.import_module("opentelemetry.exporter.otlp.proto.http._log_exporter")


#: extra -> (what needs it, its check: raises ImportError when it is missing).
EXTRAS: dict[str, tuple[str, Callable[[], None]]] = {
    "database": ("a database target needs asyncpg", _asyncpg),
    "a2a": ("a2a.card.verify needs PyJWT with cryptography", _pyjwt_crypto),
    "otel": ("audit.otlp needs the OpenTelemetry SDK", _otel_logs),
}


def missing_extras(policy: Policy) -> list[tuple[KeyPath, str]]:
    """(key path, message) for each use of an extra that is not installed, the message
    naming the extra to install; empty when everything the policy uses is there. Each
    extra is imported at most once (the first use that needs it)."""
    uses: list[tuple[KeyPath, str]] = []
    if policy.audit.otlp is not None:
        uses.append((("audit", "otlp"), "otel"))
    for name, target in policy.targets.items():
        if target.database is not None:
            uses.append((("targets", name, "database"), "database"))
        if target.a2a is not None and target.a2a.card.verify:
            uses.append((("targets", name, "a2a", "card", "verify"), "a2a"))
    missing: dict[str, str | None] = {}
    problems: list[tuple[KeyPath, str]] = []
    for where, extra in uses:
        if extra not in missing:
            missing[extra] = _import_error(EXTRAS[extra][1])
        error = missing[extra]
        if error is not None:
            needs = EXTRAS[extra][0]
            problems.append((where, f"{needs}, not installed ({error}): {install_hint(extra)}"))
    return problems


def _import_error(check: Callable[[], None]) -> str | None:
    try:
        check()
    except ImportError as exc:
        return " ".join(str(exc).split()) or type(exc).__name__
    return None
