"""The sidecar's price table (gateway/cost/table.py, read from genai-prices in a child
process) gives the rates genai-prices itself gives: for every model of the table, by its
id, in upper case, with a compact date, with a suffix, on days before and after each of
its price changes; and a sidecar that prices calls never imports the library.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import date, timedelta
from pathlib import Path
from typing import Any

import pytest

from gateway.cost import prices, table

ROOT = Path(__file__).resolve().parent.parent


def _days(models: list[list[Any]]) -> list[str]:
    """Today, and the days around every start date of the table."""
    days = {date.today().isoformat(), "2024-01-01", "2030-01-01"}
    for model in models:
        for when, _ in model[2]:
            if when not in (None, "never"):
                start = date.fromisoformat(when)
                days |= {start.isoformat(), (start - timedelta(days=1)).isoformat()}
    return sorted(days)


def _refs(model_id: str) -> list[str]:
    refs = [model_id, model_id.upper(), model_id + "-20251211", model_id + "-latest"]
    refs.append(model_id.replace("-2025-", "-2025"))  # compact dates, written with dashes
    return refs


def test_every_model_of_the_table_is_priced_as_the_library_prices_it() -> None:
    genai_prices = pytest.importorskip("genai_prices")
    snapshot = genai_prices.data_snapshot.get_snapshot()
    key = table.library_key()
    assert key is not None
    loaded = table.Table(json.loads(table._extract_in_child()))
    checked = 0
    for provider in table.PROVIDERS:
        models = loaded.providers[provider]["models"]
        assert len(models) > 10  # the provider's models are there, not an empty table
        days = _days(models)
        for model in models:
            for ref in _refs(model[0]):
                for day in days:
                    got = loaded.rates(provider, ref, day)
                    ours = None if got is None else prices._as_rates(*got)
                    assert ours == _library(snapshot, provider, ref, day), (provider, ref, day)
                    checked += 1
    assert checked > 1000


def _library(snapshot: Any, provider: str, ref: str, day: str) -> Any:
    from datetime import UTC, datetime

    try:
        _, info = snapshot.find_provider_model(ref, None, provider, None)
    except LookupError:
        return None
    price = info.get_prices(datetime.fromisoformat(day).replace(tzinfo=UTC))
    return prices._as_rates(str(info.id), prices.token_rates(price))


def test_the_table_is_cached_and_a_stale_copy_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("genai_prices")
    key = table.library_key()
    assert key is not None
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = table._cache_path(key)
    assert path is not None
    first = table.load(key)  # extracted in a child, then saved
    assert path.is_file()
    assert json.loads(path.read_text())["key"] == key
    assert table.load(key).providers == first.providers  # read back from the cache
    stale = json.loads(path.read_text())
    stale["key"] = "another library"
    stale["providers"] = {}
    path.write_text(json.dumps(stale))
    assert table.load(key).providers == first.providers  # not the stale copy


SCRIPT = """
import json, sys
from gateway.cost import preload
from gateway.cost.prices import library_rates
preload()
rates = library_rates("openai", "gpt-4o-mini")
print(json.dumps({"input": rates.input_usd_per_mtok, "source": rates.source,
                  "modules": sorted(sys.modules)}))
"""


def test_a_priced_lookup_does_not_import_the_library_or_its_client(tmp_path: Path) -> None:
    pytest.importorskip("genai_prices")
    env = dict(os.environ, PYTHONPATH=str(ROOT), XDG_CACHE_HOME=str(tmp_path))
    for _ in range(2):  # extracted in a child, then read from the cache
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env,
            timeout=300, cwd=ROOT, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        out = json.loads(done.stdout.strip().splitlines()[-1])
        assert out["source"] == "genai-prices"
        assert out["input"] > 0
        loaded = {name.split(".")[0] for name in out["modules"]}
        assert "gateway" in loaded
        assert sorted(loaded & {"genai_prices", "httpx2", "httpx"}) == []


async def test_a_reload_that_turns_pricing_on_loads_the_table_before_it_applies(
    tmp_path: Path,
) -> None:
    import io

    from gateway.policy import load_policy
    from gateway.server.runtime import Gateway
    from tests.conftest import openai_target, policy_yaml

    pytest.importorskip("genai_prices")
    source = tmp_path / "policy.yaml"
    unpriced = openai_target("http://127.0.0.1:9", usage="none")
    source.write_text(policy_yaml({"t": unpriced}))
    prices._load.cache_clear()
    gateway = Gateway(load_policy(str(source)), log_stream=io.StringIO())
    await gateway.start()
    try:
        assert prices._load.cache_info().currsize == 0  # nothing priced: no table read
        source.write_text(policy_yaml({"t": openai_target("http://127.0.0.1:9")}))
        assert await gateway.reload() is True
        # Read off the event loop before the priced policy was applied, not at its
        # first call.
        assert prices._load.cache_info().currsize == 1
    finally:
        await gateway.aclose()
