"""The circuit breaker of a provider-dialect target is per model: one failing model opens
its own breaker and refuses only its calls; the target's other models are still sent.
With fallbacks, an open breaker moves the call on at once, and the primary comes back
through its breaker's one half-open probe."""

from __future__ import annotations

from aiohttp import web

from tests.conftest import compile_policy, envelope, openai_target, wait_for


async def _by_model(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if body["model"] == "bad":
        return web.json_response({"error": {"message": "down", "type": "server_error"}}, status=503)
    return web.json_response(
        {"id": "c", "object": "chat.completion", "model": body["model"], "choices": []}
    )


def _env(model: str) -> dict:
    return envelope(
        target_system="openai",
        api_key_ref=None,
        max_retries=0,
        parameters={"model": model, "messages": []},
    )


async def test_an_open_breaker_refuses_only_its_model(upstream_factory, sidecar_factory):
    up = await upstream_factory(_by_model)
    target = openai_target(up.url, circuit_breaker={"fail_max": 2, "reset_timeout_s": 600})
    sc = await sidecar_factory(compile_policy({"openai": target}))
    for _ in range(2):
        _, body = await sc.call(_env("bad"))
        assert body["error"]["code"] == "DEPENDENCY_FAILED"
    _, body = await sc.call(_env("bad"))
    assert body["error"]["code"] == "CIRCUIT_OPEN"
    assert body["error"]["details"] == {"target": "openai", "state": "open", "model": "bad"}
    assert "for model 'bad'" in body["error"]["message"]
    assert up.hits == 2  # refused without sending
    _, body = await sc.call(_env("good"))
    assert body["success"] is True  # the target's other model is still sent
    assert up.hits == 3


async def test_an_open_breaker_moves_on_and_the_primary_comes_back_by_its_probe(
    upstream_factory, sidecar_factory
):
    healthy = False

    async def primary_handler(request: web.Request) -> web.StreamResponse:
        if not healthy:
            return web.json_response({"error": {"message": "down"}}, status=503)
        return await _by_model(request)

    primary = await upstream_factory(primary_handler)
    backup = await upstream_factory(_by_model)
    spec = openai_target(
        primary.url,
        circuit_breaker={"fail_max": 1, "reset_timeout_s": 0.2},
        fallbacks=[{"target": "backup", "model": "small"}],
    )
    sc = await sidecar_factory(
        compile_policy({"openai": spec, "backup": openai_target(backup.url)})
    )
    _, body = await sc.call(_env("good"))  # 503: the breaker opens, the fallback serves
    assert body["served_by"] == {"target": "backup", "model": "small"}
    _, body = await sc.call(_env("good"))  # open: not sent to the primary at all
    assert body["served_by"] == {"target": "backup", "model": "small"}
    assert (primary.hits, backup.hits) == (1, 2)
    [_, record] = sc.audit_records()
    assert record["tried"][0]["outcome"] == "CIRCUIT_OPEN"
    assert record["tried"][0]["attempts"] == 0
    healthy = True
    breaker = sc.gateway.pipeline.breakers.get("openai", "good")
    assert breaker is not None
    await wait_for(lambda: breaker.seconds_until_probe() == 0)
    _, body = await sc.call(_env("good"))  # the probe goes to the primary and closes it
    assert body["served_by"] == {"target": "openai", "model": "good"}
    assert (primary.hits, backup.hits) == (2, 2)
    assert breaker.state == "closed"
