"""The chain's signing keys are resolved once and kept while their secrets are unchanged
(gateway.call.chain.ChainKeys); a rotated, invalidated or broken key is resolved again
on the very next call, and signatures are HMAC-SHA256 with the key then current."""

from __future__ import annotations

import base64
import hashlib
import hmac
from pathlib import Path
from typing import Any

import pytest

from gateway.agents import chain
from gateway.call.chain import ChainKeys
from gateway.errors import SecretNotFound
from gateway.policy.refs import SecretRef, parse_ref
from gateway.secrets import ResolvedSecret, SecretResolvers
from gateway.secrets import file as file_secrets
from gateway.secrets.env import EnvResolver
from gateway.secrets.file import FileResolver

AGENTS = ("planner-01",)
DEADLINE = 1_764_612_345_678


class Counted:
    """The pipeline's resolve hook, over real resolvers, counting its resolutions."""

    def __init__(self, resolvers: SecretResolvers) -> None:
        self.resolvers = resolvers
        self.calls = 0

    async def __call__(self, ref: SecretRef, ctx: Any, deadline: float) -> ResolvedSecret:
        self.calls += 1
        return await self.resolvers.resolve(ref)


def expected(key: str) -> str:
    """RFC 2104 HMAC-SHA256 of the chain's canonical bytes, by the standard library."""
    mac = hmac.new(key.encode(), chain.canonical(AGENTS, DEADLINE), hashlib.sha256).digest()
    return "v1=" + base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


@pytest.fixture(autouse=True)
def trusted_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cache even a file written just now, as one the kubelet mounted long ago (the racy
    window is for real clocks: a rewrite below changes the file's size or inode, which
    the file's stamp tells within the same clock tick)."""
    monkeypatch.setattr(file_secrets, "RACY_S", -1.0)


def aged(path: Path, text: str) -> None:
    path.write_text(text)


def setup(tmp_path: Path) -> tuple[Path, tuple[SecretRef, ...], Counted, ChainKeys]:
    key = tmp_path / "chain-key"
    aged(key, "fleet-chain-key-0001\n")
    resolvers = SecretResolvers({"file": FileResolver()})
    return key, (parse_ref(f"file://{key}"),), Counted(resolvers), ChainKeys(resolvers)


async def test_an_unchanged_key_is_resolved_once(tmp_path: Path) -> None:
    _, refs, resolve, cache = setup(tmp_path)
    first = await cache.keys(refs, None, 0.0, resolve)  # type: ignore[arg-type]
    for _ in range(5):
        again = await cache.keys(refs, None, 0.0, resolve)  # type: ignore[arg-type]
        assert again is first
    assert resolve.calls == 1
    assert first.sign(AGENTS, DEADLINE) == expected("fleet-chain-key-0001")


async def test_a_rewritten_key_signs_the_next_call(tmp_path: Path) -> None:
    key, refs, resolve, cache = setup(tmp_path)
    first = await cache.keys(refs, None, 0.0, resolve)  # type: ignore[arg-type]
    aged(key, "fleet-chain-key-00002\n")  # rewritten in place
    rotated = await cache.keys(refs, None, 0.0, resolve)  # type: ignore[arg-type]
    assert rotated.sign(AGENTS, DEADLINE) == expected("fleet-chain-key-00002")
    assert first.sign(AGENTS, DEADLINE) == expected("fleet-chain-key-0001")
    assert resolve.calls == 2
    assert await cache.keys(refs, None, 0.0, resolve) is rotated  # type: ignore[arg-type]
    assert resolve.calls == 2


async def test_a_swapped_file_signs_the_next_call(tmp_path: Path) -> None:
    """The kubelet's rotation: a new file renamed over the old path (a new inode)."""
    key, refs, resolve, cache = setup(tmp_path)
    await cache.keys(refs, None, 0.0, resolve)  # type: ignore[arg-type]
    fresh = tmp_path / "chain-key.new"
    aged(fresh, "fleet-chain-key-0003\n")
    fresh.replace(key)
    rotated = await cache.keys(refs, None, 0.0, resolve)  # type: ignore[arg-type]
    assert rotated.sign(AGENTS, DEADLINE) == expected("fleet-chain-key-0003")


async def test_an_invalidated_key_is_resolved_again(tmp_path: Path) -> None:
    _, refs, resolve, cache = setup(tmp_path)
    first = await cache.keys(refs, None, 0.0, resolve)  # type: ignore[arg-type]
    resolve.resolvers.invalidate(refs[0])
    again = await cache.keys(refs, None, 0.0, resolve)  # type: ignore[arg-type]
    assert resolve.calls == 2
    assert again is not first
    assert again.sign(AGENTS, DEADLINE) == expected("fleet-chain-key-0001")


async def test_a_key_broken_by_a_rewrite_fails_the_next_call(tmp_path: Path) -> None:
    key, refs, resolve, cache = setup(tmp_path)
    await cache.keys(refs, None, 0.0, resolve)  # type: ignore[arg-type]
    aged(key, "fleet-chain\nkey-00004\n")  # a control character: never sent
    with pytest.raises(SecretNotFound, match="control characters"):
        await cache.keys(refs, None, 0.0, resolve)  # type: ignore[arg-type]
    with pytest.raises(SecretNotFound, match="control characters"):  # and stays refused
        await cache.keys(refs, None, 0.0, resolve)  # type: ignore[arg-type]


async def test_a_changed_variable_signs_the_next_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHAIN_KEY_NOW", "fleet-chain-key-env-1")
    resolvers = SecretResolvers({"env": EnvResolver()})
    resolve, cache = Counted(resolvers), ChainKeys(resolvers)
    refs = (parse_ref("env://CHAIN_KEY_NOW"),)
    first = await cache.keys(refs, None, 0.0, resolve)  # type: ignore[arg-type]
    assert await cache.keys(refs, None, 0.0, resolve) is first  # type: ignore[arg-type]
    assert resolve.calls == 1
    monkeypatch.setenv("CHAIN_KEY_NOW", "fleet-chain-key-env-2")
    rotated = await cache.keys(refs, None, 0.0, resolve)  # type: ignore[arg-type]
    assert resolve.calls == 2
    assert rotated.sign(AGENTS, DEADLINE) == expected("fleet-chain-key-env-2")


async def test_the_previous_key_is_kept_and_checked_too(tmp_path: Path) -> None:
    key, _, resolve, cache = setup(tmp_path)
    old = tmp_path / "chain-key-old"
    aged(old, "fleet-chain-key-0000\n")
    refs = (parse_ref(f"file://{key}"), parse_ref(f"file://{old}"))
    first = await cache.keys(refs, None, 0.0, resolve)  # type: ignore[arg-type]
    assert await cache.keys(refs, None, 0.0, resolve) is first  # type: ignore[arg-type]
    aged(old, "fleet-chain-key-09999\n")
    again = await cache.keys(refs, None, 0.0, resolve)  # type: ignore[arg-type]
    assert again is not first
    assert again.previous is not None
    assert again.previous.reveal() == "fleet-chain-key-09999"
    assert resolve.calls == 4  # both keys, twice


async def test_kept_keys_are_given_without_resolving_until_a_rewrite(tmp_path: Path) -> None:
    """The call path's synchronous look (ChainKeys.kept): the kept keys while unchanged,
    None (to be resolved) before the first resolution and after a rewrite."""
    key, refs, resolve, cache = setup(tmp_path)
    assert cache.kept(refs) is None
    first = await cache.keys(refs, None, 0.0, resolve)  # type: ignore[arg-type]
    assert cache.kept(refs) is first
    aged(key, "fleet-chain-key-00002\n")
    assert cache.kept(refs) is None
    assert resolve.calls == 1


async def test_a_resolver_registered_since_resolves_the_keys_again(tmp_path: Path) -> None:
    """The kept keys' checks are their resolvers' at the time: a resolver registered
    since (SecretResolvers.register) has the keys resolved again, through it."""
    _, refs, resolve, cache = setup(tmp_path)
    await cache.keys(refs, None, 0.0, resolve)  # type: ignore[arg-type]
    resolve.resolvers.register("file", FileResolver())
    assert cache.kept(refs) is None
    again = await cache.keys(refs, None, 0.0, resolve)  # type: ignore[arg-type]
    assert resolve.calls == 2
    assert cache.kept(refs) is again
