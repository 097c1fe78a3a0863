"""Starter policies for real providers: ``egress-gateway init openai anthropic ...``.

Each provider's target is written once here, as the YAML a person would write (with its
comments), and needs only the key in an environment variable (``env://OPENAI_API_KEY``).
``policies/openai.yaml``, ``anthropic.yaml`` and ``gemini.yaml`` are ``starter_policy``
of one provider each (tests/test_starter_policies.py checks that they are). Endpoints and
headers follow each provider's API reference: OpenAI
https://platform.openai.com/docs/api-reference, Anthropic https://docs.anthropic.com/en/api,
Gemini https://ai.google.dev/api. Each sets ``call_chain: {propagate: false}``: a provider
is no agent of the fleet, and the chain's headers would only tell it the fleet's agent
ids (docs/features/call-chain.md, "Which targets get the chain").
"""

from __future__ import annotations

from typing import Final

from gateway.policy.compiled import PolicySet
from gateway.policy.loader import parse_policy

#: Each provider's target block (indented under ``targets:``) and the variable of its key.
PROVIDERS: Final[dict[str, tuple[str, str]]] = {
    "openai": (
        "OPENAI_API_KEY",
        """\
  openai:
    # SDK: OpenAI(base_url="http://127.0.0.1:8181/proxy/openai/v1", api_key="unused")
    base_url: https://api.openai.com
    credential:
      header: Authorization
      format: "Bearer {secret}"
      default_ref: env://OPENAI_API_KEY
    endpoints:
      - {path: /v1/chat/completions, methods: [POST]}
      - {path: /v1/responses, methods: [POST]}
      - {path: /v1/embeddings, methods: [POST]}
      - {path: /v1/models, methods: [GET]}
    usage: openai
    rate_limit_group: openai
    # A provider outside the fleet: the call chain (your agent ids) is not sent to it.
    call_chain: {propagate: false}
""",
    ),
    "anthropic": (
        "ANTHROPIC_API_KEY",
        """\
  anthropic:
    # SDK: Anthropic(base_url="http://127.0.0.1:8181/proxy/anthropic", api_key="unused")
    base_url: https://api.anthropic.com
    credential:
      header: x-api-key
      default_ref: env://ANTHROPIC_API_KEY
    endpoints:
      - {path: /v1/messages, methods: [POST]}
      - {path: /v1/messages/count_tokens, methods: [POST]}
      - {path: /v1/models, methods: [GET]}
    static_headers: {anthropic-version: "2023-06-01"}
    usage: anthropic
    rate_limit_group: anthropic
    # A provider outside the fleet: the call chain (your agent ids) is not sent to it.
    call_chain: {propagate: false}
""",
    ),
    "gemini": (
        "GEMINI_API_KEY",
        """\
  gemini:
    # SDK: genai.Client(api_key="unused",
    #                   http_options={"base_url": "http://127.0.0.1:8181/proxy/gemini"})
    base_url: https://generativelanguage.googleapis.com
    credential:
      header: x-goog-api-key
      default_ref: env://GEMINI_API_KEY
    endpoints:
      # Every model:method (generateContent, streamGenerateContent, ...); google-genai
      # calls v1 by default, older SDKs and the REST examples v1beta.
      - {path: /v1/models/*, methods: [POST]}
      - {path: /v1beta/models/*, methods: [POST]}
      - {path: /v1/models, methods: [GET]}
      - {path: /v1beta/models, methods: [GET]}
    usage: gemini
    rate_limit_group: gemini
    # A provider outside the fleet: the call chain (your agent ids) is not sent to it.
    call_chain: {propagate: false}
""",
    ),
}

#: A rate-limit group per provider: well under every paid tier's limit, so a runaway agent
#: is slowed before the provider's own 429s start. Raise it to your account's limits.
_GROUP: Final = "  {name}: {{requests_per_second: 5, burst: 10, max_queue_s: 10}}\n"


class UnknownProvider(ValueError):
    """A provider ``init`` has no starter for; the message lists the known ones."""


def starter_policy(providers: list[str], agent_id: str = "my-agent") -> str:
    """The YAML text of a policy with one target per named provider (in the order given,
    each once), validated before it is returned.

    Raises UnknownProvider for a name not in PROVIDERS, and PolicyError if the text
    does not load (a bug here, never the user's)."""
    names = list(dict.fromkeys(providers))
    unknown = [n for n in names if n not in PROVIDERS]
    if unknown or not names:
        known = ", ".join(PROVIDERS)
        shown = ", ".join(unknown) or "none given"
        raise UnknownProvider(f"unknown provider: {shown} (known: {known})")
    variables = " ".join(f"{PROVIDERS[n][0]}=..." for n in names)
    text = (
        f"# A starter policy for {', '.join(names)} (egress-gateway init {' '.join(names)}).\n"
        f"# Run:  export {variables}\n"
        "#       egress-gateway serve --policy THIS_FILE\n"
        "# Every key: docs/reference/policy.md. Check edits with: egress-gateway validate FILE\n"
        "version: 1\n"
        f"agent_id: {agent_id}\n"
        "\n"
        "targets:\n"
        + "\n".join(PROVIDERS[n][1] for n in names)
        + "\nrate_limit_groups:\n"
        + "".join(_GROUP.format(name=n) for n in names)
    )
    PolicySet.compile(parse_policy(text, "<starter>"), "<starter>")
    return text
