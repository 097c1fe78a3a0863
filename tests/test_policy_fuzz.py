"""Policy fuzzing: whatever a policy file holds, loading it
gives a PolicySet or a PolicyError whose every problem is one printable line
``FILE:LINE: key.path: problem`` with a line inside the file; never another exception.

Inputs: the repository's real policies (``policies/*.yaml``, ``tests/policies/*.yaml``)
mutated by bytes, by lines and by keys and values, and random YAML shaped like a policy
(anchors, aliases and merge keys included). The normal run is derandomized (the same
examples each time, ~100 per test); ``FUZZ_EXAMPLES=N`` runs N random examples per test,
without the per-test timeout::

    FUZZ_EXAMPLES=20000 .venv/bin/python -m pytest -p no:cacheprovider tests/test_policy_fuzz.py

A failure prints the input's bytes and a ``@reproduce_failure`` blob.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.policy import PolicyError, PolicySet, load_policy
from gateway.policy.root import Policy
from tests.test_policy import FIXTURES, ROOT
from tests.test_policy_input import PROBLEM_LINE, _models_under

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES") or 0)
FUZZING = EXAMPLES > 0
FUZZ = settings(
    max_examples=EXAMPLES or 100,
    deadline=None,
    database=None,
    derandomize=not FUZZING,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
pytestmark = pytest.mark.timeout(0 if FUZZING else 60)

SEEDS = [p.read_bytes() for p in sorted((ROOT / "policies").glob("*.yaml"))] + [
    p.read_bytes() for p in sorted(FIXTURES.glob("*.yaml"))
]
#: Every key the policy models know, so mutations and random YAML reach the validators.
KEYS = sorted({name for model in [Policy, *_models_under(Policy)] for name in model.model_fields})
# fmt: off
#: YAML scalars that have broken YAML loaders or validators somewhere.
SCALARS = [
    "1", "0", "-1", "429", "503", "65536", "99999999999999999999999999999", "9" * 4400,
    "1.5", "1.0e+999", ".inf", "-.inf", ".nan", "0x1F", "0o17", "0b101", "1_000", "1:20",
    "~", "null", "true", "yes", "off", "2024-02-30", "2024-01-01", "2001-12-14t21:59:43.10-05:00",
    "''", '""', "'a b'", '"\\u0000"', '"\\ud800"', '"\\x1b[31m"', '"a\\nb"', "!!int x",
    "!!binary aGk=", "!!binary @@", "!!timestamp x", "!!bool maybe", "!!float x", "!!str 1",
    "!!null x", "!foo bar", "!!python/name:os.system ''", "=", "<<", "https://api.example.com",
    "http://[::1", "http://u:p@h", "/v1/x", "/**", "GET", "POST", "env://K", "vault://k#f",
    "10.0.0.0/8", "10", "fd00::/8", "Bearer {secret}", "local", "cluster", "openai",
    "x" * 300, "é", "\u2028", "\t",
]
TOKENS = [
    b"&a ", b"*a", b"<<: *a", b"<<: [*a, *a]", b"? ", b"[", b"]", b"{", b"}", b": ", b"- ",
    b", ", b"---\n", b"...\n", b"%YAML 1.1\n", b"|\n", b">-\n", b"#", b"'", b'"', b"\\",
    b"\x00", b"\xff", b"\xe9", b"\xef\xbb\xbf", b"\t", b"\r", b"\r\n", b"\xc2\x85",
    b"\xe2\x80\xa8", b"\x1b", b"\x7f", *(s.encode() for s in SCALARS[:48]),
]
LINES = [
    b"<<: *a\n", b"x: &a {requests_per_second: 1}\n", b"? [a, b]\n", b": 1\n", b"- *a\n",
    b"retry: &a {max_retries: 2}\n", b"retry: {<<: *a}\n", b"endpoints: *a\n", b"a: &a [*a]\n",
    b"ttl_s: 99999999999999999999999999999\n", b"timeout_s: .inf\n", b"---\n",
    b"allow_cidrs: [10, 10.0]\n", b"? !!set {a}\n", b"{[1]: x}\n", b"\x00\n", b"\xff\xfe\n",
    b"targets: {t: {base_url: 'http://10.0.0.1', endpoints: [{path: /, methods: [GET]}]}}\n",
]
# fmt: on


def check(path: Path, raw: bytes) -> None:
    """Load ``raw`` from ``path``: a PolicySet, or a PolicyError of well-formed lines."""
    path.write_bytes(raw)
    try:
        policy = load_policy(path)
    except PolicyError as exc:
        error = exc
    else:
        assert isinstance(policy, PolicySet)
        return
    assert error.problems
    assert error.source == str(path)
    # PyYAML also counts \r, NEL and U+2028/9 as line breaks.
    breaks = sum(
        raw.count(b) for b in (b"\n", b"\r", b"\xc2\x85", b"\xe2\x80\xa8", b"\xe2\x80\xa9")
    )
    for problem in error.problems:
        match = PROBLEM_LINE.match(problem)
        assert match, problem
        assert match["file"] == str(path), problem
        assert 1 <= int(match["line"]) <= breaks + 1, problem
        assert problem.isprintable(), problem


@pytest.fixture(scope="module")
def policy_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "policy.yaml"


# --- mutations of the real policies ------------------------------------------------------


@st.composite
def byte_mutants(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 6))):
        at = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(["byte", "token", "delete", "copy", "flip"]))
        if op == "byte":
            data[at:at] = bytes([draw(st.integers(0, 255))])
        elif op == "token":
            data[at:at] = draw(st.sampled_from(TOKENS))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 40))]
        elif op == "copy":
            start = draw(st.integers(0, len(data)))
            data[at:at] = data[start : start + draw(st.integers(1, 80))]
        elif data:
            i = min(at, len(data) - 1)
            data[i] ^= 1 << draw(st.integers(0, 7))
    return bytes(data)


@st.composite
def line_mutants(draw: st.DrawFn) -> bytes:
    lines = draw(st.sampled_from(SEEDS)).splitlines(keepends=True) or [b"\n"]
    for _ in range(draw(st.integers(1, 5))):
        i = draw(st.integers(0, len(lines) - 1))
        op = draw(st.sampled_from(["delete", "duplicate", "swap", "indent", "dedent", "insert"]))
        if op == "delete" and len(lines) > 1:
            del lines[i]
        elif op == "duplicate":
            lines.insert(i, lines[i])
        elif op == "swap":
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif op == "indent":
            lines[i] = b"  " + lines[i]
        elif op == "dedent":
            lines[i] = lines[i].removeprefix(b"  ")
        else:
            indent = b" " * draw(st.sampled_from([0, 2, 4, 6]))
            lines.insert(i, indent + draw(st.sampled_from(LINES)))
    return b"".join(lines)


def _yaml_key(draw: st.DrawFn) -> str:
    return draw(
        st.sampled_from(KEYS)
        | st.sampled_from(["<<", "1", "null", "true", "[a]", "{a: 1}", "'x.y'", '"a\\tb"'])
        | st.text(st.characters(codec="utf-8", exclude_characters=":#\n"), min_size=1, max_size=8)
    )


@st.composite
def key_value_mutants(draw: st.DrawFn) -> bytes:
    """Change the keys and values of ``key: value`` lines, keeping the file's shape."""
    text = draw(st.sampled_from(SEEDS)).decode("utf-8", errors="replace")
    lines = text.splitlines(keepends=True)
    keyed = [i for i, line in enumerate(lines) if ":" in line and not line.lstrip().startswith("#")]
    for _ in range(draw(st.integers(1, 6))):
        if not keyed:
            break
        i = draw(st.sampled_from(keyed))
        indent = lines[i][: len(lines[i]) - len(lines[i].lstrip(" -"))]
        key, _, value = lines[i][len(indent) :].partition(":")
        op = draw(st.sampled_from(["key", "value", "anchor", "alias", "merge", "typo"]))
        if op == "key":
            key = _yaml_key(draw)
        elif op == "typo" and len(key) > 1:
            j = draw(st.integers(0, len(key) - 2))
            key = key[:j] + key[j + 1] + key[j] + key[j + 2 :]
        elif op == "value":
            value = " " + draw(st.sampled_from(SCALARS) | flow_values()) + "\n"
        elif op == "anchor":
            value = " &a" + value
        elif op == "alias":
            value = " *a\n"
        elif op == "merge":
            lines.insert(i, f"{indent}<<: *a\n")
            keyed = [k + (k >= i) for k in keyed]
            continue
        lines[i] = f"{indent}{key}:{value}"
    return "".join(lines).encode("utf-8", errors="surrogatepass")


# --- random YAML shaped like a policy ----------------------------------------------------


def flow_values(max_leaves: int = 12) -> st.SearchStrategy[str]:
    """Flow-style YAML values: scalars, lists, mappings with policy keys, anchors (&aN),
    aliases (*aN) and merge keys."""
    scalars = (
        st.sampled_from(SCALARS) | st.integers().map(str) | st.text(max_size=10).map(json.dumps)
    )
    keys = st.sampled_from(KEYS) | st.sampled_from(["<<", "x", "1", "[a]"])

    def extend(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        lists = st.lists(children, max_size=4).map(lambda items: "[" + ", ".join(items) + "]")
        maps = st.lists(st.tuples(keys, children), max_size=4).map(
            lambda pairs: "{" + ", ".join(f"{k}: {v}" for k, v in pairs) + "}"
        )
        anchored = st.tuples(st.integers(0, 3), lists | maps).map(lambda t: f"&a{t[0]} {t[1]}")
        return lists | maps | anchored | st.integers(0, 3).map(lambda n: f"*a{n}")

    return st.recursive(scalars, extend, max_leaves=max_leaves)


@st.composite
def random_policies(draw: st.DrawFn) -> bytes:
    lines = []
    if draw(st.booleans()):
        lines += ["version: 1", "agent_id: a"]
    top = st.sampled_from([*Policy.model_fields, "<<", "x"])
    for key, value in draw(st.lists(st.tuples(top, flow_values()), max_size=6)):
        lines.append(f"{key}: {value}")
    if draw(st.booleans()):
        target = "{base_url: 'https://api.example.com', endpoints: [{path: /x, methods: [GET]}]"
        lines.append(
            f"targets: {{t: {target}, "
            + draw(st.sampled_from(KEYS))
            + ": "
            + draw(flow_values(4))
            + "}}"
        )
    return ("\n".join(lines) + "\n").encode("utf-8", errors="surrogatepass")


Mutator = Callable[[], st.SearchStrategy[bytes]]


@pytest.mark.parametrize(
    "inputs",
    [byte_mutants, line_mutants, key_value_mutants, random_policies],
    ids=["bytes", "lines", "keys-and-values", "random-yaml"],
)
def test_the_loader_answers_every_input_with_a_policy_or_problem_lines(
    inputs: Mutator, policy_path: Path
) -> None:
    @FUZZ
    @given(raw=inputs())
    def run(raw: bytes) -> None:
        check(policy_path, raw)

    run()


def test_the_seeds_themselves_hold_the_invariant(policy_path: Path) -> None:
    for raw in SEEDS:
        check(policy_path, raw)


# --- the real CLI ------------------------------------------------------------------------

NASTY: dict[str, Any] = {
    "laughs.yaml": (FIXTURES / "billion_laughs.yaml").read_bytes(),
    "deep.yaml": b"version: 1\nx: " + b"[" * 20000 + b"]" * 20000 + b"\n",
    "deep-map.yaml": b"a: " + b"{a: " * 5000 + b"1" + b"}" * 5000 + b"\n",
    "unhashable.yaml": b"version: 1\n? [a, b]: 1\n{[1]: x}: 2\n",
    "digits.yaml": b"version: 1\nagent_id: a\nserver: {port: " + b"9" * 5000 + b"}\n",
    "junk.bin": bytes(range(256)) * 4,
    "nul.yaml": b"version: 1\x00\n",
    "latin1.yaml": b"agent_id: caf\xe9\n",
    "surrogate.yaml": b'version: 1\nagent_id: a\n"\\ud800\\x1b": 1\n',
    "empty.yaml": b"",
    "dir.yaml": None,  # a directory
}


def test_the_validate_command_never_prints_a_traceback(tmp_path: Path) -> None:
    paths = []
    for name, content in NASTY.items():
        path = tmp_path / name
        if content is None:
            path.mkdir()
        else:
            path.write_bytes(content)
        paths.append(str(path))
    cli = Path(sys.executable).with_name("egress-gateway")
    command = [str(cli)] if cli.exists() else [sys.executable, "-m", "gateway.cli"]
    done = subprocess.run(
        [*command, "validate", *paths], capture_output=True, timeout=120, check=False
    )
    out, err = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 1, (out, err)
    assert "Traceback" not in out + err
    assert out == ""
    lines = err.splitlines()
    for line in lines:
        match = PROBLEM_LINE.match(line)
        assert match, line
        assert match["file"] in paths, line
    assert {PROBLEM_LINE.match(line)["file"] for line in lines} == set(paths)  # type: ignore[index]
