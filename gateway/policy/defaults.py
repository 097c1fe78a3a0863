"""The policy's defaults and bounds, in one place: every optional key's default, and every
number's upper (and a few lower) bounds with their reasons. Units are in the names.
:mod:`gateway.policy.models` applies them; docs/reference/policy-format.md lists them.
"""

from __future__ import annotations

from typing import Final

from gateway.envelope import MAX_RETRIES_LIMIT, MAX_TIMEOUT_S

# Defaults.
DEFAULT_HOST: Final = "127.0.0.1"
DEFAULT_PORT: Final = 8181
DEFAULT_OPS_PORT: Final = 8182
DEFAULT_MAX_REQUEST_BYTES: Final = 8 * 1024 * 1024
DEFAULT_MAX_RESPONSE_BYTES: Final = 32 * 1024 * 1024
#: What the request bodies in flight may hold in memory, in bytes of their charge
#: (gateway.api.admission.held_bytes: 6x a body's bytes, more for dense JSON): three
#: 8 MiB prompts at once. With the idle RSS (~64 MiB) it makes the ceiling the Helm
#: chart's memory limit is drawn from (docs/performance.md).
DEFAULT_MAX_INFLIGHT_REQUEST_BYTES: Final = 160 * 1024 * 1024
#: Below this, a few ordinary calls at once would already be refused.
MIN_INFLIGHT_REQUEST_BYTES: Final = 1024 * 1024
#: Bound of server.max_inflight_request_bytes (gateway.api.admission): sixteen bodies
#: of the largest max_request_bytes (1 GiB) at once.
MAX_INFLIGHT_BYTES: Final = 16 * 1024 * 1024 * 1024
DEFAULT_DRAIN_S: Final = 20.0
#: SIGTERM beside a live agent: keep serving new calls while draining (the chart's
#: regular-container mode, where the agent gets SIGTERM at the same moment).
DEFAULT_SHUTDOWN_ACCEPT_NEW_CALLS: Final = True
#: Seconds with nothing in flight and no new call after which a draining sidecar exits.
DEFAULT_SHUTDOWN_QUIET_S: Final = 1.0
#: A quiet period longer than a minute would only keep a terminated pod around.
MAX_SHUTDOWN_QUIET_S: Final = 60.0
DEFAULT_RELOAD_INTERVAL_S: Final = 2.0
DEFAULT_TARGET_TIMEOUT_S: Final = 30.0
#: Longest gap between two chunks of a relayed stream.
DEFAULT_STREAM_IDLE_TIMEOUT_S: Final = 60.0
#: Connections one target may hold open at once (each call or open stream holds one).
#: Above what one sidecar process serves (about 1,000-2,000 open paced streams on a core,
#: docs/performance.md "Round three"; each also holds an inbound socket), so by default
#: the inbound side, not this pool, is the limit; a policy lowers it to spare an upstream.
DEFAULT_MAX_CONNECTIONS: Final = 4096
#: A process's file descriptors bound its connections long before this.
MAX_MAX_CONNECTIONS: Final = 1_000_000
#: How long a call waits for one of its target's connections once all are busy, before
#: CAPACITY_EXCEEDED (``details.reason`` "connection_pool_full"); never a silent queue.
DEFAULT_CONNECTION_WAIT_S: Final = 5.0
DEFAULT_RETRY_ON: Final = (429, 500, 502, 503, 504, 529, "timeout", "connect")
DEFAULT_BACKOFF_BASE_S: Final = 0.5
DEFAULT_BACKOFF_MAX_S: Final = 20.0
DEFAULT_POLICY_MAX_RETRIES: Final = 3
DEFAULT_FAIL_MAX: Final = 5
DEFAULT_RESET_TIMEOUT_S: Final = 30.0
DEFAULT_MAX_QUEUE_S: Final = 5.0
DEFAULT_IDEMPOTENCY_TTL_S: Final = 86400.0
#: Bounds of the in-memory idempotency store. An entry costs about 1.4 kB plus its
#: answer beyond ~700 bytes; with 5,000 a sidecar with the benchmark's policy stays at
#: about 65 MiB resident (docs/performance.md, "Memory"); the byte bound caps the store
#: when answers are large.
DEFAULT_IDEMPOTENCY_MAX_ENTRIES: Final = 5_000
DEFAULT_IDEMPOTENCY_MAX_BYTES: Final = 64 * 1024 * 1024
DEFAULT_VAULT_CACHE_TTL_S: Final = 300.0
DEFAULT_VAULT_STALE_IF_ERROR_S: Final = 3600.0
DEFAULT_VAULT_TIMEOUT_S: Final = 5.0
DEFAULT_K8S_JWT_PATH: Final = "/var/run/secrets/kubernetes.io/serviceaccount/token"
DEFAULT_REDIS_TIMEOUT_S: Final = 2.0

# Bounds, in one place, each with its reason: what the runtime can honour, or past which
# a setting no longer means what it says. (Counts and sizes are Python ints and durations
# floats, so arithmetic never overflows; the bounds keep values inside what asyncio's
# clock, Redis and the pod can do.)
#: One wait of the sidecar's own (an attempt, the drain, a breaker's open time, the
#: reload interval): an hour. A call is bounded by its envelope ``timeout`` anyway (at
#: most ``MAX_TIMEOUT_S``, 600 s) and the drain by the pod's termination grace period.
MAX_WAIT_S: Final = 3600.0
#: Waits inside one call (queueing for a rate-limit group, the longest backoff): a call
#: never waits past its deadline, which is at most the envelope's ``MAX_TIMEOUT_S``.
MAX_CALL_WAIT_S: Final = MAX_TIMEOUT_S
#: The first backoff step: a retry later than a minute is no longer a retry of the call.
MAX_BACKOFF_BASE_S: Final = 60.0
#: Retries of one call: the envelope's own cap (``MAX_RETRIES_LIMIT``), so both agree.
MAX_POLICY_MAX_RETRIES: Final = MAX_RETRIES_LIMIT
#: Failed attempts before a breaker opens: past a thousand a breaker never opens in time.
MAX_FAIL_MAX: Final = 1000
#: Idempotency answers kept: a month. Past any provider's own key retention (Stripe keeps
#: keys at least 24 hours), and far inside Redis's expiry range (milliseconds, int64).
MAX_IDEMPOTENCY_TTL_S: Final = 30 * 86400.0
#: A Vault secret cached as fresh: a day, so a rotated secret reaches the sidecar daily
#: at the latest (the lease Vault gives shortens it further).
MAX_VAULT_CACHE_TTL_S: Final = 86400.0
#: An expired cached secret served while Vault is down: a week rides out a weekend's
#: outage; longer keeps a possibly revoked secret in use indefinitely.
MAX_VAULT_STALE_IF_ERROR_S: Final = 7 * 86400.0
#: One Vault request: hvac blocks a worker thread (of a small pool) that long.
MAX_VAULT_TIMEOUT_S: Final = 120.0
#: Redis connect and socket timeouts: a Redis that has not answered in a minute is down,
#: and ``on_redis_error`` (fail open or closed) should decide, not the wait.
MAX_REDIS_TIMEOUT_S: Final = 60.0
MAX_REDIS_POOL_SIZE: Final = 10_000
#: Envelope and upstream bodies are held whole in memory (parsed, hashed, stored for
#: replay): past a GiB the pod's memory limit, not the policy, would decide.
MAX_BODY_BYTES: Final = 1024 * 1024 * 1024
#: The in-memory idempotency store lives in the sidecar's heap; more than 16 GiB is more
#: than any sidecar's memory limit. Entries: ~1.4 kB each, so 10 M is 14 GB.
MAX_IDEMPOTENCY_STORE_BYTES: Final = 16 * 1024 * 1024 * 1024
MAX_IDEMPOTENCY_ENTRIES: Final = 10_000_000
#: Rate-limit groups. The cluster limiter books a bucket as an instant in integer
#: microseconds inside Redis's Lua, whose numbers are doubles (exact below 2**53, about
#: 9.0e15; now is about 1.8e15): with at most ``MAX_BURST`` calls and at least
#: ``MIN_REQUESTS_PER_SECOND``, a bucket is at most 1e14 us (~3 years) deep.
MIN_REQUESTS_PER_SECOND: Final = 0.001
MAX_REQUESTS_PER_SECOND: Final = 100_000.0
MAX_BURST: Final = 100_000
#: A trillion tokens a minute: no provider sells a tier near it, and the local token
#: bucket (a float level) still counts single tokens exactly (below 2**53).
MAX_TOKENS_PER_MINUTE: Final = 10**12
#: An audit file's rotation size is compared with a file offset, an int64 (``off_t``).
MAX_AUDIT_FILE_BYTES: Final = 2**63 - 1
MAX_AUDIT_BACKUPS: Final = 1000
#: audit.otlp (docs/audit.md): seconds per export request; the spool's bound in bytes
#: (32 MiB: 10 minutes at ~35 records/s of 1.5 KB), at least one segment (1 MiB), at
#: most what a file offset counts.
DEFAULT_AUDIT_OTLP_TIMEOUT_S: Final = 10.0
MAX_AUDIT_OTLP_TIMEOUT_S: Final = 60.0
DEFAULT_AUDIT_SPOOL_BYTES: Final = 32 * 1024 * 1024
MIN_AUDIT_SPOOL_BYTES: Final = 1024 * 1024
MAX_AUDIT_SPOOL_BYTES: Final = 2**63 - 1
DEFAULT_AUDIT_SPOOL_PATH: Final = "/tmp/egress-gateway/audit-spool"  # noqa: S108 - the pod's /tmp
#: Telemetry (docs/operations.md). A ratio is a probability; a model label list longer
#: than this is a cardinality problem, not a dashboard.
DEFAULT_TRACE_SAMPLE_RATIO: Final = 1.0
MAX_TRACE_SAMPLE_RATIO: Final = 1.0
MAX_TELEMETRY_MODELS: Final = 200
DEFAULT_SERVICE_NAME: Final = "egress-gateway"
#: Budgets and prices. Spend is counted in integer nano-USD inside Redis's Lua (doubles,
#: exact below 2**53 ~ 9.0e15 nano-USD = 9 M USD), so a budget stays below that.
MAX_BUDGET_USD: Final = 1_000_000.0
#: A rolling window longer than a year is a monthly budget's job; shorter than a minute
#: (1-second buckets) is a rate limit's.
MIN_BUDGET_PER_HOURS: Final = 1 / 60
MAX_BUDGET_PER_HOURS: Final = 24.0 * 366
#: No model is sold at 100k USD per million tokens.
MAX_USD_PER_MTOK: Final = 100_000.0
#: MCP argument rules (gateway/policy/mcp.py). A string argument cannot be longer than
#: the request that carries it; a number bound is kept where JSON numbers are exact in
#: every implementation (doubles: below 2**53, RFC 8259 section 6), with room to spare.
MAX_ARGUMENT_LENGTH: Final = MAX_BODY_BYTES
MAX_ARGUMENT_NUMBER: Final = 10.0**15

#: Agents (gateway/policy/agents.py): the largest UID Linux gives a process ((uid_t)-1
#: means "no UID"), and the agents one policy may list (a pod's few containers, with
#: room to spare).
MAX_AGENT_UID: Final = 2**32 - 2
MAX_AGENTS: Final = 64
#: Entries of one ``models.allow`` or ``models.pin`` (a policy lists models, not a catalogue).
MAX_MODEL_RULES: Final = 256
#: The call chain (gateway/policy/chain.py, design.md "Agents calling agents"). Depth is
#: the number of agents in the chain, this one included: 8 covers a planner, its
#: executors and their tools' agents with room to spare; a longer chain is a loop or a
#: runaway. The chain header carries at most 64 ids (``gateway.agents.chain``).
DEFAULT_CHAIN_MAX_DEPTH: Final = 8
MAX_CHAIN_MAX_DEPTH: Final = 64
#: A chain's life from its origin: 15 minutes covers a multi-step task of LLM calls
#: (each call at most ``MAX_TIMEOUT_S``); past a day a chain is no longer one piece of work.
DEFAULT_CHAIN_TTL_S: Final = 900.0
MAX_CHAIN_TTL_S: Final = 86400.0
#: How far a received ``x-egress-deadline`` may lie beyond this sidecar's own
#: ``now + ttl_s`` (clocks of two hosts differ by that much at most under NTP) before it
#: is refused as far future.
DEFAULT_CHAIN_CLOCK_SKEW_S: Final = 5.0
MAX_CHAIN_CLOCK_SKEW_S: Final = 300.0
#: Stopping a runaway agent (gateway/policy/controls.py). A cluster stop is read from
#: Redis at least this often (seconds) besides its published notice, so that a sidecar
#: that missed the notice (a dropped subscription) still obeys within the 2 s
#: docs/features/stopping.md promises; faster than 0.05 s is load on Redis, slower than
#: 1.5 s breaks the promise.
DEFAULT_STOP_POLL_INTERVAL_S: Final = 0.5
MIN_STOP_POLL_INTERVAL_S: Final = 0.05
MAX_STOP_POLL_INTERVAL_S: Final = 1.5
#: The repeated-call breaker keeps one timestamp per repeat: a bound on memory and on
#: the Redis list; a window past a day is a budget's job.
MAX_REPEATS: Final = 10_000
MAX_REPEAT_WINDOW_S: Final = 86_400.0
MAX_REPEAT_EXEMPT: Final = 200
#: A tool cap (a budget's ``max_calls``) is counted like spend, in integer nano-units
#: inside Redis's Lua (exact below 2**53): the same bound as MAX_BUDGET_USD.
MAX_BUDGET_CALLS: Final = 1_000_000
#: Database targets (gateway/policy/database.py). A pool of 4 serves one agent's calls
#: (they come one at a time, a few at once); 100 is past what a database gives one
#: client. A pool wait of 2 s, then CAPACITY_EXCEEDED. A connection lives 5 minutes at
#: most, well inside a Vault lease (1 hour by default). A statement runs 5 s and waits
#: 1 s for a lock by default (an agent waits on it). 1,000 rows and 1 MiB of JSON answer
#: a question; a million rows is an export, not a call.
DEFAULT_DB_POOL_SIZE: Final = 4
MAX_DB_POOL_SIZE: Final = 100
DEFAULT_DB_ACQUIRE_TIMEOUT_S: Final = 2.0
DEFAULT_DB_MAX_LIFETIME_S: Final = 300.0
DEFAULT_DB_STATEMENT_TIMEOUT_S: Final = 5.0
DEFAULT_DB_LOCK_TIMEOUT_S: Final = 1.0
DEFAULT_DB_MAX_ROWS: Final = 1000
MAX_DB_MAX_ROWS: Final = 1_000_000
DEFAULT_DB_MAX_BYTES: Final = 1024 * 1024
MIN_DB_MAX_BYTES: Final = 1024
MAX_DB_AFFECTED_ROWS: Final = 10**9

# -- the operator's desk: approvals and dead letters (gateway.policy.desk) --------------
#: How long an approval request waits for a decision, and an approval for its call, s.
DEFAULT_APPROVAL_TTL_S: Final = 900.0
MAX_APPROVAL_TTL_S: Final = 7 * 86400.0
#: ``suggested_retry_after`` of APPROVAL_PENDING, seconds.
DEFAULT_APPROVAL_RETRY_AFTER_S: Final = 5.0
#: Dead letters kept per sidecar (count, and bytes of their stored requests).
DEFAULT_DEAD_LETTERS_MAX_COUNT: Final = 1000
MAX_DEAD_LETTERS_MAX_COUNT: Final = 100_000
DEFAULT_DEAD_LETTERS_MAX_BYTES: Final = 16 * 1024 * 1024
MAX_DEAD_LETTERS_MAX_BYTES: Final = 1024 * 1024 * 1024
