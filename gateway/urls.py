"""The URL type: yarl's (aiohttp's own), owned here so that the policy, the egress decision
and the outbound client parse, join and compare URLs in exactly the same way.

yarl follows RFC 3986 (and the WHATWG URL rules aiohttp relies on); ``URL.origin()`` is
``scheme://host[:port]``, what the egress rules compare.
"""

from yarl import URL

__all__ = ["URL"]
