"""Vault connection settings, login and the token renewer (the auth half of ``vault://``).

Three login methods, as the policy's ``secrets.vault.auth.method`` names them:

- ``token``: a token from ``VAULT_TOKEN`` or ``auth.token_file`` (re-read at each login,
  so a token rotated by Vault Agent is picked up);
- ``kubernetes``: the pod's service-account JWT from ``auth.jwt_path`` (re-read at each
  login: the kubelet rotates projected tokens) and ``auth.role``;
- ``approle``: ``role_id`` and ``secret_id`` from ``VAULT_ROLE_ID`` / ``VAULT_SECRET_ID``
  or ``auth.role_id_file`` / ``auth.secret_id_file``.

Environment variables override the policy, as Vault users expect of Vault's own tools:
``VAULT_ADDR``, ``VAULT_NAMESPACE``, ``VAULT_CACERT``, ``VAULT_SKIP_VERIFY``,
``VAULT_TOKEN``, ``VAULT_ROLE_ID``, ``VAULT_SECRET_ID``.

:class:`VaultAuth` keeps one token. A background task renews it when two thirds of its
lease have passed (the schedule of Vault's own ``LifetimeWatcher``); when renewal fails,
is capped by the token's max TTL, or the token was revoked, it logs in again. hvac is
synchronous (``requests``), so every call runs in :class:`BlockingRunner`'s small thread
pool, bounded by a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

import hvac
from hvac import exceptions as hvac_exc

from gateway.audit import get_logger
from gateway.policy import VaultSpec
from gateway.secrets.base import Secret

DEFAULT_VAULT_ADDR: Final = "https://127.0.0.1:8200"  # the default of Vault's own CLI
RENEW_FRACTION: Final = 2 / 3  # renew when this share of the lease has passed
MIN_RENEW_DELAY_S: Final = 0.1  # never spin on a lease of a few hundred ms
RETRY_BASE_S: Final = 0.5  # backoff after a failed renewal or login ...
RETRY_MAX_S: Final = 30.0  # ... doubling up to this
HVAC_WORKERS: Final = 4
_THREAD_TIMEOUT_MARGIN_S: Final = 0.25
_CLOSE_TIMEOUT_S: Final = 5.0  # let requests' own timeout fire first
_TRUE: Final = frozenset({"1", "t", "true"})  # Go's strconv.ParseBool, as Vault's CLI
_FALSE: Final = frozenset({"0", "f", "false"})

T = TypeVar("T")


def vault_log() -> Any:
    """The operational logger of the Vault resolver (structlog, via gateway.audit)."""
    # Looked up per call: gateway.audit.get_logger binds the structlog configuration in
    # force at call time, and audit.configure() may run after this module is imported.
    return get_logger("gateway.secrets.vault")


#: Vault answered, but cannot serve now: retry later rather than give up.
UNAVAILABLE_ERRORS: Final = (
    hvac_exc.InternalServerError,
    hvac_exc.VaultDown,
    hvac_exc.BadGateway,
    hvac_exc.RateLimitExceeded,
    hvac_exc.VaultNotInitialized,
    hvac_exc.UnexpectedError,
)


class VaultUnavailable(Exception):
    """Vault could not be reached in time (connection refused, reset, timeout)."""


class LoginRejected(Exception):
    """The sidecar could not log in: Vault refused the credentials or a file is missing.

    ``reason`` is machine-readable; the message names files and roles, never values.
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def _parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean (use true or false)")


@dataclass(frozen=True, slots=True)
class VaultSettings:
    """Where Vault is and how to log in, after applying the environment to the policy.

    ``verify`` is True, False or a CA bundle path (requests' ``verify``). Credential values
    given by environment are held as :class:`Secret`; files are read at each login.
    """

    address: str
    namespace: str | None
    verify: bool | str
    timeout_s: float
    method: str
    mount_path: str
    token: Secret | None = None
    token_file: str | None = None
    role: str | None = None
    jwt_path: str | None = None
    role_id: Secret | None = None
    role_id_file: str | None = None
    secret_id: Secret | None = None
    secret_id_file: str | None = None

    @classmethod
    def from_spec(cls, spec: VaultSpec, environ: Mapping[str, str]) -> VaultSettings:
        """Combine ``secrets.vault`` with ``VAULT_*`` variables (the environment wins).

        Raises ValueError naming the missing key or variable.
        """
        auth = spec.auth
        verify: bool | str = not spec.skip_verify
        if verify and spec.ca_cert:
            verify = spec.ca_cert
        if environ.get("VAULT_CACERT"):
            verify = environ["VAULT_CACERT"]
        if environ.get("VAULT_SKIP_VERIFY"):
            if _parse_bool("VAULT_SKIP_VERIFY", environ["VAULT_SKIP_VERIFY"]):
                verify = False
            elif verify is False:
                verify = True
        common: dict[str, Any] = {
            "address": (environ.get("VAULT_ADDR") or spec.address or DEFAULT_VAULT_ADDR).rstrip(
                "/"
            ),
            "namespace": environ.get("VAULT_NAMESPACE") or spec.namespace or None,
            "verify": verify,
            "timeout_s": spec.timeout_s,
            "method": auth.method,
            "mount_path": (auth.mount_path or auth.method).strip("/"),
        }
        if auth.method == "token":
            token = environ.get("VAULT_TOKEN")
            if not token and not auth.token_file:
                raise ValueError(
                    "secrets.vault.auth: method 'token' needs VAULT_TOKEN in the sidecar's "
                    "environment or auth.token_file"
                )
            if token:
                return cls(**common, token=Secret(token))
            return cls(**common, token_file=auth.token_file)
        if auth.method == "kubernetes":
            return cls(**common, role=auth.role, jwt_path=auth.jwt_path)
        role_id = environ.get("VAULT_ROLE_ID")
        secret_id = environ.get("VAULT_SECRET_ID")
        if not role_id and not auth.role_id_file:
            raise ValueError(
                "secrets.vault.auth: method 'approle' needs VAULT_ROLE_ID or auth.role_id_file"
            )
        return cls(
            **common,
            role_id=Secret(role_id) if role_id else None,
            role_id_file=None if role_id else auth.role_id_file,
            secret_id=Secret(secret_id) if secret_id else None,
            secret_id_file=None if secret_id else auth.secret_id_file,
        )

    def new_client(self) -> Any:
        """An hvac client without a token (hvac would otherwise read ``~/.vault-token``)."""
        return hvac.Client(
            url=self.address,
            token="",
            verify=self.verify,
            timeout=self.timeout_s,
            namespace=self.namespace,
        )


class BlockingRunner:
    """Runs blocking hvac calls in a small dedicated thread pool, bounded by a timeout.

    A dedicated pool keeps a hung Vault from starving ``asyncio.to_thread`` users.
    Transport failures (requests' exceptions are ``OSError``\\ s) and the timeout become
    :class:`VaultUnavailable`; Vault's HTTP errors pass through as hvac exceptions.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._executor = ThreadPoolExecutor(HVAC_WORKERS, thread_name_prefix="vault-hvac")
        # Calls queue here, not in the executor, so the timeout measures Vault's time only.
        self._slots = asyncio.Semaphore(HVAC_WORKERS)

    async def __call__(self, fn: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        try:
            async with self._slots, asyncio.timeout(self.timeout_s + _THREAD_TIMEOUT_MARGIN_S):
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a
                # cancellation that races with completion (gh-86296).
                return await loop.run_in_executor(self._executor, fn)
        except TimeoutError:
            raise VaultUnavailable(f"no answer within {self.timeout_s:g} s") from None
        except OSError as exc:
            raise VaultUnavailable(type(exc).__name__) from exc

    def close(self) -> None:
        # Threads still inside requests end at requests' own timeout.
        self._executor.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True, slots=True)
class TokenLease:
    """The current token. ``lease_s`` 0 means it never expires (e.g. a root token);
    ``obtained_at`` is ``time.monotonic()`` when Vault stated the lease."""

    token: Secret
    lease_s: float
    renewable: bool
    obtained_at: float

    @property
    def renew_at(self) -> float:
        return self.obtained_at + max(self.lease_s * RENEW_FRACTION, MIN_RENEW_DELAY_S)

    def valid(self, now: float) -> bool:
        return self.lease_s <= 0 or now < self.obtained_at + self.lease_s


def _read_file(path: str, what: str) -> Secret:
    try:
        value = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise LoginRejected(
            f"cannot read the Vault {what} file {path} ({exc.strerror})", "credential_file_missing"
        ) from None
    if not value:
        raise LoginRejected(f"the Vault {what} file {path} is empty", "credential_file_empty")
    return Secret(value)


class VaultAuth:
    """Owns the sidecar's Vault token: login, renewal in the background, re-login.

    ``client`` is the hvac client the resolver reads with; this class sets its token.
    ``generation`` counts successful logins, so that callers who saw a 403 can tell
    whether someone else already replaced the token.
    """

    def __init__(self, settings: VaultSettings, client: Any, run: BlockingRunner) -> None:
        self._settings = settings
        self._client = client
        self._login_client = settings.new_client()
        self._run = run
        self._lease: TokenLease | None = None
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._retry_at: float | None = None
        self._last_error: Exception | None = None
        self._failures = 0
        self._task: asyncio.Task[None] | None = None
        self.generation = 0

    def ready(self) -> bool:
        """True while the sidecar holds a token that has not expired or been rejected."""
        return self._lease is not None and self._lease.valid(time.monotonic())

    async def start(self) -> None:
        """Log in once and start the renewer. A failed login is logged, not raised: the
        renewer retries with backoff and ``ready()`` stays False meanwhile."""
        if self._task is not None:
            return
        with contextlib.suppress(VaultUnavailable, LoginRejected):
            await self.login()  # a failure is logged and scheduled for retry
        self._task = asyncio.create_task(self._renew_forever(), name="vault-token-renewer")

    async def aclose(self) -> None:
        """Stop the renewer (idempotent). The token is left to expire on its own."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=_CLOSE_TIMEOUT_S)
            if not done:  # never wait forever at shutdown
                vault_log().warning("vault_renewer_did_not_stop")
        self._login_client.adapter.close()

    async def ensure_token(self) -> int:
        """Log in unless a valid token is held; returns the token's ``generation``.

        Raises VaultUnavailable or LoginRejected; while a failed login is backing off,
        raises its error again without asking Vault (calls must not each log in).
        """
        if not self.ready():
            self._raise_if_backing_off()
            async with self._lock:
                if not self.ready():
                    self._raise_if_backing_off()
                    await self._login_locked()
        return self.generation

    async def login(self) -> None:
        """Obtain a new token now. Raises VaultUnavailable or LoginRejected."""
        async with self._lock:
            await self._login_locked()

    async def recover(self, generation: int) -> bool:
        """After a read got 403 with token ``generation``: True if the read should be
        retried with a new token, False if the token is fine and the 403 is a real denial.
        """
        async with self._lock:
            if self.generation != generation:
                return True
            if self._lease is None:
                self._raise_if_backing_off()  # another caller's re-login just failed
            try:
                await self._run(self._client.auth.token.lookup_self)
                return False
            except hvac_exc.Forbidden:
                vault_log().warning("vault_token_rejected", auth_method=self._settings.method)
            self._lease = None
            await self._login_locked()
            return True

    # --- login ---------------------------------------------------------------------

    async def _login_locked(self) -> None:
        try:
            try:
                lease = await self._run(self._login_sync)
            except hvac_exc.VaultError as exc:
                status = type(exc).__name__
                if isinstance(exc, UNAVAILABLE_ERRORS):
                    raise VaultUnavailable(f"login failed: {status}") from exc
                raise LoginRejected(
                    f"Vault refused the {self._settings.method} login at auth/"
                    f"{self._settings.mount_path} ({status})",
                    "vault_login_rejected",
                ) from exc
        except (VaultUnavailable, LoginRejected) as exc:
            self._schedule_retry(exc)
            raise
        self._lease = lease
        self.generation += 1
        self._retry_at = None
        self._last_error = None
        self._failures = 0
        self._wake.set()
        vault_log().info(
            "vault_login",
            auth_method=self._settings.method,
            lease_s=lease.lease_s,
            renewable=lease.renewable,
        )

    def _login_sync(self) -> TokenLease:
        s = self._settings
        if s.method == "token":
            token = s.token or _read_file(s.token_file or "", "token")
            self._client.token = token.reveal()
            try:
                data = self._client.auth.token.lookup_self()["data"]
            except hvac_exc.Forbidden:
                raise LoginRejected(
                    "the Vault token "
                    + (f"in {s.token_file}" if s.token_file else "in VAULT_TOKEN")
                    + " is invalid, expired or revoked",
                    "vault_token_invalid",
                ) from None
            return TokenLease(
                token, float(data.get("ttl") or 0), bool(data.get("renewable")), time.monotonic()
            )
        if s.method == "kubernetes":
            jwt = _read_file(s.jwt_path or "", "service-account JWT")
            resp = self._login_client.auth.kubernetes.login(
                s.role, jwt.reveal(), use_token=False, mount_point=s.mount_path
            )
        else:
            role_id = s.role_id or _read_file(s.role_id_file or "", "AppRole role_id")
            secret_id = s.secret_id
            if secret_id is None and s.secret_id_file:
                secret_id = _read_file(s.secret_id_file, "AppRole secret_id")
            resp = self._login_client.auth.approle.login(
                role_id.reveal(),
                secret_id.reveal() if secret_id else None,
                use_token=False,
                mount_point=s.mount_path,
            )
        auth = resp["auth"]
        token = Secret(auth["client_token"])
        self._client.token = token.reveal()
        return TokenLease(
            token,
            float(auth.get("lease_duration") or 0),
            bool(auth.get("renewable")),
            time.monotonic(),
        )

    # --- renewal -------------------------------------------------------------------

    def _due_in(self) -> float | None:
        """Seconds until the renewer must act; None when the token never expires."""
        now = time.monotonic()
        if self._retry_at is not None:
            return max(self._retry_at - now, 0.0)
        if self._lease is None:
            return 0.0
        if self._lease.lease_s <= 0:
            return None
        return max(self._lease.renew_at - now, 0.0)

    async def _renew_forever(self) -> None:
        while True:
            due = self._due_in()
            if due is None or due > 0:
                # A login elsewhere sets _wake: recompute the schedule for the new token.
                self._wake.clear()
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow the
                # cancellation of aclose() when _wake is set at the same moment (gh-86296),
                # and this loop would then never end.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(due):
                        await self._wake.wait()
                continue
            try:
                await self._renew_or_login()
            except (VaultUnavailable, LoginRejected):
                pass  # logged and scheduled for retry where it happened
            except Exception as exc:  # noqa: BLE001 - a dead renewer means an outage later
                vault_log().error("vault_renewer_error", exc_info=True)
                self._schedule_retry(exc)

    async def _renew_or_login(self) -> None:
        lease = self._lease
        if lease is None or not lease.renewable:
            await self.login()
            return
        try:
            resp = await self._run(self._client.auth.token.renew_self)
        except VaultUnavailable as exc:
            self._schedule_retry(exc)
            raise
        except hvac_exc.VaultError as exc:
            # 403: revoked or expired; 500 "past the max TTL": cannot be extended.
            vault_log().warning("vault_renew_failed", error=type(exc).__name__)
            await self.login()
            return
        auth = resp.get("auth") or {}
        new_lease = float(auth.get("lease_duration") or 0)
        if new_lease < lease.lease_s or not auth.get("renewable"):
            # Capped by the token's max TTL: a fresh login now beats a token that ends
            # mid-call later.
            await self.login()
            return
        async with self._lock:
            if self._lease is lease:
                self._lease = TokenLease(lease.token, new_lease, True, time.monotonic())
        self._retry_at = None
        self._failures = 0
        vault_log().info("vault_token_renewed", lease_s=new_lease)

    def _raise_if_backing_off(self) -> None:
        error = self._last_error
        if error is None or self._retry_at is None or time.monotonic() >= self._retry_at:
            return
        if isinstance(error, LoginRejected):
            raise LoginRejected(str(error), error.reason)
        raise VaultUnavailable(f"{error}; retrying the login in the background")

    def _schedule_retry(self, exc: Exception) -> None:
        self._last_error = exc
        self._failures += 1
        delay = min(RETRY_BASE_S * 2 ** (self._failures - 1), RETRY_MAX_S)
        if self._lease is not None and self._lease.valid(time.monotonic()):
            delay = min(delay, max(self._lease.lease_s / 10, MIN_RENEW_DELAY_S))
        self._retry_at = time.monotonic() + delay
        vault_log().warning(
            "vault_login_failed",
            auth_method=self._settings.method,
            reason=getattr(exc, "reason", "vault_unavailable"),
            error=str(exc),
            retry_in_s=round(delay, 3),
        )
