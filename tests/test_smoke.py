from __future__ import annotations

from aiohttp import web

from tests.conftest import compile_policy, envelope, openai_target


async def test_forwards_and_injects_credential(upstream_factory, sidecar_factory):
    async def completion(request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {
                "id": "chatcmpl-1",
                "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
            }
        )

    up = await upstream_factory(completion)
    sc = await sidecar_factory(compile_policy({"fake-openai": openai_target(up.url)}))
    status, answer = await sc.call(envelope())
    assert status == 200, answer
    assert answer["success"] is True
    assert answer["tokens_used"] == 10
    assert up.hits == 1
    assert up.seen[0].headers["Authorization"] == "Bearer sk-fake-TEST-0001-NOTREAL"
    assert up.seen[0].json()["model"] == "fake-model-1"
    [record] = sc.audit_records()
    assert record["tokens_input"] == 7
    assert "sk-fake" not in sc.log.getvalue()


async def test_audit_payload_summary_is_size_and_hash(upstream, sidecar_factory):
    import hashlib

    for payloads in ("summary", "none"):
        policy = compile_policy(
            {"fake-openai": openai_target(upstream.url)}, audit={"payloads": payloads}
        )
        sc = await sidecar_factory(policy)
        assert (await sc.call(envelope()))[0] == 200
        [record] = sc.audit_records()
        sent = upstream.seen[-1].body
        expected = hashlib.sha256(sent).hexdigest() if payloads == "summary" else None
        assert record["request_sha256"] == expected
        assert record["request_bytes"] == len(sent)
