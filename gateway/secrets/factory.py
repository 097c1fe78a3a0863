"""Builds the process's :class:`SecretResolvers` from the policy.

Kept out of ``gateway/secrets/__init__.py`` on purpose: :mod:`gateway.policy` imports
``gateway.policy.refs``, so the package must not import the policy (or hvac) itself.

The Vault resolver (hvac, and through it requests) is imported only when the policy has
``secrets.vault``: a sidecar without Vault does not carry it in memory (docs/performance.md).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, TypeGuard

from gateway.policy import Policy
from gateway.secrets.base import SecretResolver, SecretResolvers
from gateway.secrets.env import EnvResolver
from gateway.secrets.file import FileResolver

if TYPE_CHECKING:
    from gateway.secrets.vault import VaultResolver

_VAULT_MODULE = "gateway.secrets.vault"


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
        from gateway.secrets.vault import VaultResolver

        resolvers["vault"] = VaultResolver(policy.secrets.vault, environ=environ)
    return SecretResolvers(resolvers)


async def start_secret_resolvers(resolvers: SecretResolvers) -> None:
    """Log in to Vault and start its token renewer, if a Vault resolver is registered.
    Does not raise when Vault is down: :func:`secrets_ready` reports it."""
    vault = resolvers.get("vault")
    if _is_vault(vault):
        await vault.start()


def secrets_ready(resolvers: SecretResolvers) -> bool:
    """For ``/readyz``: False while a configured Vault resolver holds no valid token."""
    vault = resolvers.get("vault")
    return not _is_vault(vault) or vault.ready()


def _is_vault(resolver: SecretResolver | None) -> TypeGuard[VaultResolver]:
    # No VaultResolver can exist unless its module was imported.
    module = sys.modules.get(_VAULT_MODULE)
    return module is not None and isinstance(resolver, module.VaultResolver)
