"""A sidecar whose policy uses none of pricing, Redis, Vault, tracing, databases, MCP
or A2A servers does not import their libraries: each costs resident memory in every
pod. Checked in a fresh interpreter (``sys.modules`` after start-up and one call on each
route), so that no other test's imports count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Libraries only some policies use (pricing, cluster scope, Vault, tracing, database
#: targets, MCP/A2A SDKs, a console renderer).
UNUSED = ("genai_prices", "httpx2", "redis", "hvac", "opentelemetry", "rich", "asyncpg",
          "psycopg", "aiomysql", "mcp", "a2a")  # fmt: skip

SCRIPT = """
import asyncio, io, json, sys
from aiohttp import ClientSession, web
from gateway.policy import PolicySet
from gateway.policy.loader import parse_policy
from gateway.server.app import create_app
from gateway.server.runtime import Gateway

async def ok(request):
    return web.json_response({"ok": True})

async def main():
    up = web.AppRunner(web.Application())
    up.app.router.add_post("/x", ok)
    await up.setup()
    await web.TCPSite(up, "127.0.0.1", 0).start()
    port = up.addresses[0][1]
    doc = {"version": 1, "agent_id": "a", "egress": {"allow_cidrs": ["127.0.0.0/8"]},
           "targets": {"t": {"base_url": f"http://127.0.0.1:{port}",
                             "endpoints": [{"path": "/x", "methods": ["POST"]}]}}}
    policy = PolicySet.compile(parse_policy(json.dumps(doc), "minimal.yaml"))
    sidecar = web.AppRunner(create_app(Gateway(policy, log_stream=io.StringIO())))
    await sidecar.setup()
    await web.TCPSite(sidecar, "127.0.0.1", 0).start()
    base = f"http://127.0.0.1:{sidecar.addresses[0][1]}"
    env = {"trace_id": "t", "correlation_id": "c", "target_system": "t", "endpoint": "/x",
           "method": "POST", "parameters": {}}
    statuses = []
    async with ClientSession() as client:
        async with client.post(base + "/v1/calls", json=env) as resp:
            statuses.append(resp.status)
        async with client.post(base + "/proxy/t/x", json={}) as resp:
            statuses.append(resp.status)
    await sidecar.cleanup()
    await up.cleanup()
    print(json.dumps({"statuses": statuses, "modules": sorted(sys.modules)}))

asyncio.run(main())
"""


def test_a_minimal_policy_s_sidecar_does_not_import_unused_libraries() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300,
        cwd=ROOT, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["statuses"] == [200, 200]  # both routes served a call
    loaded = {name.split(".")[0] for name in out["modules"]}
    assert "aiohttp" in loaded
    assert "gateway" in loaded
    assert sorted(loaded & set(UNUSED)) == []
