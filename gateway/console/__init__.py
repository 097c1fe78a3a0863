"""The operator's console and commands: ``egress-gateway approvals``, ``dead-letters`` and
``console`` (README, "Approvals and dead letters" and "Console")."""
