"""Secret references and their resolvers (``vault://``, ``env://``, ``file://``)."""

from gateway.secrets.base import ResolvedSecret, Secret, SecretResolver, SecretResolvers
from gateway.secrets.refs import InvalidSecretRef, SecretRef, parse_ref

__all__ = [
    "InvalidSecretRef",
    "ResolvedSecret",
    "Secret",
    "SecretRef",
    "SecretResolver",
    "SecretResolvers",
    "parse_ref",
]
