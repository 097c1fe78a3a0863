"""The audit query tool: read, filter, summarise and verify audit logs (JSON lines).

``reader`` streams records (files, stdin, gzip), ``filters`` selects them, ``summary``
computes per-agent and per-target figures, ``render`` prints tables and timelines,
``verify`` checks the hash chain, ``cli`` is the ``egress-gateway audit`` command.
"""
