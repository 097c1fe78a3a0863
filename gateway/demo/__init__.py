"""``egress-gateway demo``: ``run`` (the demo itself), ``standins`` (the local upstreams it
calls) and ``vault`` (a real OpenBao dev server for its secrets). A program of its own:
nothing else in the package imports it."""

from gateway.demo.run import run_demo

__all__ = ["run_demo"]
