"""The connector's resolver with the SSRF guard: every address a host name resolves to
is checked against the policy's ``egress`` block before any connection is opened."""

from __future__ import annotations

import socket

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

from gateway.errors import EgressDenied
from gateway.policy import EgressSpec
from gateway.policy.egress import check_address

#: A DNS resolver for the connector (tests give one that maps names to loopback).
Resolver = AbstractResolver


class _AddressDenied(OSError):
    """Raised inside the resolver; aiohttp wraps OSErrors, we unwrap it again."""

    def __init__(self, denied: EgressDenied) -> None:
        super().__init__(denied.message)
        self.denied = denied


class EgressResolver(AbstractResolver):
    """Wraps a resolver and drops every address the egress policy does not allow.

    If nothing is left, resolution fails with EGRESS_DENIED before any connection is
    attempted (the SSRF guard: a public name pointing at 169.254.169.254 is refused).
    """

    def __init__(self, egress: EgressSpec, inner: AbstractResolver | None = None) -> None:
        self.egress = egress
        self._inner = inner or aiohttp.ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        allowed = []
        denied: EgressDenied | None = None
        for result in results:
            try:
                check_address(self.egress, host, result["host"])
            except EgressDenied as exc:
                denied = denied or exc
            else:
                allowed.append(result)
        if not allowed:
            if denied is not None:
                raise _AddressDenied(denied)
            raise OSError(f"{host} did not resolve to any address")
        return allowed

    async def close(self) -> None:
        await self._inner.close()
