"""The OpenAI SDK, unchanged but for its ``base_url``, through the egress sidecar.

    .venv/bin/python examples/sdk_openai.py                  # against the demo's stand-ins
    .venv/bin/python examples/sdk_openai.py --sidecar http://127.0.0.1:8181   # your sidecar

Without ``--sidecar`` it starts what ``make demo`` starts (the stand-in APIs of
``gateway/demo/standins.py`` and a sidecar with ``policies/demo.yaml``, the OpenAI key
from ``env://DEMO_OPENAI_KEY`` instead of the demo's Vault) on free loopback ports, then
makes three calls with the SDK: a chat completion, the same streamed, and one the policy
refuses, which raises the SDK's own ``PermissionDeniedError``. The agent holds no key:
``api_key="unused"`` never leaves the sidecar. Needs the ``openai`` package (the dev
extra has it: ``make test`` installs it; or ``pip install openai``).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import sys
from pathlib import Path

import openai
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing it

from gateway.demo.standins import DEMO_SECRETS, DEMO_UPSTREAM_PORT, stand_in_app  # noqa: E402
from gateway.demo.vault import without_vault  # noqa: E402
from gateway.policy import PolicySet, parse_policy  # noqa: E402
from gateway.server import create_app  # noqa: E402
from gateway.server.runtime import Gateway  # noqa: E402

MESSAGES = [{"role": "user", "content": "List three steps to ship a release."}]


def use_the_sdk(sidecar: str) -> None:
    """What an agent writes: the usual client, pointed at the sidecar (one line)."""
    client = openai.OpenAI(
        base_url=f"{sidecar}/proxy/openai/v1",  # instead of https://api.openai.com/v1
        api_key="unused",  # the sidecar injects the real key; this one is dropped
        max_retries=0,  # the sidecar retries (Retry-After, breaker, deadline)
    )
    answer = client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
    print(f"chat:     {answer.choices[0].message.content!r} ({answer.usage.total_tokens} tokens)")
    stream = client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    print(f"streamed: {text!r}")
    try:
        client.models.list()  # GET /v1/models: not in the policy's endpoint allowlist
    except openai.PermissionDeniedError as exc:
        code = exc.response.headers["x-egress-error-code"]
        print(f"refused:  {type(exc).__name__} {code}: {exc.message}")
    client.close()


async def with_demo_stand_ins() -> int:
    os.environ.update(DEMO_SECRETS)
    stand_ins = web.AppRunner(stand_in_app(), access_log=None)
    await stand_ins.setup()
    await web.TCPSite(stand_ins, "127.0.0.1", 0).start()
    port = stand_ins.addresses[0][1]
    text = (ROOT / "policies/demo.yaml").read_text()
    text = text.replace(f"127.0.0.1:{DEMO_UPSTREAM_PORT}", f"127.0.0.1:{port}")
    policy = PolicySet.compile(parse_policy(text, "policies/demo.yaml"), "policies/demo.yaml")
    policy = without_vault(policy, {"openai": "env://DEMO_OPENAI_KEY"})
    log = io.StringIO()
    sidecar = web.AppRunner(create_app(Gateway(policy, log_stream=log)), access_log=None)
    await sidecar.setup()
    await web.TCPSite(sidecar, "127.0.0.1", 0).start()
    url = "http://{}:{}".format(*sidecar.addresses[0][:2])
    try:
        await asyncio.to_thread(use_the_sdk, url)  # the sync SDK, beside the servers' loop
    finally:
        await sidecar.cleanup()
        await stand_ins.cleanup()
    print("\naudit records (one per call):")
    for line in log.getvalue().splitlines():
        record = json.loads(line)
        if record.get("event") == "egress_call":
            fields = ("api", "method", "endpoint", "success", "error_code", "tokens_used")
            print("  " + "  ".join(f"{k}={record[k]}" for k in fields))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sidecar", help="a running sidecar, e.g. http://127.0.0.1:8181")
    args = parser.parse_args()
    if args.sidecar:
        use_the_sdk(args.sidecar.rstrip("/"))
        return 0
    return asyncio.run(with_demo_stand_ins())


if __name__ == "__main__":
    sys.exit(main())
