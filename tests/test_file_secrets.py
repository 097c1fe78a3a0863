"""file:// secrets: checked at each call, read again only when the file changed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway.errors import SecretNotFound
from gateway.policy.refs import SecretRef, parse_ref
from gateway.secrets import ResolvedSecret
from gateway.secrets import file as file_secrets
from gateway.secrets.file import FileResolver


@pytest.fixture
def trusted_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cache even a file written just now (the racy window is for real clocks)."""
    monkeypatch.setattr(file_secrets, "RACY_S", -1.0)


async def test_unchanged_file_is_served_from_the_cache(
    tmp_path: Path, trusted_at_once: None
) -> None:
    key = tmp_path / "key"
    key.write_text("sk-first-value-0001\n")
    resolver = FileResolver()
    first = await resolver.resolve(parse_ref(f"file://{key}"))
    again = await resolver.resolve(parse_ref(f"file://{key}"))
    assert first.secret.reveal() == "sk-first-value-0001"
    assert again is first
    assert not first.from_cache  # a checked read: a 401 is not a reason to read again


async def test_rewritten_file_is_read_again(tmp_path: Path, trusted_at_once: None) -> None:
    key = tmp_path / "key"
    key.write_text("sk-first-value-0001\n")
    resolver = FileResolver()
    ref = parse_ref(f"file://{key}")
    await resolver.resolve(ref)
    key.write_text("sk-second-value-00002\n")
    assert (await resolver.resolve(ref)).secret.reveal() == "sk-second-value-00002"
    # Same size, timestamps forced apart as a later tick would set them.
    key.write_text("sk-third-value-000003\n")
    st = key.stat()
    os.utime(key, ns=(st.st_atime_ns, st.st_mtime_ns + 10_000_000))
    assert (await resolver.resolve(ref)).secret.reveal() == "sk-third-value-000003"


async def test_symlink_swap_is_picked_up(tmp_path: Path, trusted_at_once: None) -> None:
    # What the kubelet does to a mounted Secret: a new file, then an atomic rename.
    (tmp_path / "v1").write_text("sk-version-one-0001")
    (tmp_path / "v2").write_text("sk-version-two-0002")
    link = tmp_path / "key"
    link.symlink_to(tmp_path / "v1")
    resolver = FileResolver()
    ref = parse_ref(f"file://{link}")
    assert (await resolver.resolve(ref)).secret.reveal() == "sk-version-one-0001"
    tmp = tmp_path / "key.tmp"
    tmp.symlink_to(tmp_path / "v2")
    tmp.rename(link)
    assert (await resolver.resolve(ref)).secret.reveal() == "sk-version-two-0002"


async def test_deleted_file_is_not_served_from_the_cache(
    tmp_path: Path, trusted_at_once: None
) -> None:
    key = tmp_path / "key"
    key.write_text("sk-first-value-0001")
    resolver = FileResolver()
    ref = parse_ref(f"file://{key}")
    await resolver.resolve(ref)
    key.unlink()
    with pytest.raises(SecretNotFound, match="does not exist"):
        await resolver.resolve(ref)


async def test_a_file_changed_just_now_is_not_trusted_to_the_cache(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("sk-first-value-0001")
    resolver = FileResolver()
    ref = parse_ref(f"file://{key}")
    first = await resolver.resolve(ref)
    assert (await resolver.resolve(ref)) is not first
    # A same-size rewrite within the same clock tick still shows.
    key.write_text("sk-other-value-0002")
    assert (await resolver.resolve(ref)).secret.reveal() == "sk-other-value-0002"


def test_only_local_resolvers_skip_the_deadline_timer() -> None:
    from gateway.secrets import SecretResolvers
    from gateway.secrets.env import EnvResolver

    class Remote:  # a resolver that waits on a network: no `local` attribute
        async def resolve(self, ref: SecretRef) -> ResolvedSecret:
            raise NotImplementedError

        def invalidate(self, ref: SecretRef) -> None: ...

        async def aclose(self) -> None: ...

    resolvers = SecretResolvers({"file": FileResolver(), "env": EnvResolver(), "x": Remote()})
    assert resolvers.is_local("file")
    assert resolvers.is_local("env")
    assert not resolvers.is_local("x")
    assert not resolvers.is_local("vault")  # not registered
