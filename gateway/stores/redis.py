"""The Redis client for cluster scope: the only module that imports redis-py.

One :class:`RedisClient` per process, built from the policy's ``redis:`` section
(:class:`gateway.policy.RedisSpec`): the redis-py asyncio client over a
``BlockingConnectionPool`` of ``redis.pool_size`` connections (the default pool raises
"Too many connections" under load instead of waiting), with ``redis.connect_timeout_s``
and ``redis.socket_timeout_s`` on every socket. ``REDIS_URL`` in the environment, read
once at start-up, overrides ``redis.url``, as Redis users expect.

Everything the stores do is a Lua script (:meth:`RedisClient.script`), run with EVALSHA:
one round trip per operation, atomic on the server. A script unknown to the server (after
a Redis restart) is loaded again by redis-py transparently (one extra SCRIPT LOAD).

Failures: any error of the client (refused or dropped connection, timeout, an error reply
such as ``OOM`` or ``LOADING``) becomes :class:`RedisUnavailable`, whose message names
the server by host, port and database only (never the URL's password). Each operation is
bounded by ``connect_timeout_s + socket_timeout_s`` in total; a dropped connection is
retried once at once on a fresh connection (so the first call after a Redis restart does
not fail on a stale pooled connection), and nothing else is retried: the callers decide
what an outage means (fall back, refuse). After a failure, operations fail at once for
``FAIL_FAST_S`` (0.5 s) instead of each waiting for its own timeout (a Redis that drops
packets would otherwise add the timeout to every call); the first operation after that
tries Redis again, and the pool reconnects by itself when Redis is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, Final, Literal
from urllib.parse import unquote, urlsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from gateway import redaction
from gateway.audit import get_logger
from gateway.policy import RedisSpec

__all__ = [
    "FAIL_FAST_S",
    "REDIS_URL_ENV",
    "RedisClient",
    "RedisState",
    "RedisUnavailable",
    "Script",
    "Subscription",
    "redis_url",
]

#: Environment variable that overrides ``redis.url`` (read once, at start-up).
REDIS_URL_ENV: Final = "REDIS_URL"
#: After a failed operation, the next ones fail at once for this long (seconds).
FAIL_FAST_S: Final = 0.5
#: Characters of a client error message kept in :class:`RedisUnavailable` (they are short).
_MAX_DETAIL: Final = 200

RedisState = Literal["unused", "ok", "unavailable"]
_log = get_logger("gateway.stores.redis")


class RedisUnavailable(Exception):
    """Redis could not be reached, did not answer in time, or answered with an error.

    The message names the server (``host:port/db``) and the client's error class, never a
    credential.
    """


def redis_url(spec: RedisSpec, environ: Mapping[str, str] | None = None) -> str:
    """The URL to connect to: ``$REDIS_URL`` if set and non-empty, else ``spec.url``."""
    env = os.environ if environ is None else environ
    return env.get(REDIS_URL_ENV) or spec.url


def _label(url: str) -> str:
    """``redis://host:port/db`` without user, password or query (for messages and logs)."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return f"unix:{parts.path}"
    return f"{parts.scheme}://{parts.hostname}:{parts.port or 6379}{parts.path or '/0'}"


class RedisClient:
    """A pooled redis-py asyncio client with bounded, translated operations.

    ``prefix`` (``redis.key_prefix``) starts every key; sidecars share state exactly when
    they share the Redis server, database and prefix. Raises ValueError (without echoing
    the URL) when the URL is not a ``redis://``, ``rediss://`` or ``unix://`` URL.
    """

    def __init__(self, spec: RedisSpec, *, url: str | None = None) -> None:
        url = url or redis_url(spec)
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(
                "redis.url (or REDIS_URL) must be a redis://, rediss:// or unix:// URL"
            )
        if parts.password:
            redaction.register(unquote(parts.password))
        self.prefix = spec.key_prefix
        self.label = _label(url)
        #: Bound on one operation (pool wait, connect, command and its one retry), seconds.
        self.op_timeout_s = spec.connect_timeout_s + spec.socket_timeout_s
        try:
            pool = BlockingConnectionPool.from_url(
                url,
                max_connections=spec.pool_size,
                timeout=self.op_timeout_s,
                socket_timeout=spec.socket_timeout_s,
                socket_connect_timeout=spec.connect_timeout_s,
                retry=Retry(NoBackoff(), 1),
            )
        except ValueError:
            raise ValueError("redis.url (or REDIS_URL) is not a valid Redis URL") from None
        self._redis = Redis.from_pool(pool)
        self._state: RedisState = "unused"
        self._closed = False
        self._failed: tuple[float, str] | None = None  # (loop time, message) of the last failure

    @property
    def state(self) -> RedisState:
        """``unused`` (no operation yet), ``ok`` or ``unavailable``: the last outcome."""
        return self._state

    def key(self, *parts: str) -> str:
        """``prefix:part1:part2...``."""
        return ":".join((self.prefix, *parts))

    def script(self, source: str) -> Script:
        """A Lua script to run on this client (see :class:`Script`)."""
        return Script(self, source)

    def subscription(self, channel: str) -> Subscription:
        """A pub/sub subscription to ``channel`` (a full key, see :meth:`key`)."""
        return Subscription(self, channel)

    async def ping(self) -> None:
        """One PING. Raises :class:`RedisUnavailable`."""
        await self.run(self._redis.ping())

    async def run(self, operation: Awaitable[Any]) -> Any:
        """Await one redis-py operation within :attr:`op_timeout_s`; its result.

        Raises :class:`RedisUnavailable` for any client error or the timeout, and at once
        within ``FAIL_FAST_S`` of the last failure. The state changes (ok <->
        unavailable) are logged once each, not per call.
        """
        loop = asyncio.get_running_loop()
        if self._failed is not None and loop.time() - self._failed[0] < FAIL_FAST_S:
            if asyncio.iscoroutine(operation):
                operation.close()  # never started: no "never awaited" warning
            raise RedisUnavailable(self._failed[1])
        try:
            async with asyncio.timeout(self.op_timeout_s):
                result = await operation
        except (RedisError, OSError, TimeoutError) as exc:
            if isinstance(exc, TimeoutError) and not isinstance(exc, RedisError):
                detail = f"no answer within {self.op_timeout_s:g} s"
            else:
                text = redaction.scrub(str(exc))[:_MAX_DETAIL]
                detail = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
            self._set_state("unavailable", detail)
            message = f"Redis at {self.label} is unavailable ({detail})"
            self._failed = (loop.time(), message)
            raise RedisUnavailable(message) from None
        self._failed = None
        self._set_state("ok", None)
        return result

    def _set_state(self, state: RedisState, detail: str | None) -> None:
        if state == self._state:
            return
        previous, self._state = self._state, state
        if state == "unavailable":
            _log.warning("redis_unavailable", redis=self.label, error=detail)
        elif previous == "unavailable":
            _log.info("redis_recovered", redis=self.label)

    async def aclose(self) -> None:
        """Close the pool's connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._redis.aclose()

    def __repr__(self) -> str:
        return f"RedisClient({self.label!r}, prefix={self.prefix!r})"


class Script:
    """A Lua script run with EVALSHA (loaded on first use or when the server lost it)."""

    def __init__(self, client: RedisClient, source: str) -> None:
        self._client = client
        self._script = client._redis.register_script(source)

    async def __call__(self, keys: Sequence[str], args: Sequence[str | int | float | bytes]) -> Any:
        """Run the script with ``keys`` (KEYS) and ``args`` (ARGV); its reply (bytes for
        strings, int for numbers, lists). Raises :class:`RedisUnavailable`."""
        return await self._client.run(self._script(keys=list(keys), args=list(args)))


class Subscription:
    """A subscription to one pub/sub channel, on a connection of its own taken from the
    pool (SUBSCRIBE holds it). Messages are notices only: a subscriber that was
    disconnected misses what was published meanwhile, so the callers read the stored
    state again after each wait (the stop switch polls as well)."""

    def __init__(self, client: RedisClient, channel: str) -> None:
        self._client = client
        self._channel = channel
        self._pubsub = client._redis.pubsub()
        self._subscribed = False

    async def wait(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` seconds for a message on the channel (subscribing
        first, once); True when one came. Raises :class:`RedisUnavailable`; the
        subscription is then dropped and the next wait subscribes again."""
        try:
            if not self._subscribed:
                await self._client.run(self._pubsub.subscribe(self._channel))
                self._subscribed = True
            # The wait is the timeout itself: not through run(), whose bound is shorter.
            message = await self._pubsub.get_message(
                ignore_subscribe_messages=True, timeout=timeout_s
            )
        except (RedisError, OSError) as exc:
            await self._reset()
            raise RedisUnavailable(f"Redis at {self._client.label}: {type(exc).__name__}") from None
        except RedisUnavailable:
            await self._reset()
            raise
        return message is not None

    async def _reset(self) -> None:
        self._subscribed = False
        with contextlib.suppress(RedisError, OSError):  # the connection is gone already
            await self._pubsub.aclose()  # type: ignore[no-untyped-call]
        self._pubsub = self._client._redis.pubsub()

    async def aclose(self) -> None:
        """Unsubscribe and give the connection back. Idempotent."""
        with contextlib.suppress(RedisError, OSError):  # a dead connection needs no goodbye
            await self._pubsub.aclose()  # type: ignore[no-untyped-call]
