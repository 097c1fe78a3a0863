"""One call's stages: ``intake`` (envelope bytes -> request), ``outbound`` (the request
the upstream gets), ``attempts`` (admission, breaker, send, retry) with ``retry`` (pure
retry decisions), ``bodies`` (upstream bodies -> ``data``), ``record`` (the audit record)
and ``pipeline`` (the stages in order)."""
