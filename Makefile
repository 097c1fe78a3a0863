# The README's two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint typecheck docs docs-check unit fuzz bench bench-quick bench-stream bench-streams bench-peers clean

$(VENV)/.runtime: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[demo]'
	touch $@

# The benchmark measures what the image ships: the runtime plus the optional `fast` extra.
$(VENV)/.fast: $(VENV)/.runtime
	$(BIN)/python -m pip install --quiet -e '.[fast]'
	touch $@

# The dev tools, the `fast` extra (the tests then run uvloop, the image's event loop), and
# the agents' client (clients/python, its own distribution) so that its tests run with the
# sidecar's and the sidecar's contract tests can import it.
$(VENV)/.dev: $(VENV)/.runtime clients/python/pyproject.toml
	$(BIN)/python -m pip install --quiet -e '.[dev,fast]' -e ./clients/python
	touch $@

demo: $(VENV)/.runtime
	$(BIN)/egress-gateway demo

test: lint typecheck docs-check unit

# The documentation site (mkdocs.yml, docs/) into .site/: `make docs` regenerates the policy
# reference from the policy models, then builds the site strictly (a broken link or anchor
# is an error; not --quiet, which hides the warnings --strict counts).
MKDOCS := NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir .site
docs: $(VENV)/.dev
	$(BIN)/python docs/gen_policy_reference.py
	$(MKDOCS)

# What `make test` runs: the same build, but a stale policy reference fails (run make docs).
docs-check: $(VENV)/.dev
	$(BIN)/python docs/gen_policy_reference.py --check
	$(MKDOCS)

lint: $(VENV)/.dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(VENV)/.dev
	$(BIN)/mypy

# Tests that need a system tool skip without it (the reasons are in pytest's summary);
# .ci/run installs the tools and makes a missing one a failure. Say so before they run.
# The tests run in PYTEST_WORKERS processes (pytest-xdist; most of the suite waits on
# loopback servers, so two overlap even on 2 cores); PYTEST_WORKERS=0 runs them in one.
# worksteal: an idle worker takes half of the other's queue, so the long tests do not
# leave one worker waiting at the end. Coverage is combined from the workers.
PYTEST_WORKERS ?= 2
unit: $(VENV)/.dev
	@command -v nft >/dev/null 2>&1 && command -v ip >/dev/null 2>&1 || echo "make test:" \
		"no nft or ip (Debian nftables, iproute2): tests/test_enforce.py will be skipped"
	@command -v promtool >/dev/null 2>&1 || echo "make test: no promtool (Debian prometheus):" \
		"tests/test_prometheus*.py will be skipped"
	@$(BIN)/python -c "import socket; socket.create_connection(('127.0.0.1', 6379), 1)" \
		2>/dev/null || echo "make test: no Redis on" \
		"127.0.0.1:6379: the cluster-scope tests will be skipped"
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist worksteal

# The property-based tests of tests/test_fuzz.py with FUZZ_EXAMPLES random examples each
# (the suite runs 300, always the same); prints what each saw. About 3 minutes.
FUZZ_EXAMPLES ?= 10000
fuzz: $(VENV)/.dev
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/python -m pytest -q -s -p no:cacheprovider --no-cov \
		-o timeout=3600 tests/test_fuzz.py

# Needs wrk (Debian: apt-get install -y wrk). About 20 minutes on 2 cores; bench-quick ~3.
bench: $(VENV)/.fast
	$(BIN)/python bench/run.py $(BENCH_ARGS)

bench-quick: $(VENV)/.fast
	$(BIN)/python bench/run.py --quick $(BENCH_ARGS)

# The streaming relay: added time to first byte and CPU per relayed event (~1 minute).
bench-stream: $(VENV)/.fast
	$(BIN)/python bench/stream.py $(BENCH_ARGS)

# 1,000 paced streams open at once through both routes, nginx (when installed) and
# LiteLLM's proxy (installed on first use into bench/.peers/): added time to first byte
# and per chunk, CPU per chunk, RSS per open stream (~10 minutes; not in CI).
bench-streams: $(VENV)/.fast
	$(BIN)/python bench/streams.py $(BENCH_ARGS)

# Optional, not in CI: LiteLLM, the Portkey gateway and nginx beside the sidecar and the
# pass-through in one run (installed on first use into bench/.peers/; ~10 minutes).
bench-peers: $(VENV)/.fast
	$(BIN)/python bench/peers.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .site .pytest_cache .mypy_cache .ruff_cache .coverage demo-audit.jsonl demo-serve-audit.jsonl
