"""The webhook's HTTPS endpoint (aiohttp.web): ``POST /mutate`` answers an AdmissionReview
v1 with the pod's JSON Patch, base64-encoded; ``GET /healthz`` for the kubelet.

The certificate and key are read from files (a Secret the chart or cert-manager writes)
and read again when the certificate file changes, so a renewed certificate is served
without a restart.
"""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import ssl
from pathlib import Path
from typing import Any, Final

from aiohttp import web

from gateway.inject.patch import InjectionError, injection_patch

ADMISSION_API: Final = "admission.k8s.io/v1"
#: An AdmissionReview is a pod and some metadata; the API server's own limit is 3 MiB.
MAX_REVIEW_BYTES: Final = 3 * 1024 * 1024
TEMPLATE_KEY: Final = web.AppKey("template", dict)


def admission_response(review: dict[str, Any], template: dict[str, Any]) -> dict[str, Any]:
    """The AdmissionReview v1 answer to ``review`` (the request the API server sent):
    allowed, with ``patchType: JSONPatch`` and the base64 patch when there is one to apply,
    without a patch otherwise. A pod that cannot be injected is refused (allowed false,
    code 500, the reason as message). Raises KeyError/TypeError on a review without
    ``request.uid``."""
    request = review["request"]
    response: dict[str, Any] = {"uid": request["uid"], "allowed": True}
    pod = request.get("object") or {}
    try:
        ops = injection_patch(pod, template) if request.get("kind", {}).get("kind") == "Pod" else []
    except (InjectionError, KeyError, TypeError, AttributeError) as exc:
        response.update(allowed=False, status={"code": 500, "message": f"egress-gateway: {exc}"})
        ops = []
    if ops:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(ops).encode()).decode()
    return {"apiVersion": ADMISSION_API, "kind": "AdmissionReview", "response": response}


async def _mutate(request: web.Request) -> web.Response:
    try:
        review = json.loads(await request.content.read(MAX_REVIEW_BYTES + 1))
        answer = admission_response(review, request.app[TEMPLATE_KEY])
    except (ValueError, KeyError, TypeError) as exc:
        return web.json_response({"error": f"not an AdmissionReview v1: {exc}"}, status=400)
    return web.json_response(answer)


async def _healthz(_: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def build_app(template: dict[str, Any]) -> web.Application:
    """The webhook application for one injection template (see gateway.inject.patch)."""
    app = web.Application(client_max_size=MAX_REVIEW_BYTES)
    app[TEMPLATE_KEY] = template
    app.router.add_post("/mutate", _mutate)
    app.router.add_get("/healthz", _healthz)
    return app


class ReloadingTLS:
    """A server SSLContext whose certificate follows the files: each handshake checks the
    certificate file's modification time (one stat) and loads the pair again when it
    changed. Raises OSError/ssl.SSLError at construction for an unusable pair."""

    def __init__(self, cert: str | Path, key: str | Path) -> None:
        self._cert, self._key = Path(cert), Path(key)
        self._stamp = -1
        self._current = self._load()
        #: The context the listener holds; each handshake is moved to the current pair.
        self.context = self._load()
        self.context.sni_callback = self._pick

    def _load(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self._cert, self._key)
        self._stamp = self._cert.stat().st_mtime_ns
        return context

    def _pick(self, sock: ssl.SSLObject, _name: str | None, _ctx: ssl.SSLContext) -> None:
        try:
            if self._cert.stat().st_mtime_ns != self._stamp:
                self._current = self._load()
        except (OSError, ssl.SSLError):
            pass  # a half-written renewal: keep serving the pair that worked
        sock.context = self._current


async def run(template: dict[str, Any], *, host: str, port: int, cert: str, key: str) -> None:
    """Serve the webhook on ``host:port`` over TLS until SIGTERM or SIGINT (or until
    cancelled); reviews in flight are answered before it returns (a rollout of the
    injector must not fail pod admissions, with failurePolicy Fail)."""
    runner = web.AppRunner(build_app(template), access_log=None, shutdown_timeout=10.0)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        tls = ReloadingTLS(cert, key)
        await web.TCPSite(runner, host, port, ssl_context=tls.context).start()
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await runner.cleanup()
