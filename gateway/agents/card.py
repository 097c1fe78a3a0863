"""An A2A Agent Card: read, its JWS signature verified, and rewritten for the agent that
reaches the card's agent through its sidecar (pure, no I/O; design.md, "Agents calling
agents"). The one owner of PyJWT.

A card is a JSON object with a ``name`` and where to reach the agent: protocol 1.0's
``supportedInterfaces`` (each with a ``url``) or 0.3's ``url`` (and
``additionalInterfaces``). Signatures (A2A ``AgentCardSignature``: ``protected``,
``signature``, optional ``header``) are JWS with a detached payload: the card without its
``signatures``, empty strings, lists and objects removed, in the RFC 8785 canonical form
(the a2a-sdk's ``a2a.utils.signing``). The form here sorts keys by code point and writes
numbers as Python does, which is RFC 8785's for the integers and the keys of BMP
characters that cards hold.

PyJWT is the optional extra ``egress-gateway[a2a]``, imported only when a card is
verified. A policy file with ``card.verify`` is refused without it
(:mod:`gateway.policy.extras`); a policy compiled without that check has a card to verify
refused (``card_verify_unavailable``).
"""

from __future__ import annotations

import base64
import json
from types import ModuleType
from typing import Any

from gateway.errors import PermissionDenied


def check(
    body: bytes, *, verify: bool, key: str | None, algorithms: tuple[str, ...]
) -> dict[str, Any]:
    """The card in ``body``, parsed; with ``verify``, at least one of its signatures must
    verify with ``key`` (PEM or JWK JSON) under one of ``algorithms``. Raises
    PermissionDenied (``details.reason``: ``card_invalid``, ``card_unsigned``,
    ``card_signature_invalid``): the card is not used and nothing goes to the agent."""
    try:
        card = json.loads(body)
    except (ValueError, RecursionError):
        card = None
    if not isinstance(card, dict) or not isinstance(card.get("name"), str) or not _urls(card):
        raise PermissionDenied(
            "the agent's card is not an A2A Agent Card (a JSON object with a name and a "
            "url or supportedInterfaces)",
            details={"reason": "card_invalid"},
        )
    if verify:
        _verify(card, key, algorithms)
    return card


def _urls(card: dict[str, Any]) -> list[str]:
    found = [card["url"]] if isinstance(card.get("url"), str) else []
    for key in ("supportedInterfaces", "additionalInterfaces"):
        for item in card.get(key) or []:
            if isinstance(item, dict) and isinstance(item.get("url"), str):
                found.append(item["url"])
    return found


def canonical(card: dict[str, Any]) -> bytes:
    """The signed bytes of ``card`` (module docstring)."""
    cleaned = _clean({k: v for k, v in card.items() if k != "signatures"}) or {}
    return json.dumps(cleaned, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()


def _clean(value: Any, depth: int = 0) -> Any:
    if depth > 128:
        raise PermissionDenied(
            "the agent's card nests too deep", details={"reason": "card_invalid"}
        )
    if isinstance(value, dict):
        out = {k: c for k, v in value.items() if (c := _clean(v, depth + 1)) is not None}
        return out or None
    if isinstance(value, list):
        items = [c for v in value if (c := _clean(v, depth + 1)) is not None]
        return items or None
    return None if value == "" else value


def _verify(card: dict[str, Any], key: str | None, algorithms: tuple[str, ...]) -> None:
    signatures = card.get("signatures")
    if not isinstance(signatures, list) or not signatures:
        raise PermissionDenied(
            "the agent's card is not signed, and a2a.card.verify asks for a signature",
            details={"reason": "card_unsigned"},
        )
    jwt = _jwt()
    payload = base64.urlsafe_b64encode(canonical(card)).rstrip(b"=").decode()
    for signature in signatures:
        if not isinstance(signature, dict):
            continue
        protected, sig = signature.get("protected"), signature.get("signature")
        if not isinstance(protected, str) or not isinstance(sig, str) or key is None:
            continue
        try:
            jwt.api_jws.decode_complete(
                f"{protected}.{payload}.{sig}", key=_key(jwt, key), algorithms=list(algorithms)
            )
        except (jwt.PyJWTError, ValueError, TypeError):
            continue
        return
    raise PermissionDenied(
        "no signature of the agent's card verifies with a2a.card.public_key_ref",
        details={"reason": "card_signature_invalid"},
    )


def _jwt() -> ModuleType:
    """PyJWT, or the refusal of a card that cannot be verified without it."""
    try:
        import jwt
    except ImportError:
        raise PermissionDenied(
            "a2a.card.verify needs PyJWT: pip install 'egress-gateway[a2a]'",
            details={"reason": "card_verify_unavailable"},
        ) from None
    return jwt


def _key(jwt: ModuleType, text: str) -> Any:
    """A PEM public key as is; a JWK (JSON) as PyJWT's key object."""
    stripped = text.strip()
    if stripped.startswith("{"):
        return jwt.PyJWK.from_json(stripped).key
    return stripped


def served(card: dict[str, Any], url: str) -> dict[str, Any]:
    """``card`` as the sidecar serves it to its agent: every interface's ``url`` (and
    0.3's ``url``) is ``url``, the sidecar's route, so that the agent's A2A client calls
    the agent through it; the signatures are left out (they cover the upstream's URLs;
    the sidecar checked them)."""
    out = {k: v for k, v in card.items() if k != "signatures"}
    if isinstance(out.get("url"), str):
        out["url"] = url
    for key in ("supportedInterfaces", "additionalInterfaces"):
        items = out.get(key)
        if isinstance(items, list):
            out[key] = [
                {**item, "url": url} if isinstance(item, dict) and "url" in item else item
                for item in items
            ]
    return out


def rebased(card: dict[str, Any], base: str, url: str) -> dict[str, Any]:
    """``card`` as the inbound route serves it: every interface ``url`` under ``base``
    (the agent's own URL) moved under ``url`` (the route), the rest of its path kept, so
    that a client that read the card calls the agent through its sidecar; its
    signatures are left out (they cover the agent's own URLs)."""
    base = base.rstrip("/")

    def moved(value: Any) -> Any:
        if isinstance(value, str) and (value == base or value.startswith(base + "/")):
            return url.rstrip("/") + (value[len(base) :] or "/")
        return value

    out = {k: v for k, v in card.items() if k != "signatures"}
    out["url"] = moved(out.get("url")) if "url" in out else None
    if out["url"] is None:
        del out["url"]
    for key in ("supportedInterfaces", "additionalInterfaces"):
        items = out.get(key)
        if isinstance(items, list):
            out[key] = [
                {**item, "url": moved(item.get("url"))} if isinstance(item, dict) else item
                for item in items
            ]
    return out
