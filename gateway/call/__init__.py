"""One call's stages, shared by every API (envelope, drop-in, MCP).

* ``pipeline``: the stages in order, inside the call's deadline; one answer and one audit
  record per call, whatever happens.
* The request: ``intake`` (envelope bytes -> request) with ``fastpath`` (what the one-pass
  parsers may read), ``proxy`` (a drop-in SDK request -> request) with ``header_routes``
  (where its headers go: envelope, upstream, nowhere) and ``mcp`` (an MCP client's
  JSON-RPC -> request, the tool and argument rules, the answers read); ``outbound`` (the
  request the upstream gets).
* Around the upstream: ``idempotent`` (one upstream effect per idempotency key),
  ``spend`` (budget reservation before, settlement after), ``attempts`` (rate-limit
  admission, circuit breaker, send, retry) with ``statuses`` (the error a non-2xx
  answer makes) and ``retry`` (pure retry decisions);
  ``send`` (one option's request, secret, reservations and attempts) and ``failover``
  (the target, then its fallbacks, inside one deadline).
* The answer: ``bodies`` (upstream bodies -> ``data``), ``sse`` (server-sent events,
  decoded incrementally), ``stream`` (a stream judged by its own events), ``relay`` (a
  stream passed to the agent as it arrives), ``record`` (the call's context and its
  audit record), ``metrics`` (a finished call counted in the metrics).

Per-call state is data, not a bus: each stage returns a small frozen result (an intake's
``Arrival``, an API's ``Reading``, the chain's decision, the send stage's digest, price
and settlement...) and :class:`gateway.call.record.CallContext`'s own methods are the one
writer of the context (tests/test_call_state_has_one_writer.py).
"""
