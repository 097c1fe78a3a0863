"""The ``validate`` command: check policy files, print every problem (``FILE:LINE: key:
problem``, exit 1) and what this environment lacks for them as warnings (exit 0): an
``env://`` variable unset here, a Vault login the environment cannot make
(:func:`vault_problem`, which ``serve`` checks before it starts too), local budgets
spread over replicas, fallbacks, tool caps, model globs and chain propagation that
likely do not do what was meant; ``--check-database`` prepares each statement against
its live database. Outside :mod:`gateway.policy`, whose package this module imports only
when the command runs: every other command starts without it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.policy import PolicySet


def register(sub: Any) -> None:
    """Add ``validate`` to the sub-command parser."""
    p = sub.add_parser("validate", help="check policy files; print every error")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument(
        "--no-env-check",
        dest="env_check",
        action="store_false",
        help="do not warn about env:// references whose variable is not set here",
    )
    p.add_argument(
        "--check-database",
        action="store_true",
        help="prepare each database statement against its live database (with the "
        "policy's credentials: Vault or secret references)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="replicas of the agent's Deployment, when known: warn about local budgets",
    )
    p.set_defaults(func=_cmd_validate)


def vault_problem(policy: PolicySet) -> str | None:
    """What keeps the policy's ``secrets.vault`` from logging in with this environment
    (no ``VAULT_TOKEN`` nor ``auth.token_file`` for the token method, no role id for
    AppRole, a ``VAULT_SKIP_VERIFY`` that is not a boolean), or None: the check the
    sidecar makes when it starts (:meth:`gateway.secrets.vault_auth.VaultSettings.from_spec`)."""
    spec = policy.policy.secrets.vault
    if spec is None:
        return None
    from gateway.secrets.vault_auth import VaultSettings

    try:
        VaultSettings.from_spec(spec, os.environ)
    except ValueError as exc:
        return str(exc)
    return None


def _env_warnings(path: str, policy: PolicySet) -> list[str]:
    """One ``FILE:LINE: key.path: warning: ...`` line per env:// reference (a target's
    ``default_ref`` or ``allowed_refs``) whose variable is unset or empty here, where the
    sidecar would answer SECRET_NOT_FOUND. LINE is the first line (not a comment) that
    holds the ref."""
    from gateway.policy.refs import parse_ref

    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeError):
        lines = []
    warnings = []
    for name, target in policy.targets.items():
        credential = target.spec.credential
        if credential is None:
            continue
        keyed = [("default_ref", credential.default_ref)] + [
            (f"allowed_refs.{i}", ref) for i, ref in enumerate(credential.allowed_refs)
        ]
        for key, raw in keyed:
            if raw is None:
                continue
            ref = parse_ref(raw)
            if ref.scheme != "env" or os.environ.get(ref.path, "").strip("\r\n"):
                continue
            line = next(
                (n for n, t in enumerate(lines, 1) if raw in t and not t.lstrip().startswith("#")),
                1,
            )
            state = "empty" if ref.path in os.environ else "not set"
            warnings.append(
                f"{path}:{line}: targets.{name}.credential.{key}: warning: {raw}: "
                f"{ref.path} is {state} in this environment; the sidecar answers "
                "SECRET_NOT_FOUND until its environment has it (--no-env-check: skip)"
            )
    return warnings


def _replica_warnings(path: str, policy: PolicySet, replicas: int | None) -> list[str]:
    """One warning per ``scope: local`` budget when ``replicas`` (``--replicas``, what the
    chart knows of the agent's Deployment) is more than one: each replica counts alone,
    so together they may spend ``replicas`` times the limit."""
    if not replicas or replicas < 2:
        return []
    return [
        f"{path}: budgets.{name}.scope: warning: local budget with {replicas} replicas: each "
        f"counts alone, so together they may spend {replicas} x {spec.limit_usd:g} USD; use "
        "scope: cluster (Redis) to share one limit"
        for name, spec in policy.policy.budgets.items()
        if spec.scope == "local" and spec.limit_usd is not None  # max_calls only: no USD
    ]


def _model_warnings(policy: PolicySet) -> list[tuple[tuple[str, ...], str]]:
    """``models.allow`` globs that match no model with a price (likely a typo)."""
    from gateway.cost import priced_models
    from gateway.policy.modelrules import model_warnings

    spec = policy.policy
    return model_warnings(spec.targets, spec.agents, lambda u: priced_models(spec.prices, u))


def _cmd_validate(args: argparse.Namespace) -> int:
    from gateway.policy import PolicyError, load_policy
    from gateway.policy.chain import propagation_warnings
    from gateway.policy.controls import tool_cap_warnings
    from gateway.policy.failover import fallback_warnings

    failed = False
    for path in args.files:
        try:
            policy = load_policy(path)
        except PolicyError as exc:
            failed = True
            for problem in exc.problems:
                print(problem, file=sys.stderr)
        except Exception as exc:  # noqa: BLE001 - a bug in the checks: still no traceback
            failed = True
            detail = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
            print(
                f"{path}:1: (top level): internal error while checking the policy "
                f"({detail}); please report it",
                file=sys.stderr,
            )
        else:
            if args.check_database and _database_problems(path, policy):
                failed = True
                continue
            print(f"{path}: ok ({len(policy.targets)} targets, agent_id {policy.policy.agent_id})")
            if args.env_check:
                for warning in _env_warnings(path, policy):
                    print(warning, file=sys.stderr)
                vault = vault_problem(policy)
                if vault is not None:
                    print(f"{path}: warning: {vault}", file=sys.stderr)
            for loc, message in fallback_warnings(policy.policy.targets):
                key = ".".join(map(str, loc))
                print(f"{path}: {key}: warning: {message}", file=sys.stderr)
            for warning in _replica_warnings(path, policy, args.replicas):
                print(warning, file=sys.stderr)
            for loc, message in [
                *tool_cap_warnings(policy.policy),
                *_model_warnings(policy),
                *propagation_warnings(policy.policy.targets),
            ]:
                print(f"{path}: {'.'.join(loc)}: warning: {message}", file=sys.stderr)
    return 1 if failed else 0


def _database_problems(path: str, policy: PolicySet) -> bool:
    """``validate --check-database``: prepare each statement of ``policy`` against its
    live database; print each problem as ``FILE:LINE: key: problem``. True if any."""
    from gateway.database.registry import check_statements
    from gateway.policy.loader import problem_lines

    try:
        problems = asyncio.run(check_statements(policy))
    except ValueError as exc:  # no engine installed, no Vault section...
        problems = [(("targets",), str(exc))]
    for line in problem_lines(path, problems):
        print(line, file=sys.stderr)
    return bool(problems)
