"""The egress decision (pure): endpoint hygiene, allowlists, refs, URL and query building."""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest
from yarl import URL

from gateway.envelope import ExternalCallRequest
from gateway.errors import EgressDenied, PermissionDenied
from gateway.policy import CompiledTarget, EgressSpec
from gateway.policy.egress import (
    MAX_LOCATION_CHARS,
    NOT_A_REFERENCE,
    check_address,
    decide,
    endpoint_problem,
    location_problem,
    loggable_ref,
    next_hop_url,
    origin_label,
    query_items,
    resolve_location,
    same_query_name,
    upstream_url,
)
from tests.conftest import compile_policy

# --- endpoint hygiene ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "problem"),
    [
        # another scheme or host
        ("http://x", "absolute_url"),
        ("https://evil.example/v1", "absolute_url"),
        ("HTTP://evil.example", "absolute_url"),
        ("//evil.example", "empty_segment"),
        ("//evil.example/v1/chat/completions", "empty_segment"),
        ("v1/chat/completions", "not_absolute_path"),
        ("evil.example/v1", "not_absolute_path"),
        ("mailto:x", "not_absolute_path"),
        ("", "not_absolute_path"),
        ("/@evil.example", "at_sign"),
        ("/v1@evil.example/x", "at_sign"),
        # path escapes
        ("/a//b", "empty_segment"),
        ("/v1/", None),
        ("/a\\b", "backslash"),
        ("\\\\evil.example\\x", "not_absolute_path"),
        ("/..", "dot_segment"),
        ("/v1/../admin", "dot_segment"),
        ("/v1/..", "dot_segment"),
        ("/./", "dot_segment"),
        ("/v1/./models", "dot_segment"),
        ("/v1/.", "dot_segment"),
        # percent-encoded separators, dots, controls and double encoding
        ("/%2e%2e/admin", "encoded_separator"),
        ("/%2E%2E/admin", "encoded_separator"),
        ("/v1/.%2e/admin", "encoded_separator"),
        ("/v1%2Fadmin", "encoded_separator"),
        ("/v1%2fadmin", "encoded_separator"),
        ("/v1%5cadmin", "encoded_separator"),
        ("/v1%5Cadmin", "encoded_separator"),
        ("/v1%00", "encoded_separator"),
        ("/v1%0d%0aX-Injected:%201", "encoded_separator"),
        ("/v1%0A", "encoded_separator"),
        ("/v1%7f", "encoded_separator"),
        ("/v1/a%252e", "encoded_separator"),
        ("/v1/a%25", "encoded_separator"),
        # a "%" that is not an escape: sent as %25, an upstream decoding twice reads ".."
        ("/v1/models/%%32e%%32e%%32ffiles", "malformed_percent_encoding"),
        ("/v1/models/%%32e%%32e", "malformed_percent_encoding"),
        ("/v1/x%%35c", "malformed_percent_encoding"),
        ("/v1/a%2", "malformed_percent_encoding"),
        ("/v1/a%", "malformed_percent_encoding"),
        ("/v1/a%g1", "malformed_percent_encoding"),
        ("/v1/%zz", "malformed_percent_encoding"),
        # literal control characters anywhere (header / request-line injection)
        ("/v1\r\nHost: evil.example", "control_characters"),
        ("/v1\rx", "control_characters"),
        ("/v1\nx", "control_characters"),
        ("/v1\tx", "control_characters"),
        ("/v1\x00", "control_characters"),
        ("/v1\x7f", "control_characters"),
        ("\r\n/v1", "control_characters"),
        # query and fragment belong to parameters, not the endpoint
        ("/v1/models?q=1", "query_or_fragment"),
        ("/v1/models?", "query_or_fragment"),
        ("/v1/models#f", "query_or_fragment"),
        # clean paths
        ("/", None),
        ("/v1/models/gpt-4o", None),
        ("/v1/chat/completions", None),
        ("/v1beta/models/gemini-1.5-pro:generateContent", None),
        ("/api/chat.postMessage", None),
        ("/v1/ünïcode/名前", None),
        ("/v1/a%20b", None),
        ("/v1/a%C3%A9b", None),
        ("/v1/.well-known", None),
        ("/v1/...", None),
        ("/v1/a..b", None),
        ("/v1/a+b;c=d,e", None),
    ],
)
def test_endpoint_problem(endpoint: str, problem: str | None) -> None:
    assert endpoint_problem(endpoint) == problem


# --- decide -------------------------------------------------------------------------------

POLICY = compile_policy(
    {
        "openai": {
            "base_url": "https://api.openai.com",
            "credential": {
                "header": "Authorization",
                "format": "Bearer {secret}",
                "default_ref": "env://OPENAI_KEY",
                "allowed_refs": ["env://OPENAI_KEY", "env://OPENAI_KEY_2"],
            },
            "endpoints": [
                {"path": "/v1/chat/completions", "methods": ["POST"]},
                {"path": "/v1/models/*", "methods": ["GET"]},
            ],
            "forward_headers": ["X-Request-Id", "OpenAI-Beta"],
        },
        "slack": {
            "base_url": "https://slack.com",
            "credential": {
                "header": "Authorization",
                "format": "Bearer {secret}",
                "allowed_refs": ["env://SLACK_TOKEN"],
            },
            "endpoints": [{"path": "/api/chat.postMessage", "methods": ["POST"]}],
        },
        "public": {
            "base_url": "https://status.example.com",
            "endpoints": [{"path": "/v1/status", "methods": ["GET"]}],
        },
    }
)


def request(**fields: Any) -> ExternalCallRequest:
    base: dict[str, Any] = {
        "trace_id": "tr-1",
        "correlation_id": "corr-1",
        "target_system": "openai",
        "endpoint": "/v1/chat/completions",
        "method": "POST",
    }
    return ExternalCallRequest.model_validate({**base, **fields})


def denied(**fields: Any) -> PermissionDenied:
    with pytest.raises(PermissionDenied) as info:
        decide(POLICY, request(**fields))
    assert info.value.code.value == "PERMISSION_DENIED"
    assert info.value.http_status == 403
    assert info.value.retryable is False
    return info.value


def test_allowed_call_uses_the_default_ref() -> None:
    decision = decide(POLICY, request())
    assert decision.target is POLICY.targets["openai"]
    assert decision.api_key_ref == "env://OPENAI_KEY"


def test_an_allowed_ref_other_than_the_default_is_kept() -> None:
    assert decide(POLICY, request(api_key_ref="env://OPENAI_KEY_2")).api_key_ref == (
        "env://OPENAI_KEY_2"
    )


def test_a_target_without_credential_needs_no_ref() -> None:
    decision = decide(POLICY, request(target_system="public", endpoint="/v1/status", method="GET"))
    assert decision.api_key_ref is None


def test_unknown_target() -> None:
    exc = denied(target_system="github")
    assert exc.details == {"reason": "unknown_target", "target_system": "github"}
    assert exc.message == (
        "target_system 'github' is not in this sidecar's policy (known: openai, public, slack)"
    )


@pytest.mark.parametrize(
    ("endpoint", "problem"),
    [
        ("//evil.example/v1/chat/completions", "empty_segment"),
        ("https://evil.example/v1/chat/completions", "absolute_url"),
        ("/v1/chat/completions?x=1", "query_or_fragment"),
        ("/v1/%2e%2e/admin", "encoded_separator"),
        ("/v1/chat/completions\r\nX: 1", "control_characters"),
    ],
)
def test_an_unclean_endpoint_is_refused_before_the_allowlist(endpoint: str, problem: str) -> None:
    exc = denied(endpoint=endpoint)
    assert exc.details == {"reason": "endpoint_not_a_path", "problem": problem}
    assert exc.message == (
        f"endpoint must be a clean absolute path on target 'openai' "
        f"({problem.replace('_', ' ')}); the host comes from the policy only"
    )


def test_method_not_allowed_on_an_allowed_path() -> None:
    exc = denied(method="GET")
    assert exc.details == {
        "reason": "method_not_allowed",
        "method": "GET",
        "endpoint": "/v1/chat/completions",
    }
    assert exc.message == (
        "GET /v1/chat/completions is not allowed on target 'openai' "
        "by the policy's endpoint allowlist"
    )


def test_endpoint_not_allowed() -> None:
    exc = denied(endpoint="/v1/files", method="GET")
    assert exc.details == {
        "reason": "endpoint_not_allowed",
        "method": "GET",
        "endpoint": "/v1/files",
    }


def test_a_ref_outside_the_allowed_refs_is_refused() -> None:
    exc = denied(api_key_ref="env://SLACK_TOKEN")
    assert exc.details == {"reason": "ref_not_allowed", "api_key_ref": "env://SLACK_TOKEN"}
    assert exc.message == "api_key_ref 'env://SLACK_TOKEN' may not be sent to target 'openai'"


def test_a_target_without_credential_refuses_a_ref() -> None:
    exc = denied(
        target_system="public", endpoint="/v1/status", method="GET", api_key_ref="env://OPENAI_KEY"
    )
    assert exc.details == {"reason": "ref_not_allowed", "api_key_ref": "env://OPENAI_KEY"}
    assert exc.message == "target 'public' takes no credential; do not send api_key_ref"


def test_a_target_without_default_ref_needs_one() -> None:
    exc = denied(target_system="slack", endpoint="/api/chat.postMessage")
    assert exc.details == {"reason": "ref_missing"}
    assert (
        decide(
            POLICY,
            request(
                target_system="slack",
                endpoint="/api/chat.postMessage",
                api_key_ref="env://SLACK_TOKEN",
            ),
        ).api_key_ref
        == "env://SLACK_TOKEN"
    )


@pytest.mark.parametrize(
    ("target", "endpoint", "method"),
    [("openai", "/v1/chat/completions", "POST"), ("public", "/v1/status", "GET")],
)
def test_a_key_sent_as_api_key_ref_is_never_echoed(target: str, endpoint: str, method: str) -> None:
    key = "sk-proj-LEAKED-0123456789abcdef"
    exc = denied(target_system=target, endpoint=endpoint, method=method, api_key_ref=key)
    assert exc.details == {"reason": "ref_not_allowed", "api_key_ref": NOT_A_REFERENCE}
    assert key not in exc.message
    assert key not in str(exc)


@pytest.mark.parametrize(
    ("ref", "shown"),
    [
        (None, None),
        ("env://OPENAI_KEY", "env://OPENAI_KEY"),
        ("vault://agents/openai#api_key", "vault://agents/openai#api_key"),
        ("file:///var/run/secrets/key", "file:///var/run/secrets/key"),
        ("sk-proj-abc123", NOT_A_REFERENCE),
        ("Bearer sk-abc", NOT_A_REFERENCE),
        ("env://not a name", NOT_A_REFERENCE),
    ],
)
def test_loggable_ref(ref: str | None, shown: str | None) -> None:
    assert loggable_ref(ref) == shown


def test_forwarded_headers_must_be_listed_case_insensitively() -> None:
    decision = decide(
        POLICY, request(headers={"x-request-id": "r1", "OpenAI-Beta": "assistants=v2"})
    )
    assert decision.target.name == "openai"


@pytest.mark.parametrize("header", ["X-Other", "Authorization", "Host", "x-api-key"])
def test_a_header_not_listed_is_refused(header: str) -> None:
    exc = denied(headers={"X-Request-Id": "r1", header: "v"})
    assert exc.details == {"reason": "header_not_allowed", "header": header}


def test_checks_run_in_order_target_endpoint_method_ref_headers() -> None:
    # Each failure names the first broken rule, so an agent fixes one thing at a time.
    assert denied(target_system="nope", endpoint="//x").details["reason"] == "unknown_target"
    assert denied(endpoint="//x", method="GET").details["reason"] == "endpoint_not_a_path"
    assert denied(method="GET", api_key_ref="env://X").details["reason"] == "method_not_allowed"
    assert denied(api_key_ref="env://X", headers={"X": "1"}).details["reason"] == "ref_not_allowed"


# --- a query credential's name is the sidecar's alone ----------------------------------------

GEMINI = compile_policy(
    {
        "gemini": {
            "base_url": "https://generativelanguage.googleapis.com",
            "credential": {"query_param": "key", "default_ref": "env://GEMINI_KEY"},
            "endpoints": [{"path": "/v1beta/models/**", "methods": ["GET", "POST", "DELETE"]}],
        }
    }
)


def gemini_request(method: str, parameters: dict[str, Any]) -> ExternalCallRequest:
    return request(
        target_system="gemini",
        endpoint="/v1beta/models/m",
        method=method,
        parameters=parameters,
    )


@pytest.mark.parametrize(
    "name",
    [
        "key",  # exact
        "KEY",  # ASP.NET compares names without case
        "Key",
        "k%65y",  # a server that decodes the name (yarl sends it as k%2565y)
        "k%2565y",  # ... twice
        "%6B%65%79",
        "key[]",  # PHP and Rails: an array named key
        "key[0]",
        " key",  # trimmed
        "key\x00suffix",  # C parsers stop at NUL
        "\uff4b\uff45\uff59",  # fullwidth: NFKC
        "\u212aey",  # KELVIN SIGN folds to k
    ],
)
@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_a_query_parameter_named_like_the_credential_is_refused(name: str, method: str) -> None:
    with pytest.raises(PermissionDenied) as info:
        decide(GEMINI, gemini_request(method, {"alt": "json", name: "agent-value"}))
    assert info.value.details == {"reason": "credential_parameter", "parameter": name}
    assert info.value.retryable is False
    assert repr(name) in info.value.message
    assert "'key'" in info.value.message


@pytest.mark.parametrize("name", ["keys", "monkey", "api_key", "k", "ke", "key2", "k_ey"])
def test_other_names_pass(name: str) -> None:
    assert decide(GEMINI, gemini_request("GET", {name: "v"})).target.name == "gemini"


def test_a_body_parameter_of_that_name_is_not_in_the_query() -> None:
    # POST parameters are the JSON body: the query holds the credential alone.
    assert decide(GEMINI, gemini_request("POST", {"key": "v"})).target.name == "gemini"


def test_a_long_parameter_name_is_compared_and_shown_cut() -> None:
    name = "key[" + "x" * 500 + "]"
    with pytest.raises(PermissionDenied) as info:
        decide(GEMINI, gemini_request("GET", {name: "v"}))
    assert info.value.details["parameter"] == name[:64]


@pytest.mark.parametrize(
    ("name", "param", "same"),
    [
        ("api.key", "api_key", True),  # PHP reads "." and " " as "_"
        ("api key", "api_key", True),
        ("api_key", "api.key", True),
        ("API_KEY", "api_key", True),
        ("apikey", "api_key", False),
        ("key%00", "key", True),
        ("key%5B%5D", "key", True),
        ("key+", "key", True),  # "+" is a space to a second decoding, then trimmed
        ("%", "key", False),
        ("%%%", "key", False),
    ],
)
def test_same_query_name(name: str, param: str, same: bool) -> None:
    assert same_query_name(name, param) is same


# --- redirect Locations ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("location", "problem"),
    [
        ("/v1/y", None),
        ("https://api.example/v1/y?a=1#f", None),
        ("//api.example/v1/y", None),
        ("?q", None),
        ("../..", None),  # resolved, then judged by the allowlist
        ("/v1/caf\u00e9", None),  # non-ASCII is percent-encoded as UTF-8, as browsers do
        ("", "empty"),
        ("/" + "a" * MAX_LOCATION_CHARS, "too_long"),
        ("/v1/\x00", "control_characters"),
        ("/v1/\t", "control_characters"),
        ("/v1/\x9b", "control_characters"),
        ("/v1/a b", "whitespace"),
        ("/v1/a\u2028b", "whitespace"),
        ("/v1/\udcff", "not_utf8"),
        ("/\\evil.example", "backslash"),
        ("http:\\\\evil.example", "backslash"),
        ("file:///etc/passwd", "scheme"),
        ("JavaScript:alert(1)", "scheme"),
        ("data:,x", "scheme"),
        ("ftp://api.example/", "scheme"),
        ("http://u:p@api.example/", "userinfo"),
        ("//u@api.example/", "userinfo"),
        ("//@api.example/", "userinfo"),
        ("/v1/a@b", None),  # in the path, not the authority: the allowlist judges it
    ],
)
def test_location_problem(location: str, problem: str | None) -> None:
    assert location_problem(location) == problem


BASE = URL("https://api.example/v1/x?a=1")


@pytest.mark.parametrize(
    ("location", "problem"),
    [
        ("https://api.example:99999/", "invalid_url"),
        ("https://api.example:-1/", "invalid_url"),
        ("https://api.example:abc/", "invalid_url"),
        ("https://[::1/", "invalid_url"),
        ("https://[zz]/", "invalid_url"),
        ("mailto:x@y", "scheme"),
    ],
)
def test_resolve_location_refuses_what_yarl_refuses(location: str, problem: str) -> None:
    with pytest.raises(PermissionDenied) as info:
        resolve_location([location], BASE, 307)
    assert info.value.details == {"reason": "invalid_redirect_location", "problem": problem}
    assert info.value.status_code == 307
    assert location not in info.value.message  # the Location is never shown


def test_resolve_location_refuses_several_headers() -> None:
    with pytest.raises(PermissionDenied) as info:
        resolve_location(["/a", "/b"], BASE, 302)
    assert info.value.details["problem"] == "repeated"


def test_resolve_location_joins_relative_references() -> None:
    assert resolve_location(["?q"], BASE, 307) == URL("https://api.example/v1/x?q")
    assert resolve_location(["y"], BASE, 307) == URL("https://api.example/v1/y")


@pytest.mark.parametrize(
    ("location", "param", "expected"),
    [
        ("https://h/p?a=1&key=x&b=%2F#frag", "key", "https://h/p?a=1&b=%2F"),
        ("https://h/p?KEY=x&k%65y=y&key%5B%5D=z&a=1;key=w&c=3", "key", "https://h/p?c=3"),
        ("https://h/p?key=x", None, "https://h/p?key=x"),
        ("https://h/p#frag", "key", "https://h/p"),
    ],
)
def test_next_hop_url(location: str, param: str | None, expected: str) -> None:
    assert str(next_hop_url(URL(location, encoded=True), param)) == expected


# --- upstream URL ------------------------------------------------------------------------


def target_at(base_url: str) -> CompiledTarget:
    spec = {"base_url": base_url, "endpoints": [{"path": "/**", "methods": ["GET"]}]}
    egress = {"allow_cidrs": ["127.0.0.0/8", "::1/128"]}
    return compile_policy({"t": spec}, egress=egress).targets["t"]


@pytest.mark.parametrize(
    ("base_url", "endpoint", "expected"),
    [
        ("http://h:1/base", "/v1/x", "http://h:1/base/v1/x"),
        ("http://h:1/base/", "/v1/x", "http://h:1/base/v1/x"),
        ("http://h:1", "/v1/x", "http://h:1/v1/x"),
        ("http://h:1/", "/v1/x", "http://h:1/v1/x"),
        (
            "https://api.openai.com",
            "/v1/chat/completions",
            "https://api.openai.com/v1/chat/completions",
        ),
        ("http://h:1/base", "/", "http://h:1/base/"),
        # the trailing slash is forwarded as written
        ("http://h:1/base", "/v1/x/", "http://h:1/base/v1/x/"),
        # already-encoded escapes are kept, not encoded again
        ("http://h:1/base", "/v1/a%20b", "http://h:1/base/v1/a%20b"),
        ("http://h:1", "/v1/a%2Bb", "http://h:1/v1/a%2Bb"),
        # what must be encoded is
        ("http://h:1", "/v1/a b", "http://h:1/v1/a%20b"),
        ("http://h:1", "/v1/ünï", "http://h:1/v1/%C3%BCn%C3%AF"),
        (
            "http://h:1",
            "/v1beta/models/g:generateContent",
            "http://h:1/v1beta/models/g:generateContent",
        ),
        ("http://[::1]:8080/api", "/v1/x", "http://[::1]:8080/api/v1/x"),
    ],
)
def test_upstream_url(base_url: str, endpoint: str, expected: str) -> None:
    target = target_at(base_url)
    url = upstream_url(target, endpoint)
    assert str(url) == expected
    assert url.origin() == target.origin


@pytest.mark.parametrize(
    "endpoint", ["/v1/x", "/@evil.example", "/v1/a b", "/ünï", "/%2F%2Fevil.example"]
)
def test_upstream_url_never_changes_the_origin(endpoint: str) -> None:
    # Even for endpoints decide() would refuse, the origin stays the target's.
    target = target_at("https://api.example.com:8443/base")
    url = upstream_url(target, endpoint)
    assert (url.scheme, url.host, url.port) == ("https", "api.example.com", 8443)
    assert url.raw_path.startswith("/base/")


def test_origin_label() -> None:
    assert (
        origin_label(URL("https://api.openai.com/v1/x?key=secret")) == "https://api.openai.com:443"
    )
    assert origin_label(URL("http://127.0.0.1:8080/a")) == "http://127.0.0.1:8080"


# --- query string ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [
        ({}, []),
        ({"q": "x"}, [("q", "x")]),
        ({"tag": ["a", "b", "c"]}, [("tag", "a"), ("tag", "b"), ("tag", "c")]),
        ({"tag": []}, []),
        ({"flag": True, "off": False}, [("flag", "true"), ("off", "false")]),
        ({"cursor": None}, [("cursor", "")]),
        ({"n": 5, "f": 1.5, "big": 2**70}, [("n", "5"), ("f", "1.5"), ("big", str(2**70))]),
        ({"filter": {"a": [1, 2], "b": "é"}}, [("filter", '{"a":[1,2],"b":"é"}')]),
        ({"m": [True, None, {"k": 1}]}, [("m", "true"), ("m", ""), ("m", '{"k":1}')]),
        ({"nested": [[1, 2]]}, [("nested", "[1,2]")]),
        ({"name": "ünï & =?"}, [("name", "ünï & =?")]),  # encoding is the client's job
    ],
)
@pytest.mark.parametrize("method", ["GET", "HEAD", "DELETE"])
def test_query_items(
    method: str, parameters: dict[str, Any], expected: list[tuple[str, str]]
) -> None:
    assert query_items(method, parameters) == expected


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "OPTIONS"])
def test_body_methods_have_no_query(method: str) -> None:
    assert query_items(method, {"a": 1}) is None


# --- address check -------------------------------------------------------------------------


def test_check_address_allows_public_addresses() -> None:
    check_address(EgressSpec(), "api.openai.com", "104.18.7.192")
    check_address(EgressSpec(), "api.openai.com", "2606:4700::6812:7c0")


@pytest.mark.parametrize(
    "address", ["127.0.0.1", "10.0.0.1", "169.254.169.254", "::1", "::ffff:169.254.169.254"]
)
def test_check_address_refuses_private_addresses(address: str) -> None:
    with pytest.raises(EgressDenied) as info:
        check_address(EgressSpec(), "rebind.example", address)
    exc = info.value
    assert exc.code.value == "EGRESS_DENIED"
    assert exc.http_status == 403
    assert exc.details == {"reason": "address_denied", "host": "rebind.example", "address": address}
    assert exc.message == (
        f"rebind.example resolves to {address}, which the egress policy does not allow "
        "(private, loopback, link-local and metadata addresses need egress.allow_cidrs)"
    )


def test_check_address_follows_allow_and_deny() -> None:
    egress = EgressSpec.model_validate(
        {"allow_cidrs": ["10.0.0.0/8"], "deny_cidrs": ["10.0.0.5/32"]}
    )
    check_address(egress, "inventory.internal", "10.1.2.3")
    with pytest.raises(EgressDenied):
        check_address(egress, "inventory.internal", "10.0.0.5")


@pytest.mark.parametrize(
    "address",
    [
        "64:ff9b::a9fe:a9fe",  # NAT64 (RFC 6052) of 169.254.169.254
        "64:ff9b::a00:1",  # NAT64 of 10.0.0.1
        "2002:a9fe:a9fe::1",  # 6to4 (RFC 3056) of 169.254.169.254
        "224.0.0.251",  # multicast
        "ff02::1",
    ],
)
def test_ipv6_forms_of_private_addresses_are_checked_as_ipv4(address: str) -> None:
    from gateway.policy import EgressSpec

    assert EgressSpec().allows(ipaddress.ip_address(address)) is False


def test_nat64_of_a_public_address_is_allowed() -> None:
    from gateway.policy import EgressSpec

    assert EgressSpec().allows(ipaddress.ip_address("64:ff9b::808:808")) is True  # 8.8.8.8


def test_remembered_verdicts_are_bounded_and_long_endpoints_are_not_kept() -> None:
    target = compile_policy(
        {
            "t": {
                "base_url": "https://api.example",
                "endpoints": [{"path": "/v1/models/*", "methods": ["GET"]}],
            }
        }
    ).targets["t"]
    long_path = "/v1/models/" + "m" * 300
    assert target.allows(long_path, "GET") is True
    assert target._verdicts == {}  # an agent's long endpoint is not kept in memory
    for i in range(3000):
        assert target.allows(f"/v1/models/m{i}", "GET") is True
        assert len(target._verdicts) <= 1024
    assert target.allows("/v1/other", "GET") is None
    assert target.allows("/v1/models/x", "DELETE") is False  # the verdicts stay right
    assert endpoint_problem("/" + "a/" * 200 + "..") == "dot_segment"  # long: computed
