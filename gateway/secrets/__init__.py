"""Secret references and their resolvers (``vault://``, ``env://``, ``file://``)."""

from gateway.policy.refs import InvalidSecretRef, SecretRef, parse_ref
from gateway.secrets.base import ResolvedSecret, Secret, SecretResolver, SecretResolvers

__all__ = [
    "InvalidSecretRef",
    "ResolvedSecret",
    "Secret",
    "SecretRef",
    "SecretResolver",
    "SecretResolvers",
    "parse_ref",
]
