"""Governing the agent: who calls (:mod:`gateway.agents.identity`, established by the
sidecar; :mod:`gateway.agents.peers`, what the kernel says about a caller's socket;
:mod:`gateway.agents.registry`, the policy's agents with their tokens read) and the
call chain of agents calling agents (:mod:`gateway.agents.chain`), and the operator's
controls (:mod:`gateway.agents.controls`: stop switch, repeated calls, tool caps)."""
