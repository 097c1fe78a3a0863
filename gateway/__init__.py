"""Egress sidecar for AI agents: policy-checked, credential-injecting, audited outbound calls."""

__version__ = "0.1.0"
