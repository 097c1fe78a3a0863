"""The serving event loop choice (gateway.server.eventloop) and GATEWAY_LOOP on the command line."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from gateway.cli import main
from gateway.server import eventloop

HAVE_UVLOOP = importlib.util.find_spec("uvloop") is not None


async def _running_loop_name() -> str:
    return eventloop.loop_name(asyncio.get_running_loop())


def test_asyncio_choice_runs_the_standard_loop() -> None:
    assert eventloop.loop_factory("asyncio") is None
    assert eventloop.run(_running_loop_name(), "asyncio") == "asyncio"


@pytest.mark.parametrize("choice", [None, "auto", " AUTO "])
def test_auto_prefers_uvloop_when_installed(choice: str | None) -> None:
    expected = "uvloop" if HAVE_UVLOOP else "asyncio"
    assert eventloop.run(_running_loop_name(), choice) == expected


@pytest.mark.skipif(not HAVE_UVLOOP, reason="uvloop (the fast extra) is not installed")
def test_uvloop_choice_runs_uvloop() -> None:
    assert eventloop.run(_running_loop_name(), "uvloop") == "uvloop"


def test_unknown_choice_is_refused() -> None:
    with pytest.raises(ValueError, match="GATEWAY_LOOP must be one of auto, asyncio, uvloop"):
        eventloop.loop_factory("tokio")


def test_serve_exits_2_on_a_bad_gateway_loop(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GATEWAY_LOOP", "tokio")
    assert main(["serve", "--policy", "policies/demo.yaml"]) == 2
    assert "GATEWAY_LOOP must be one of" in capsys.readouterr().err
