"""Governing the agent: who calls (identity) and the call chain of agents calling agents."""
