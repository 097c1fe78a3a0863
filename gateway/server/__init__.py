"""The running sidecar: ``app`` (aiohttp.web routes and listeners), ``runtime`` (its
resources and their lifecycle), ``components`` (the parts the policy drives, in the one
list start and reload follow), ``reload`` (the policy file watcher) and ``eventloop``
(uvloop or asyncio)."""

from gateway.server.app import create_app, create_ops_app, serve
from gateway.server.runtime import Gateway

__all__ = ["Gateway", "create_app", "create_ops_app", "serve"]
