"""Each dialect reads and rewrites the model a request asks for, and reads the model an
answer says it came from (pure functions behind the providers' interface)."""

from __future__ import annotations

from gateway import providers


def test_openai_and_anthropic_rewrite_the_body_model_and_keep_the_input() -> None:
    for dialect in ("openai", "anthropic"):
        body = {"model": "alias", "messages": [{"role": "user", "content": "hi"}]}
        endpoint, rewritten = providers.with_model(dialect, "/v1/x", body, "snap-1")
        assert endpoint == "/v1/x"
        assert rewritten == {**body, "model": "snap-1"}
        assert body["model"] == "alias"  # pure: the input is not changed
        assert providers.request_model(dialect, endpoint, rewritten) == "snap-1"


def test_gemini_rewrites_the_model_in_the_path_for_both_methods() -> None:
    for method in ("generateContent", "streamGenerateContent"):
        endpoint = f"/v1beta/models/gemini-pro:{method}"
        body = {"contents": []}
        new_endpoint, new_body = providers.with_model("gemini", endpoint, body, "gemini-2.0-001")
        assert new_endpoint == f"/v1beta/models/gemini-2.0-001:{method}"
        assert new_body is body
        assert providers.request_model("gemini", new_endpoint, new_body) == "gemini-2.0-001"


def test_a_request_naming_no_model_is_kept() -> None:
    body = {"messages": []}
    assert providers.with_model("openai", "/v1/chat/completions", body, "m") == (
        "/v1/chat/completions",
        body,
    )
    assert providers.with_model("gemini", "/v1beta/models", {}, "m") == ("/v1beta/models", {})
    assert providers.with_model("none", "/x", {"model": "a"}, "m") == ("/x", {"model": "a"})
    assert providers.request_model("none", "/x", {"model": "a"}) is None


def test_the_answered_model_per_dialect() -> None:
    assert providers.response_model("openai", {"model": "gpt-4o-2024-08-06"}) == (
        "gpt-4o-2024-08-06"
    )
    start = {"type": "message_start", "message": {"model": "claude-x-20250101"}}
    assert providers.response_model("anthropic", [start, {"type": "ping"}]) == ("claude-x-20250101")
    assert providers.response_model("gemini", [{"modelVersion": "gemini-2.0-001"}]) == (
        "gemini-2.0-001"
    )
