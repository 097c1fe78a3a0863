"""The operator's console and commands: ``egress-gateway approvals``, ``dead-letters`` and
``console`` (docs/features/approvals.md and docs/console.md)."""
