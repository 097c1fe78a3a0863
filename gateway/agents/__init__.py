"""Who the agents are: :mod:`gateway.agents.identity` (who is calling, established by the
sidecar) and :mod:`gateway.agents.peers` (what the kernel says about a caller's socket)."""
