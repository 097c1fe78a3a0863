"""Builds the process's :class:`SecretResolvers` from the policy.

Kept out of ``gateway/secrets/__init__.py`` on purpose: :mod:`gateway.policy` imports
``gateway.secrets.refs``, so the package must not import the policy (or hvac) itself.
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.policy import Policy
from gateway.secrets.base import SecretResolver, SecretResolvers
from gateway.secrets.env import EnvResolver
from gateway.secrets.file import FileResolver
from gateway.secrets.vault import VaultResolver


def build_secret_resolvers(
    policy: Policy, *, environ: Mapping[str, str] | None = None
) -> SecretResolvers:
    """``env://`` and ``file://`` resolvers, plus ``vault://`` when the policy has
    ``secrets.vault``. Nothing is contacted yet: call :func:`start_secret_resolvers`.

    ``environ`` (default ``os.environ``) supplies the ``VAULT_*`` variables. Raises
    ValueError when the Vault section names no usable credential source.
    """
    resolvers: dict[str, SecretResolver] = {"env": EnvResolver(), "file": FileResolver()}
    if policy.secrets.vault is not None:
        resolvers["vault"] = VaultResolver(policy.secrets.vault, environ=environ)
    return SecretResolvers(resolvers)


async def start_secret_resolvers(resolvers: SecretResolvers) -> None:
    """Log in to Vault and start its token renewer, if a Vault resolver is registered.
    Does not raise when Vault is down: :func:`secrets_ready` reports it."""
    vault = resolvers.get("vault")
    if isinstance(vault, VaultResolver):
        await vault.start()


def secrets_ready(resolvers: SecretResolvers) -> bool:
    """For ``/readyz``: False while a configured Vault resolver holds no valid token."""
    vault = resolvers.get("vault")
    return not isinstance(vault, VaultResolver) or vault.ready()
