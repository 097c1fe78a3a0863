"""The policy: one fixture file per failure mode, ``validate`` exit codes, endpoint
matching of compiled targets, and the egress address rules.

Each file in ``tests/policies/`` starts with one ``# expect: ...`` comment line per
problem that loading it must report, in order, with ``{file}`` standing for its path.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Any

import pytest

from gateway.cli import main
from gateway.policy import (
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_RETRY_ON,
    CompiledTarget,
    EgressSpec,
    PolicyError,
    load_policy,
    parse_policy,
)
from gateway.policy.loader import MAX_POLICY_BYTES
from tests.conftest import compile_policy

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "policies"
BAD_POLICIES = sorted(FIXTURES.glob("*.yaml"))
EXPECT = "# expect: "


def expected_problems(path: Path) -> list[str]:
    # Read as bytes: some fixtures are not UTF-8 after their '# expect:' lines.
    expected = []
    for raw in path.read_bytes().split(b"\n"):
        line = raw.decode("utf-8", errors="replace")
        if not line.startswith(EXPECT):
            break
        expected.append(line.removeprefix(EXPECT).replace("{file}", str(path)))
    return expected


def test_there_is_a_fixture_per_failure_mode() -> None:
    assert len(BAD_POLICIES) >= 30
    for path in BAD_POLICIES:
        assert expected_problems(path), f"{path.name} has no '# expect:' line"


@pytest.mark.parametrize("path", BAD_POLICIES, ids=lambda p: p.stem)
def test_bad_policy_reports_exactly_the_expected_problems(path: Path) -> None:
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert info.value.problems == expected_problems(path)
    assert info.value.source == str(path)
    assert str(info.value) == "\n".join(expected_problems(path))


@pytest.mark.parametrize(
    ("fixture", "secret"),
    [
        ("base_url_with_userinfo", "hunter2-NOTREAL"),
        ("base_url_with_query", "AIzaNOTREAL0123456789"),
        ("credential_bad_secret_ref", "sk-live-NOTAREF"),
    ],
)
def test_policy_problems_do_not_echo_credentials(fixture: str, secret: str) -> None:
    path = FIXTURES / f"{fixture}.yaml"
    assert secret in path.read_text()
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert secret not in str(info.value)


def test_unreadable_policy(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    with pytest.raises(PolicyError) as info:
        load_policy(missing)
    assert info.value.problems == [
        f"{missing}:1: (top level): cannot read the policy: No such file or directory"
    ]


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (lambda p: p.mkdir(), "cannot read the policy: Is a directory"),
        (lambda p: p.write_bytes(b""), "the policy is empty: it must be a YAML mapping"),
        (lambda p: p.write_bytes(b"\n\n  \n"), "the policy is empty: it must be a YAML mapping"),
        (
            lambda p: p.write_bytes(b"# " + b"x" * MAX_POLICY_BYTES),
            f"the policy is larger than {MAX_POLICY_BYTES} bytes",
        ),
    ],
    ids=["directory", "empty", "blank", "too-large"],
)
def test_policy_files_that_are_not_policies(make: Any, problem: str, tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    make(path)
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert info.value.problems == [f"{path}:1: (top level): {problem}"]


def test_a_policy_under_a_file_is_unreadable(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    path = tmp_path / "file" / "policy.yaml"
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert info.value.problems == [
        f"{path}:1: (top level): cannot read the policy: Not a directory"
    ]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_a_policy_without_read_permission(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("version: 1\nagent_id: a\n")
    path.chmod(0)
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert info.value.problems == [
        f"{path}:1: (top level): cannot read the policy: Permission denied"
    ]


def test_in_memory_policy_errors_name_the_given_source() -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy("version: 1\nagent_id: a\ntargets: []\n", "inline.yaml")
    assert info.value.problems == ["inline.yaml:3: targets: Input should be a valid dictionary"]


def test_a_policy_without_targets_denies_everything() -> None:
    policy = parse_policy("version: 1\nagent_id: a\n", "inline.yaml")
    assert policy.targets == {}


# --- egress-gateway validate ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "summary"),
    [
        ("demo.yaml", "ok (5 targets, agent_id demo-agent)"),
        ("example.yaml", "ok (4 targets, agent_id planner-01)"),
    ],
)
def test_validate_accepts_the_shipped_policies(
    name: str, summary: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = ROOT / "policies" / name
    # The demo sets its env:// variables itself: not this shell's business.
    assert main(["validate", "--no-env-check", str(path)]) == 0
    out, err = capsys.readouterr()
    assert out == f"{path}: {summary}\n"
    assert err == ""


def test_validate_prints_every_problem_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    path = FIXTURES / "several_problems.yaml"
    assert main(["validate", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == expected_problems(path)
    assert len(err.splitlines()) == 4


def test_validate_checks_every_file_and_fails_if_any_fails(
    capsys: pytest.CaptureFixture[str],
) -> None:
    good, bad = ROOT / "policies" / "demo.yaml", FIXTURES / "version_2.yaml"
    assert main(["validate", "--no-env-check", str(bad), str(good)]) == 1
    out, err = capsys.readouterr()
    assert out == f"{good}: ok (5 targets, agent_id demo-agent)\n"
    assert err.splitlines() == expected_problems(bad)


def test_validate_of_a_missing_file_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["validate", str(tmp_path / "nope.yaml")]) == 1
    assert "cannot read the policy" in capsys.readouterr().err


def test_validate_without_a_file_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["validate"])
    assert info.value.code == 2
    assert "FILE" in capsys.readouterr().err


# --- defaults ----------------------------------------------------------------------------


def test_omitted_keys_take_the_documented_defaults() -> None:
    policy = compile_policy(
        {
            "t": {
                "base_url": "https://api.example.com",
                "endpoints": [{"path": "/", "methods": ["GET"]}],
            }
        }
    ).policy
    target = policy.targets["t"]
    assert policy.server.max_request_bytes == DEFAULT_MAX_REQUEST_BYTES == 8 * 1024 * 1024
    assert policy.envelope.unknown_fields == "reject"
    assert target.timeout_s == 30.0
    assert target.retry.max_retries == 3
    assert tuple(target.retry.retry_on) == DEFAULT_RETRY_ON
    assert target.circuit_breaker is not None
    assert target.circuit_breaker.fail_max == 5
    assert target.usage == "none"
    assert target.credential is None
    assert target.idempotency is None
    assert policy.audit.sink == "stdout"
    assert policy.audit.payloads == "summary"


# --- compiled endpoint matching ------------------------------------------------------------


def target_with(*rules: tuple[str, list[str]]) -> CompiledTarget:
    spec: dict[str, Any] = {
        "base_url": "https://api.example.com",
        "endpoints": [{"path": path, "methods": methods} for path, methods in rules],
    }
    return compile_policy({"t": spec}).targets["t"]


RULES = target_with(
    ("/v1/chat/completions", ["POST"]),
    ("/v1/models/*", ["GET"]),
    ("/v1/files/*/content", ["GET"]),
    ("/v1/batches/**", ["GET", "POST"]),
    ("/v1/models/*", ["DELETE"]),  # a second rule for the same path adds methods
)


@pytest.mark.parametrize(
    ("path", "method", "expected"),
    [
        # exact
        ("/v1/chat/completions", "POST", True),
        ("/v1/chat/completions", "GET", False),  # the path matches, the method does not
        ("/v1/chat", "POST", None),
        ("/v1/chat/completions/extra", "POST", None),
        ("/V1/chat/completions", "POST", None),  # paths are case-sensitive
        # '*' is exactly one segment
        ("/v1/models/gpt-4o", "GET", True),
        ("/v1/models/gpt-4o", "DELETE", True),
        ("/v1/models/gpt-4o", "POST", False),
        ("/v1/models", "GET", None),
        ("/v1/models/gpt-4o/versions", "GET", None),
        ("/v1/files/file-abc/content", "GET", True),
        ("/v1/files/file-abc/other", "GET", None),
        ("/v1/files/content", "GET", None),
        # a final '**' matches the rest, including nothing
        ("/v1/batches", "GET", True),
        ("/v1/batches/b1", "POST", True),
        ("/v1/batches/b1/cancel/now", "POST", True),
        ("/v1/batches/b1", "DELETE", False),
        ("/v1/batchesX", "GET", None),
        # no rule at all
        ("/", "GET", None),
        ("/v2/chat/completions", "POST", None),
    ],
)
def test_compiled_target_allows(path: str, method: str, expected: bool | None) -> None:
    assert RULES.allows(path, method) is expected


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/v1/chat/completions/", True),
        ("/v1/models/gpt-4o/", True),
        ("/v1/models/", None),  # '*' still needs a segment
    ],
)
def test_a_trailing_slash_is_insignificant_for_matching(path: str, expected: bool | None) -> None:
    # Decided: '/a/' names the same resource as '/a' for every provider we target, and it
    # cannot reach another path, so the allowlist treats them alike. The path is still
    # forwarded exactly as written (see test_egress.py).
    method = "POST" if "chat" in path else "GET"
    assert RULES.allows(path, method) is expected


def test_a_rule_written_with_a_trailing_slash_matches_both_forms() -> None:
    target = target_with(("/v1/items/", ["GET"]))
    assert target.allows("/v1/items", "GET") is True
    assert target.allows("/v1/items/", "GET") is True


def test_root_rules() -> None:
    assert target_with(("/", ["GET"])).allows("/", "GET") is True
    assert target_with(("/", ["GET"])).allows("/x", "GET") is None
    everything = target_with(("/**", ["GET"]))
    assert everything.allows("/", "GET") is True
    assert everything.allows("/a/b/c", "GET") is True
    assert everything.allows("/a/b/c", "POST") is False


def test_compiled_target_holds_origin_refs_and_forward_headers() -> None:
    spec = {
        "base_url": "https://api.example.com:8443/base",
        "credential": {
            "header": "Authorization",
            "format": "Bearer {secret}",
            "default_ref": "env://A",
            "allowed_refs": ["env://B"],
        },
        "endpoints": [{"path": "/x", "methods": ["GET"]}],
        "forward_headers": ["X-Request-Id", "OpenAI-Beta"],
    }
    target = compile_policy({"t": spec}).targets["t"]
    assert str(target.origin) == "https://api.example.com:8443"
    assert target.base_url.path == "/base"
    assert target.permitted_refs == frozenset({"env://A", "env://B"})
    assert target.forward_headers == frozenset({"x-request-id", "openai-beta"})


# --- egress address rules ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "allowed"),
    [
        ("8.8.8.8", True),
        ("1.1.1.1", True),
        ("2606:4700:4700::1111", True),
        ("127.0.0.1", False),
        ("127.8.9.10", False),
        ("0.0.0.0", False),  # noqa: S104 - an address to refuse, not to bind
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("192.168.1.1", False),
        ("169.254.169.254", False),  # the cloud metadata service
        ("100.64.0.1", False),  # CGNAT
        ("::1", False),
        ("fc00::1", False),  # ULA
        ("fd00:ec2::254", False),  # AWS's IPv6 metadata address
        ("fe80::1", False),  # link-local
        ("::ffff:169.254.169.254", False),  # IPv4-mapped metadata address
        ("::ffff:127.0.0.1", False),
        ("::ffff:8.8.8.8", True),
    ],
)
def test_egress_default_allows_only_public_addresses(address: str, allowed: bool) -> None:
    assert EgressSpec().allows(ipaddress.ip_address(address)) is allowed


def test_allow_cidrs_opens_a_range() -> None:
    egress = EgressSpec.model_validate({"allow_cidrs": ["10.20.0.0/16", "fd00::/8"]})
    assert egress.allows(ipaddress.ip_address("10.20.3.4")) is True
    assert egress.allows(ipaddress.ip_address("10.21.3.4")) is False
    assert egress.allows(ipaddress.ip_address("fd00::5")) is True
    assert egress.allows(ipaddress.ip_address("::ffff:10.20.3.4")) is True
    assert egress.allows(ipaddress.ip_address("8.8.8.8")) is True


def test_deny_cidrs_wins_over_allow_and_over_global() -> None:
    egress = EgressSpec.model_validate(
        {
            "allow_cidrs": ["169.254.0.0/16"],
            "deny_cidrs": ["169.254.169.254/32", "8.8.8.0/24"],
        }
    )
    assert egress.allows(ipaddress.ip_address("169.254.1.1")) is True
    assert egress.allows(ipaddress.ip_address("169.254.169.254")) is False
    assert egress.allows(ipaddress.ip_address("::ffff:169.254.169.254")) is False
    assert egress.allows(ipaddress.ip_address("8.8.8.8")) is False
    assert egress.allows(ipaddress.ip_address("8.8.4.4")) is True


def test_loopback_literal_base_url_is_accepted_once_allowed() -> None:
    # The conftest helper allows 127.0.0.0/8; without it the same policy is refused.
    spec = {"base_url": "http://127.0.0.1:9", "endpoints": [{"path": "/", "methods": ["GET"]}]}
    assert "t" in compile_policy({"t": spec}).targets
    with pytest.raises(PolicyError) as info:
        compile_policy({"t": spec}, egress={})
    assert info.value.problems == [
        "test-policy.yaml:1: targets.t.base_url: 127.0.0.1 is not allowed by the egress policy "
        "(not a public address, or in egress.deny_cidrs); "
        "list it in egress.allow_cidrs to allow it"
    ]


@pytest.mark.parametrize(
    ("snippet", "problem"),
    [
        ("server: {port: '8181'}", "server.port: Input should be a valid integer"),
        ("server: {debug: 'yes'}", "server.debug: Input should be a valid boolean"),
        ("server: {drain_s: '20'}", "server.drain_s: Input should be a valid number"),
    ],
)
def test_policy_values_are_strictly_typed(snippet: str, problem: str) -> None:
    text = f"version: 1\nagent_id: a\n{snippet}\n"
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "p.yaml")
    assert info.value.problems == [f"p.yaml:3: {problem}"]


@pytest.mark.parametrize("host", ["2130706433", "127.1", "0177.0.0.1", "0x7f.0.0.1"])
def test_ambiguous_numeric_hosts_are_refused(host: str) -> None:
    text = (
        f"version: 1\nagent_id: a\ntargets:\n  t:\n    base_url: http://{host}:80\n"
        "    endpoints: [{path: /x, methods: [GET]}]\n"
    )
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "p.yaml")
    assert "numeric form that is not a dotted-quad IPv4 address" in info.value.problems[0]


@pytest.mark.parametrize(
    ("headers", "problem"),
    [
        ("{Host: evil.example}", "'Host' is set by the sidecar"),
        ("{Content-Length: '5'}", "'Content-Length' is set by the sidecar"),
        ("{Authorization: Bearer hardcoded}", "'Authorization' is set by the sidecar"),
        ('{X-Ok: "a\\r\\nX-Injected: 1"}', "the value of 'X-Ok' contains control characters"),
    ],
)
def test_static_headers_cannot_set_framing_hosts_or_credentials(headers: str, problem: str):
    text = (
        "version: 1\nagent_id: a\ntargets:\n  t:\n    base_url: https://api.example.com\n"
        f"    endpoints: [{{path: /x, methods: [GET]}}]\n    static_headers: {headers}\n"
    )
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "p.yaml")
    assert problem in info.value.problems[0]
