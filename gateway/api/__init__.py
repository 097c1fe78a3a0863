"""The APIs the sidecar speaks, one module each behind one interface
(:class:`gateway.api.http.Exchange`), and the one answer writer they all use.

* :mod:`gateway.api.envelope`: ``POST /v1/calls``, the ExternalCallRequest envelope.
* :mod:`gateway.api.proxy`: ``ANY /proxy/{target}/{path}``, a provider SDK's own request.
* :mod:`gateway.api.mcp`: ``ANY /mcp/{target}``, an MCP client's streamable HTTP.
* :mod:`gateway.api.answers`: what an answer in the upstream's own shape carries back
  (drop-in, MCP, A2A): the upstream's headers passed back, the sidecar's ``x-egress-*``
  headers, a replayed body.
* :mod:`gateway.api.http`: the interface and the handler that drives it; reads a
  request's body within the listener's limits; the API families' routes.
* :mod:`gateway.api.writer`: writes every answer: each header value and each body byte
  scrubbed of secrets, a large answer written within a bound, a stream relayed in its
  API's framing. An API module never writes to the connection itself, so a new API
  cannot forget the scrub.
"""
