"""A sidecar whose policy uses none of pricing, Redis, Vault, tracing, databases, MCP
or A2A servers does not import their libraries: each costs resident memory in every
pod. Checked in a fresh interpreter (``sys.modules`` after start-up and one call on each
route), so that no other test's imports count. A sidecar that prices its calls reads
genai-prices' rates from a small table (gateway/cost/table.py): it does not import the
library, its data or its HTTP client either.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Libraries only some policies use (pricing, cluster scope, Vault, tracing, database
#: targets, MCP/A2A SDKs, a console renderer and its colours on Windows).
UNUSED = ("genai_prices", "httpx2", "redis", "hvac", "opentelemetry", "rich", "asyncpg",
          "psycopg", "aiomysql", "mcp", "a2a", "colorama", "ctypes")  # fmt: skip
#: What a priced call must not load: the price library, its data, its update client.
PRICE_LIBRARY = ("genai_prices", "httpx2", "httpx")

SCRIPT = """
import asyncio, io, json, sys
from aiohttp import ClientSession, web
from gateway.policy import PolicySet
from gateway.policy.loader import parse_policy
from gateway.server.app import create_app
from gateway.server.runtime import Gateway

async def ok(request):
    return web.json_response({"ok": True, "model": "gpt-4o-mini",
                              "usage": {"prompt_tokens": 10, "completion_tokens": 5,
                                        "total_tokens": 15}})

async def main():
    up = web.AppRunner(web.Application())
    up.app.router.add_post("/x", ok)
    up.app.router.add_post("/v1/chat/completions", ok)
    await up.setup()
    await web.TCPSite(up, "127.0.0.1", 0).start()
    port = up.addresses[0][1]
    target = {"base_url": f"http://127.0.0.1:{port}",
              "endpoints": [{"path": "/x", "methods": ["POST"]}]}
    if PRICED:
        target["usage"] = "openai"
        target["endpoints"] = [{"path": "/v1/chat/completions", "methods": ["POST"]}]
    doc = {"version": 1, "agent_id": "a", "egress": {"allow_cidrs": ["127.0.0.0/8"]},
           "targets": {"t": target}}
    policy = PolicySet.compile(parse_policy(json.dumps(doc), "minimal.yaml"))
    log = io.StringIO()
    sidecar = web.AppRunner(create_app(Gateway(policy, log_stream=log)))
    await sidecar.setup()
    await web.TCPSite(sidecar, "127.0.0.1", 0).start()
    base = f"http://127.0.0.1:{sidecar.addresses[0][1]}"
    path = "/v1/chat/completions" if PRICED else "/x"
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
    env = {"trace_id": "t", "correlation_id": "c", "target_system": "t", "endpoint": path,
           "method": "POST", "parameters": body}
    statuses = []
    async with ClientSession() as client:
        async with client.post(base + "/v1/calls", json=env) as resp:
            statuses.append(resp.status)
        async with client.post(base + "/proxy/t" + path, json=body) as resp:
            statuses.append(resp.status)
    await sidecar.cleanup()
    await up.cleanup()
    records = [json.loads(line) for line in log.getvalue().splitlines() if line.startswith("{")]
    costs = [(r.get("cost_usd"), r.get("cost_source")) for r in records
             if r.get("event") == "egress_call"]
    from gateway.policy.stores import StrictModel
    def models(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from models(sub)
    built = sorted(m.__name__ for m in models(StrictModel) if m.__pydantic_complete__)
    print(json.dumps({"statuses": statuses, "costs": costs, "built": built,
                      "modules": sorted(sys.modules)}))

asyncio.run(main())
"""


def _run(*, priced: bool, env: dict[str, str]) -> dict[str, Any]:
    script = f"PRICED = {priced}\n" + SCRIPT
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
        cwd=ROOT, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["statuses"] == [200, 200]  # both routes served a call
    return out


def test_a_minimal_policy_s_sidecar_does_not_import_unused_libraries() -> None:
    out = _run(priced=False, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out["costs"] == [[None, None], [None, None]]  # nothing priced
    loaded = {name.split(".")[0] for name in out["modules"]}
    assert "aiohttp" in loaded
    assert "gateway" in loaded
    assert sorted(loaded & set(UNUSED)) == []
    # The policy's models compile one validator, the policy's (and those of the sections
    # whose defaults are instances): not one per section model.
    assert "Policy" in out["built"]
    assert not {"TargetSpec", "EndpointRule", "McpSpec", "A2aSpec", "BudgetSpec"} & set(
        out["built"]
    )


def test_a_priced_call_does_not_import_the_price_library(tmp_path: Path) -> None:
    pytest.importorskip("genai_prices")
    # A fresh cache: the table is read from genai-prices in a child process, then kept.
    env = dict(os.environ, PYTHONPATH=str(ROOT), XDG_CACHE_HOME=str(tmp_path))
    for _ in range(2):  # the table extracted, then read from the cache
        out = _run(priced=True, env=env)
        assert len(out["costs"]) == 2
        for usd, source in out["costs"]:  # both calls priced from the library's rates
            assert source == "genai-prices"
            assert usd > 0
        loaded = {name.split(".")[0] for name in out["modules"]}
        assert "gateway" in loaded
        assert sorted(loaded & set(PRICE_LIBRARY)) == []
