"""The Agent Card of an A2A target: fetched through the sidecar, its JWS signature
verified when the policy asks (signed with the a2a-sdk's own signer), served to the
agent with its URLs pointing at the sidecar; a card that does not parse, is unsigned or
whose signature fails is refused, audited, and the agent's requests are not forwarded."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from a2a.utils.signing import create_agent_card_signer
from aiohttp import web
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from jwt.algorithms import ECAlgorithm

from tests.a2a_agents import Agent, ask
from tests.conftest import FakeUpstream, Sidecar, compile_policy


def _pem_pair() -> tuple[str, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    public = (
        key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )
    return private, public


def _jwk(public_pem: str) -> str:
    key = serialization.load_pem_public_key(public_pem.encode())
    return json.dumps(json.loads(ECAlgorithm.to_jwk(key)))


SIGNER_PRIVATE, SIGNER_PUBLIC = _pem_pair()
_, OTHER_PUBLIC = _pem_pair()
SIGNER_JWK, OTHER_JWK = _jwk(SIGNER_PUBLIC), _jwk(OTHER_PUBLIC)


@pytest.fixture
async def signed_agent() -> AsyncIterator[Agent]:
    signer = create_agent_card_signer(
        SIGNER_PRIVATE, {"kid": "k1", "alg": "ES256", "jku": None, "typ": "JOSE"}
    )
    agent = Agent("b", signer=signer)
    await agent.start()
    yield agent
    await agent.stop()


def _policy(url: str, **card: Any) -> Any:
    return compile_policy(
        {"b": {"base_url": url, "a2a": {"agent_id": "b", "card": card}}}, agent_id="a"
    )


async def test_a_signed_card_is_verified_and_served_pointing_at_the_sidecar(
    signed_agent: Agent,
    sidecar_factory: Callable[..., Awaitable[Sidecar]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CARD_KEY", SIGNER_JWK)  # a JWK on one line, as a secret's value
    side = await sidecar_factory(
        _policy(signed_agent.url, verify=True, public_key_ref="env://CARD_KEY")
    )
    async with side.session.get(f"{side.url}/a2a/b/.well-known/agent-card.json") as resp:
        assert resp.status == 200, await resp.text()
        card = await resp.json()
    assert card["supportedInterfaces"][0]["url"] == f"{side.url}/a2a/b"
    assert "signatures" not in card

    events = await ask(f"{side.url}/a2a/b", "hello")

    assert events
    assert len(signed_agent.received) == 1


@pytest.mark.parametrize(
    ("card", "reason"),
    [
        ({"verify": True, "public_key": OTHER_PUBLIC}, "card_signature_invalid"),
        ({"verify": True, "public_key_ref": "env://CARD_KEY"}, "card_signature_invalid"),
    ],
    ids=["inline-pem", "jwk-ref"],
)
async def test_a_card_whose_signature_fails_refuses_the_request(
    signed_agent: Agent,
    sidecar_factory: Callable[..., Awaitable[Sidecar]],
    monkeypatch: pytest.MonkeyPatch,
    card: dict[str, Any],
    reason: str,
) -> None:
    monkeypatch.setenv("CARD_KEY", OTHER_JWK)  # not the signer's key
    side = await sidecar_factory(_policy(signed_agent.url, **card))
    body = {
        "jsonrpc": "2.0",
        "id": "r1",
        "method": "SendMessage",
        "params": {"message": {"messageId": "m1", "role": "ROLE_USER", "parts": [{"text": "x"}]}},
    }
    async with side.session.post(f"{side.url}/a2a/b", json=body) as resp:
        answer = await resp.json()
    assert answer["id"] == "r1"
    assert answer["error"]["data"]["egress_code"] == "PERMISSION_DENIED"
    assert answer["error"]["data"]["reason"] == reason
    assert signed_agent.received == []
    fetched, refused = side.audit_records()
    assert fetched["endpoint"] == "/.well-known/agent-card.json"
    assert fetched["error_code"] == "PERMISSION_DENIED"
    assert refused["a2a_method"] == "SendMessage"
    assert refused["attempts"] == 0


async def _not_a_card(_: web.Request) -> web.StreamResponse:
    return web.Response(text="<html>not a card</html>", content_type="text/html")


@pytest.mark.parametrize("verify", [False, True])
async def test_a_card_that_does_not_parse_is_refused(
    upstream_factory: Callable[..., Awaitable[FakeUpstream]],
    sidecar_factory: Callable[..., Awaitable[Sidecar]],
    monkeypatch: pytest.MonkeyPatch,
    verify: bool,
) -> None:
    up = await upstream_factory(_not_a_card)
    card = {"verify": True, "public_key": SIGNER_PUBLIC} if verify else {}
    side = await sidecar_factory(_policy(up.url, **card))
    async with side.session.get(f"{side.url}/a2a/b/.well-known/agent-card.json") as resp:
        answer = await resp.json()
    assert resp.status == 403
    assert answer["error"]["data"]["reason"] == "card_invalid"
    assert b"not a card" not in str(answer).encode()
    (record,) = side.audit_records()
    assert record["error_code"] == "PERMISSION_DENIED"
    assert up.hits == 1  # the card only: nothing else went to the agent
