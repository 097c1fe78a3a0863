"""Governing the agent, not only the call: identity, the call chain, and the operator's controls."""
