"""Secrets stay out of text: the scrubber, the Secret holder, and the audit writer."""

from __future__ import annotations

import base64
import copy
import io
import json
import pickle
import re
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, quote_plus

import pytest
from yarl import URL

from gateway import redaction
from gateway.audit import log as audit
from gateway.audit.schema import AUDIT_SCHEMA_VERSION, CALL_EVENT
from gateway.policy import AuditSpec
from gateway.policy.egress import NOT_A_REFERENCE
from gateway.redaction import REDACTED, redact_value, register, scrub, scrub_bytes
from gateway.secrets import Secret
from gateway.server.runtime import Gateway
from tests.conftest import compile_policy, envelope, openai_target


def fresh(prefix: str = "sk-canary-") -> str:
    """A value never registered before (the registry is process-wide)."""
    return prefix + uuid.uuid4().hex


# --- register / scrub ------------------------------------------------------------------------


def test_scrub_removes_a_registered_value_everywhere() -> None:
    value = fresh()
    register(value)
    text = f"key={value}; again {value}!"
    assert scrub(text) == f"key={REDACTED}; again {REDACTED}!"
    assert scrub_bytes(text.encode()) == f"key={REDACTED}; again {REDACTED}!".encode()


def test_text_without_secrets_is_unchanged() -> None:
    register(fresh())
    assert scrub("nothing to see") == "nothing to see"
    assert scrub_bytes(b"nothing to see") == b"nothing to see"


# The prefixes are the parameters and each value is made in its test: a value made at
# collection time would give each pytest-xdist worker different test IDs, and the workers'
# collections must match.
@pytest.mark.parametrize(
    "prefix",
    [
        'pa"ss\\word-',  # quote and backslash
        "line\nbreak\ttab-",  # control characters
        "https://user@host/path-",  # slashes some encoders escape
        "clé-secrète-",  # non-ASCII
        'clé"with-quote-',  # non-ASCII and an escape together
    ],
)
def test_scrub_removes_the_json_escaped_forms(prefix: str) -> None:
    value = fresh(prefix)
    register(value)
    renderings = [
        json.dumps({"v": value}),
        json.dumps({"v": value}, ensure_ascii=False),
        json.dumps({"v": value}).replace("/", "\\/"),
        value,
    ]
    for text in renderings:
        scrubbed = scrub(text)
        assert value not in scrubbed
        assert REDACTED in scrubbed
        assert json.dumps(value)[1:-1] not in scrubbed
        assert json.dumps(value, ensure_ascii=False)[1:-1] not in scrubbed
        assert scrub_bytes(text.encode()) == scrubbed.encode()


def _pieces(text: str, size: int = 12) -> list[str]:
    return [text[i : i + size] for i in range(len(text) - size + 1)]


def _lower_hex(text: str) -> str:
    return re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), text)


def _wire_renderings(value: str) -> list[str]:
    """``value`` as an upstream echoing the request, or a writer of the sidecar, shows it
    (computed here independently of the registry)."""
    url = URL("http://h/").extend_query([("key", value)])
    percent = [
        url.raw_query_string.removeprefix("key="),  # what aiohttp sent
        url.query_string.removeprefix("key="),  # aiohttp's request.query_string
        quote(value, safe=""),
        quote(value),
        quote_plus(value),
    ]
    forms = [value, *percent, *(_lower_hex(p) for p in percent)]
    forms += [repr(value)[1:-1], repr(value.encode())[2:-1]]
    escaped = [json.dumps(f, ensure_ascii=a)[1:-1] for f in forms for a in (True, False)]
    return forms + escaped + [f.replace("/", "\\/") for f in forms + escaped]


@pytest.mark.parametrize(
    "prefix",  # made into a value in the test, as above
    [
        "gk+fake/TEST=0004 NOTREAL-",  # "+", "/", "=", a space
        "clé-€-secrète-",  # non-ASCII
        'q"uote\\back%41&amp#hash;semi?',  # what JSON and URLs escape
        "emoji-\U0001f511-",  # astral: \\ud83d\\udd11 in ASCII JSON
    ],
)
def test_every_encoding_of_a_query_credential_is_scrubbed(prefix: str) -> None:
    value = fresh(prefix)
    register(value)
    renderings = _wire_renderings(value)
    for rendering in renderings:
        text = f"GET /v1/m?alt=json&key={rendering}&x=1 failed"
        for scrubbed in (scrub(text), scrub_bytes(text.encode()).decode()):
            assert REDACTED in scrubbed, rendering
            for form in renderings:
                for piece in _pieces(form):
                    assert piece not in scrubbed, (rendering, piece)


def test_a_plain_key_has_one_form_and_every_key_few() -> None:
    plain = fresh("sk-proj_")
    assert redaction.encoded_forms(plain) == (plain,)
    nasty = 'a b+c/d=e"f\\g%h&i#j;k?l~m\u00e9\u20ac\U0001f511'
    forms = redaction.encoded_forms(nasty)
    assert len(forms) <= 100
    assert list(forms) == sorted(forms, key=len, reverse=True)  # longest replaced first


def test_a_value_with_lone_surrogates_is_scrubbed_from_bytes() -> None:
    # os.environ decodes undecodable bytes as lone surrogates: such a value must not
    # make every writer fail (it did: str.encode() raised inside scrub_bytes).
    value = "sk-\udcff\udcfe-" + uuid.uuid4().hex
    register(value)
    raw = value.encode("utf-8", "surrogateescape")
    assert scrub_bytes(b"x " + raw + b" y") == b"x [REDACTED] y"
    assert scrub(f"x {value} y") == "x [REDACTED] y"


def test_a_percent_encoded_secret_cut_by_truncation_is_masked() -> None:
    value = "cut+key/" + uuid.uuid4().hex
    register(value)
    wire = URL("http://h/").extend_query([("k", value)]).raw_query_string[2:]
    text = "x" * 40 + wire
    cut = redaction.scrub_cut(text, 40 + len(wire) // 2)
    assert cut == "x" * 40 + REDACTED


@pytest.mark.parametrize("value", ["", "a", "hunter2", "1234567"])
def test_values_shorter_than_the_minimum_are_not_scrubbed(value: str) -> None:
    # They would mangle ordinary text, and no real credential is that short.
    assert len(value) < redaction.MIN_SCRUB_LENGTH
    register(value)
    text = f"the word {value} stays"
    assert scrub(text) == text


def test_registering_twice_is_harmless() -> None:
    value = fresh()
    register(value)
    register(value)
    assert scrub(value) == REDACTED


# --- the Secret holder ---------------------------------------------------------------------


def test_secret_never_shows_its_value() -> None:
    value = fresh()
    secret = Secret(value)
    for text in (repr(secret), str(secret), f"{secret}", f"{secret!r}", "%s" % secret,  # noqa: UP031
                 repr([secret]), repr({"k": secret}), repr(ValueError(secret))):  # fmt: skip
        assert value not in text
        assert "*" in text
    assert secret.reveal() == value


def test_creating_a_secret_registers_it_for_scrubbing() -> None:
    value = fresh()
    Secret(value)
    assert scrub(f"echo {value}") == f"echo {REDACTED}"


def test_secret_refuses_pickling_and_copying() -> None:
    secret = Secret(fresh())
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        with pytest.raises(TypeError, match="cannot be pickled"):
            pickle.dumps(secret, protocol=protocol)
    with pytest.raises(TypeError):
        copy.copy(secret)


def test_secret_equality_compares_values() -> None:
    value = fresh()
    assert Secret(value) == Secret(value)
    assert hash(Secret(value)) == hash(Secret(value))
    assert Secret(value) != Secret(fresh())
    assert Secret(value) != value


# --- redact_value ---------------------------------------------------------------------------


def test_redact_value_replaces_sensitive_keys_case_insensitively() -> None:
    headers: dict[str, object] = {
        "Authorization": "Bearer x",
        "X-API-Key": "k",
        "api-key": "k",
        "Cookie": "c",
        "Proxy-Authorization": "p",
        "Content-Type": "application/json",
        "X-Request-Id": "r1",
    }
    redacted = redact_value(headers)
    assert redacted == {
        "Authorization": REDACTED,
        "X-API-Key": REDACTED,
        "api-key": REDACTED,
        "Cookie": REDACTED,
        "Proxy-Authorization": REDACTED,
        "Content-Type": "application/json",
        "X-Request-Id": "r1",
    }
    assert headers["Authorization"] == "Bearer x"  # a copy: the original is untouched


def test_redact_value_reaches_every_depth() -> None:
    nested: dict[str, object] = {"outer": {"password": "p", "list": [{"token": "t"}]}}
    assert redact_value(nested) == {"outer": {"password": REDACTED, "list": [{"token": REDACTED}]}}


# --- the audit writer ----------------------------------------------------------------------


@pytest.fixture
def audit_stream() -> Iterator[io.StringIO]:
    previous = audit._ops_sink.stream
    stream = io.StringIO()
    audit.configure_logging(stream)
    yield stream
    audit.configure_logging(previous)


def lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_audit_output_holds_no_secret_and_no_traceback_locals(audit_stream: io.StringIO) -> None:
    value = fresh("sk-audit-canary-")
    secret = Secret(value)
    log = audit.get_logger("test")
    log.info("nested", payload={"messages": [{"content": f"my key is {value}"}]}, count=1)
    log.info("headers", authorization=f"Bearer {value}", Api_Key="k", note="kept")

    def fail(credential: str) -> None:
        local_copy = credential  # a local that show_locals would print
        raise RuntimeError(f"upstream rejected {local_copy}")

    try:
        fail(secret.reveal())
    except RuntimeError:
        log.exception("call_failed", trace_id="tr-1")

    text = audit_stream.getvalue()
    assert value not in text
    assert json.dumps(value)[1:-1] not in text
    nested, headers, failed = lines(audit_stream)
    assert nested["payload"] == {"messages": [{"content": f"my key is {REDACTED}"}]}
    assert nested["count"] == 1
    assert headers["authorization"] == REDACTED
    assert headers["Api_Key"] == REDACTED
    assert headers["note"] == "kept"
    # The traceback is structured, scrubbed, and carries no local variables.
    [exc] = failed["exception"]
    assert exc["exc_type"] == "RuntimeError"
    assert exc["exc_value"] == f"upstream rejected {REDACTED}"
    assert [f["name"] for f in exc["frames"]][-1] == "fail"
    assert all("locals" not in frame for frame in exc["frames"])
    assert "local_copy" not in text
    for line in (nested, headers, failed):
        assert line["timestamp"].endswith("Z")
        assert line["level"] in {"info", "error"}


def test_audit_call_record_marks_schema_and_level(audit_stream: io.StringIO) -> None:
    log = audit.AuditLog(AuditSpec(), audit_stream, agent_id="agent-1")
    log.call({"trace_id": "t1", "success": True})
    log.call({"trace_id": "t2", "success": False})
    log.event("policy_reloaded", source="p.yaml")
    ok, failed, event = lines(audit_stream)
    assert ok["event"] == CALL_EVENT
    assert ok["audit_schema"] == AUDIT_SCHEMA_VERSION
    assert ok["sidecar_id"] == log.sidecar_id
    assert (ok["level"], failed["level"]) == ("info", "warning")
    assert event["event"] == "policy_reloaded"
    assert event["agent_id"] == "agent-1"


async def test_a_key_sent_as_api_key_ref_is_not_copied_into_the_audit_record() -> None:
    # An agent that puts its key where a reference goes is refused (nothing forwarded);
    # neither the answer nor the audit record may repeat the key. No network is used:
    # the call stops at the egress decision.
    key = fresh("sk-proj-pasted-")
    stream = io.StringIO()
    policy = compile_policy({"fake-openai": openai_target("http://127.0.0.1:9")})
    gateway = Gateway(policy, log_stream=stream)
    await gateway.start()
    try:
        status, response = await gateway.call(json.dumps(envelope(api_key_ref=key)).encode())
    finally:
        await gateway.aclose()
    assert status == 403
    assert response.error is not None
    assert response.error.details == {"reason": "ref_not_allowed", "api_key_ref": NOT_A_REFERENCE}
    assert key not in response.model_dump_json()
    assert key not in stream.getvalue()
    [record] = [r for r in lines(stream) if r.get("event") == CALL_EVENT]
    assert record["api_key_ref"] == NOT_A_REFERENCE
    assert record["error_code"] == "PERMISSION_DENIED"


def test_sensitive_keys_are_redacted_at_any_depth() -> None:
    import io
    import json

    from gateway.audit import log as audit

    stream = io.StringIO()
    audit.AuditLog(AuditSpec(), stream, agent_id="a").event(
        "probe",
        metadata={
            "step": 1,
            "creds": {"API_KEY": "agent-pasted-value-123"},
            "list": [{"token": "another-pasted-value-456"}],
        },
    )
    line = json.loads(stream.getvalue().splitlines()[-1])
    assert line["metadata"] == {
        "step": 1,
        "creds": {"API_KEY": "[REDACTED]"},
        "list": [{"token": "[REDACTED]"}],
    }


def test_a_secret_cut_by_truncation_is_still_masked() -> None:
    from gateway import redaction
    from gateway.call.bodies import ERROR_TEXT_LIMIT, parse_body

    secret = "CANARYxq7Zk93PLmv-cut-test"
    redaction.register(secret)
    for pad in range(ERROR_TEXT_LIMIT - len(secret) - 2, ERROR_TEXT_LIMIT + 2):
        body = ("x" * pad + "Bearer " + secret + " trailing").encode()
        data, _ = parse_body("text/plain", body, 400)
        assert len(data["text"]) <= ERROR_TEXT_LIMIT + len(redaction.REDACTED)
        for size in range(4, len(secret) + 1):
            assert not data["text"].endswith(secret[:size]), (pad, size)
        assert secret[:6] not in data["text"]


# --- sensitive keys: name variants and deep nesting ------------------------------------------


@pytest.mark.parametrize(
    "key",
    ["api_key", "API-Key", "Authorization ", "access-token", "client_secret", "private_key",
     "openai_api_key", "Bearer", "x-api-key", "id_token", "db_password", "credentials"],
)  # fmt: skip
def test_sensitive_key_variants_are_redacted(key: str) -> None:
    assert redaction.is_sensitive_key(key)
    assert redact_value({"a": [{key: "sk-x"}]}) == {"a": [{key: REDACTED}]}


@pytest.mark.parametrize("key", ["max_tokens", "tokens_used", "model", "idempotency_key", "task"])
def test_ordinary_keys_are_kept(key: str) -> None:
    assert not redaction.is_sensitive_key(key)
    assert redact_value({key: 5}) == {key: 5}


def test_values_nested_past_the_depth_limit_are_replaced_whole() -> None:
    deep: dict[str, Any] = {"password": "pw-deep"}
    for _ in range(redaction.MAX_REDACT_DEPTH + 3):
        deep = {"l": deep}
    assert "pw-deep" not in json.dumps(redact_value(deep))
    shallow: dict[str, Any] = {"password": "pw", "n": 1}
    for _ in range(redaction.MAX_REDACT_DEPTH - 1):
        shallow = {"l": shallow}
    assert '"n": 1' in json.dumps(redact_value(shallow))  # searched, not replaced
    assert "pw" not in json.dumps(redact_value(shallow)).replace("REDACTED", "")


def test_scrub_bytes_finds_values_with_and_without_an_anchor() -> None:
    # scrub_bytes first asks whether any value's anchor (or, for a value without one,
    # any of its forms) or base64 form is in the text at all: each kind must pass it.
    anchored = "sk-gate-" + uuid.uuid4().hex
    unanchored = "+/=&?#" + "".join("+/=& "[b % 5] for b in uuid.uuid4().bytes)
    for value in (anchored, unanchored):
        register(value)
    assert redaction._values[unanchored].anchor == ""  # every form differs somewhere
    for value in (anchored, unanchored):
        for form in (value, quote(value, safe=""), json.dumps(value)[1:-1]):
            data = b'data: {"x": "' + form.encode() + b'"}\n\n'
            assert scrub_bytes(data) == b'data: {"x": "' + REDACTED.encode() + b'"}\n\n'
        b64 = base64.b64encode(b"pre:" + value.encode() + b":post")
        assert b"[REDACTED]" in scrub_bytes(b"data: " + b64 + b"\n\n")
    escaped = "".join(f"\\u{ord(c):04x}" for c in anchored).encode()  # every character
    assert scrub_bytes(b'{"x": "' + escaped + b'"}') == b'{"x": "[REDACTED]"}'
    assert scrub_bytes(b"no secret, a \\n and a \\u0041") == b"no secret, a \\n and a \\u0041"
