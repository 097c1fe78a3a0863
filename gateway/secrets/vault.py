"""``vault://PATH[#FIELD]`` references: HashiCorp Vault (or OpenBao) KV v1 / KV v2 secrets.

Where a reference points (no ``sys/mounts`` probing: ordinary agent tokens may not read
it, see hvac#855 and vault-mcp-server#98)::

    secrets.vault.refs[REF]  -> that mount, KV version, path and field (REF is the ref as
                                written, e.g. "vault://openai-key", or its PATH)
    otherwise                -> PATH on kv_mount with kv_version; FIELD from the ref

    KV v2: GET /v1/{mount}/data/{path}     KV v1: GET /v1/{mount}/{path}

A secret with one field needs no ``#FIELD`` (on KV v1 the ``ttl`` lease hint does not
count as a field). Errors name the reference and the Vault path, never a value:

    404                       SecretNotFound  reason secret_missing
    deleted/destroyed (KV v2) SecretNotFound  reason version_deleted
    field absent              SecretNotFound  reason field_missing (lists field names)
    403 (token is valid)      SecretAccessDenied  reason vault_forbidden
    login refused             SecretAccessDenied  reason vault_login_rejected, ...
    unreachable/5xx/timeout   SecretBackendUnavailable (DEPENDENCY_FAILED, retryable)

Values are cached per reference for ``cache_ttl_s``, never longer than the lease Vault
states; concurrent first reads share one Vault request (single flight). While Vault is
unavailable, an expired value is served for up to ``stale_if_error_s`` more, with a
warning for the audit record. A 403 caused by an expired or revoked token triggers one
re-login and one retry.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from hvac import exceptions as hvac_exc

from gateway.errors import (
    SecretAccessDenied,
    SecretBackendUnavailable,
    SecretError,
    SecretNotFound,
)
from gateway.policy import VaultSpec
from gateway.policy.refs import SecretRef
from gateway.secrets.base import ResolvedSecret, Secret
from gateway.secrets.vault_auth import (
    UNAVAILABLE_ERRORS,
    BlockingRunner,
    LoginRejected,
    VaultAuth,
    VaultSettings,
    VaultUnavailable,
    vault_log,
)

#: After Vault failed to answer, calls in this window do not wait on it again: they get
#: a stale value or fail fast (a blackholed Vault would otherwise cost every call a
#: full timeout).
UNAVAILABLE_HOLD_S: Final = 1.0


@dataclass(frozen=True, slots=True)
class KvLocation:
    """Where a reference's value lives in Vault (safe to log)."""

    mount: str
    kv_version: int
    path: str
    field: str | None

    @property
    def api_path(self) -> str:
        """The HTTP path hvac requests, e.g. ``/v1/agents-kv/data/llm/openai``."""
        middle = "/data/" if self.kv_version == 2 else "/"
        return f"/v1/{self.mount}{middle}{self.path}"

    def describe(self) -> str:
        return f"KV v{self.kv_version} secret {self.path!r} on mount {self.mount!r}"


def locate(spec: VaultSpec, ref: SecretRef) -> KvLocation:
    """Map a ``vault://`` reference to its mount, KV version, path and field (pure).

    An entry in ``spec.refs`` (keyed by the ref as written, without or with ``#FIELD``,
    or by its PATH) wins over ``kv_mount`` / ``kv_version``; a ``#FIELD`` in the ref
    wins over the entry's ``field``.
    """
    entry = (
        spec.refs.get(ref.raw) or spec.refs.get(f"vault://{ref.path}") or spec.refs.get(ref.path)
    )
    if entry is None:
        return KvLocation(spec.kv_mount.strip("/"), spec.kv_version, ref.path, ref.field)
    return KvLocation(
        (entry.mount or spec.kv_mount).strip("/"),
        entry.kv_version or spec.kv_version,
        entry.path.strip("/"),
        ref.field or entry.field,
    )


def select_field(ref: SecretRef, loc: KvLocation, data: Mapping[str, Any]) -> str:
    """The credential in a secret's ``data`` (pure). Raises SecretNotFound."""
    where = f"secret reference {ref.raw!r} ({loc.describe()})"
    details: dict[str, Any] = {"api_key_ref": ref.raw, "vault_path": loc.api_path}
    name = loc.field
    if name is None:
        fields = sorted(k for k in data if not (loc.kv_version == 1 and k == "ttl"))
        if len(fields) != 1:
            hint = f"; name one, e.g. {ref.raw}#{fields[0]}" if fields else ""
            raise SecretNotFound(
                f"{where} holds {len(fields)} fields ({', '.join(fields) or 'none'}){hint}",
                details={**details, "reason": "field_required", "available_fields": fields},
            )
        name = fields[0]
    if name not in data:
        names = sorted(data)
        raise SecretNotFound(
            f"{where} has no field {name!r}; its fields are: {', '.join(names) or 'none'}",
            details={**details, "reason": "field_missing", "available_fields": names},
        )
    value = data[name]
    if not isinstance(value, str) or not value:
        kind = "empty" if value == "" else f"a {type(value).__name__}, not text"
        raise SecretNotFound(
            f"{where}: field {name!r} is {kind}",
            details={**details, "reason": "field_not_text"},
        )
    return value


@dataclass(frozen=True, slots=True)
class DatabaseLease:
    """Credentials issued by Vault's database secrets engine (``GET /v1/MOUNT/creds/ROLE``):
    a user and password valid for ``lease_s`` seconds from ``obtained_at``
    (``time.monotonic()``), renewable up to the role's ``max_ttl``. ``login_generation``
    is the Vault login they were issued under (a re-login rotates them)."""

    user: str
    password: Secret
    lease_id: str
    lease_s: float
    renewable: bool
    obtained_at: float
    login_generation: int


@dataclass(frozen=True, slots=True)
class _Entry:
    secret: Secret
    fresh_until: float  # time.monotonic()
    stale_until: float


class VaultResolver:
    """Resolves ``vault://`` references (implements :class:`SecretResolver`).

    Construct from the policy's ``secrets.vault`` (``environ`` defaults to
    ``os.environ``; ``VAULT_*`` variables override the policy). Call ``await start()``
    once (first login, token renewer), ``ready()`` for readiness probes, and
    ``await aclose()`` at shutdown. Raises ValueError at construction when no
    credential source is configured.
    """

    def __init__(self, spec: VaultSpec, *, environ: Mapping[str, str] | None = None) -> None:
        self._spec = spec
        self._settings = VaultSettings.from_spec(spec, os.environ if environ is None else environ)
        self._run = BlockingRunner(spec.timeout_s)
        self._client = self._settings.new_client()
        self._auth = VaultAuth(self._settings, self._client, self._run)
        self._cache: dict[str, _Entry] = {}
        self._inflight: dict[str, asyncio.Task[Secret]] = {}
        self._unavailable_until = 0.0
        self._closed = False

    def __repr__(self) -> str:
        return f"VaultResolver(address={self._settings.address!r}, auth={self._settings.method!r})"

    @property
    def address(self) -> str:
        return self._settings.address

    async def start(self) -> None:
        """First login and the background token renewer. Never raises for Vault being
        down or refusing the login: that is logged, retried, and shown by ``ready()``."""
        await self._auth.start()

    def ready(self) -> bool:
        """True while the sidecar holds a Vault token that has not expired (``/readyz``)."""
        return self._auth.ready()

    async def resolve(self, ref: SecretRef) -> ResolvedSecret:
        """The credential ``ref`` points to. Raises SecretNotFound, SecretAccessDenied or
        SecretBackendUnavailable (see the module docstring)."""
        loc = locate(self._spec, ref)
        if self._closed:
            raise SecretBackendUnavailable(
                f"secret reference {ref.raw!r}: the Vault resolver is shut down",
                details=self._details(ref, loc, "resolver_closed"),
            )
        key = ref.raw
        now = time.monotonic()
        entry = self._cache.get(key)
        if entry is not None and now < entry.fresh_until:
            return ResolvedSecret(entry.secret, from_cache=True)
        if now < self._unavailable_until:
            why = f"it failed less than {UNAVAILABLE_HOLD_S:g} s ago"
            return self._stale_or_raise(ref, loc, self._unavailable(ref, loc, why))
        flight = self._inflight.get(key)
        if flight is None:
            flight = asyncio.create_task(self._fetch(ref, loc), name=f"vault-read {key}")
            self._inflight[key] = flight
            flight.add_done_callback(lambda done: self._landed(key, done))
        try:
            # shield: a caller that gives up must not cancel the read others wait on.
            secret = await asyncio.shield(flight)
        except SecretBackendUnavailable as exc:
            return self._stale_or_raise(ref, loc, exc)
        return ResolvedSecret(secret)

    @property
    def login_generation(self) -> int:
        """Counts the sidecar's Vault logins: a lease issued under an older one is rotated."""
        return self._auth.generation

    async def database_credentials(self, mount: str, role: str) -> DatabaseLease:
        """New credentials for ``role`` from the database secrets engine on ``mount``
        (OpenBao/Vault ``GET /v1/MOUNT/creds/ROLE``). Raises SecretAccessDenied (403,
        login refused), SecretNotFound (no such role) or SecretBackendUnavailable."""
        where = f"database role {role!r} on mount {mount!r}"

        def read() -> Any:
            return self._client.secrets.database.generate_credentials(role, mount_point=mount)

        resp = await self._vault_call(where, read)
        data = resp.get("data") or {}
        user, password = data.get("username"), data.get("password")
        if not isinstance(user, str) or not isinstance(password, str) or not password:
            raise SecretNotFound(
                f"{where}: Vault's answer has no username and password",
                details={"reason": "field_missing", "vault_path": f"/v1/{mount}/creds/{role}"},
            )
        return DatabaseLease(
            user,
            Secret(password),
            str(resp.get("lease_id") or ""),
            float(resp.get("lease_duration") or 0),
            bool(resp.get("renewable")),
            time.monotonic(),
            self._auth.generation,
        )

    async def renew_lease(self, lease_id: str, increment_s: float) -> float:
        """Renew a lease (``PUT /v1/sys/leases/renew``); the seconds Vault granted (less
        than asked near the role's ``max_ttl``). Raises as :meth:`database_credentials`."""

        def renew() -> Any:
            return self._client.sys.renew_lease(lease_id, increment=int(increment_s))

        resp = await self._vault_call("lease renewal", renew)
        return float(resp.get("lease_duration") or 0)

    async def lease_alive(self, lease_id: str) -> bool:
        """Whether Vault still holds the lease (``PUT /v1/sys/leases/lookup``): False once
        it was revoked or expired. Raises as :meth:`database_credentials` (a 400 for an
        unknown lease is False)."""
        try:
            await self._vault_call("lease lookup", lambda: self._client.sys.read_lease(lease_id))
        except SecretNotFound:
            return False
        return True

    async def revoke_lease(self, lease_id: str) -> None:
        """Revoke a lease now (``PUT /v1/sys/leases/revoke``): Vault drops the database
        user. Raises as :meth:`database_credentials`."""
        await self._vault_call("lease revocation", lambda: self._client.sys.revoke_lease(lease_id))

    async def _vault_call(self, where: str, fn: Any) -> Any:
        """``fn`` (a blocking hvac call) with a token, one re-login after a 403 on an
        expired token; hvac's errors translated (module docstring)."""
        details: dict[str, Any] = {"reason": "vault_forbidden", "vault_operation": where}
        for attempt in range(2):
            try:
                generation = await self._auth.ensure_token()
                try:
                    return await self._run(fn)
                except hvac_exc.Forbidden as exc:
                    if attempt == 0 and await self._auth.recover(generation):
                        continue
                    raise SecretAccessDenied(
                        f"{where}: Vault denied the sidecar's token", details=details
                    ) from exc
            except (VaultUnavailable, *UNAVAILABLE_ERRORS) as exc:
                raise SecretBackendUnavailable(
                    f"{where}: Vault at {self._settings.address} is unavailable",
                    details={**details, "reason": "vault_unavailable"},
                    retry_after_s=UNAVAILABLE_HOLD_S,
                ) from exc
            except LoginRejected as exc:
                raise SecretAccessDenied(
                    f"{where}: the sidecar cannot log in to Vault: {exc}",
                    details={**details, "reason": exc.reason},
                ) from exc
            except hvac_exc.VaultError as exc:
                raise SecretNotFound(
                    f"{where}: Vault rejected the request ({type(exc).__name__})",
                    details={**details, "reason": "vault_rejected"},
                ) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def invalidate(self, ref: SecretRef) -> None:
        """Forget the cached value of ``ref`` (the upstream rejected it: maybe rotated)."""
        self._cache.pop(ref.raw, None)

    async def aclose(self) -> None:
        """Stop the renewer, abandon reads in flight, close connections (idempotent)."""
        if self._closed:
            return
        self._closed = True
        await self._auth.aclose()
        flights = list(self._inflight.values())
        for flight in flights:
            flight.cancel()
        if flights:
            await asyncio.wait(flights, timeout=5.0)  # bounded: shutdown never hangs
        self._cache.clear()
        self._run.close()
        self._client.adapter.close()

    # --- internals -------------------------------------------------------------------

    def _landed(self, key: str, done: asyncio.Task[Secret]) -> None:
        if self._inflight.get(key) is done:
            del self._inflight[key]
        if not done.cancelled():
            done.exception()  # retrieved here, so a read nobody awaited is not reported

    async def _fetch(self, ref: SecretRef, loc: KvLocation) -> Secret:
        try:
            data, lease_s = await self._read(ref, loc)
            secret = Secret(select_field(ref, loc, data))
        except SecretBackendUnavailable:
            self._unavailable_until = time.monotonic() + UNAVAILABLE_HOLD_S
            raise
        except SecretError:
            # Deleted, denied or malformed now: a stale copy must not outlive that answer.
            self._cache.pop(ref.raw, None)
            raise
        fresh_s = self._spec.cache_ttl_s
        if lease_s > 0:
            fresh_s = min(fresh_s, lease_s)
        now = time.monotonic()
        self._cache[ref.raw] = _Entry(
            secret, now + fresh_s, now + fresh_s + self._spec.stale_if_error_s
        )
        return secret

    async def _read(self, ref: SecretRef, loc: KvLocation) -> tuple[Mapping[str, Any], float]:
        for attempt in range(2):
            try:
                generation = await self._auth.ensure_token()
                try:
                    return await self._run(lambda: self._read_sync(loc))
                except hvac_exc.Forbidden as exc:
                    if attempt == 0 and await self._auth.recover(generation):
                        continue
                    raise SecretAccessDenied(
                        f"secret reference {ref.raw!r}: Vault denied the sidecar's token "
                        f"read access to {loc.describe()} (GET {loc.api_path}); grant "
                        "'read' on that path in the token's Vault policy",
                        details=self._details(ref, loc, "vault_forbidden"),
                    ) from exc
            except VaultUnavailable as exc:
                raise self._unavailable(ref, loc, str(exc)) from exc
            except LoginRejected as exc:
                raise SecretAccessDenied(
                    f"secret reference {ref.raw!r}: the sidecar cannot log in to Vault: {exc}",
                    details=self._details(ref, loc, exc.reason),
                ) from exc
            except hvac_exc.InvalidPath as exc:
                raise self._not_found(ref, loc, exc) from exc
            except UNAVAILABLE_ERRORS as exc:
                raise self._unavailable(ref, loc, type(exc).__name__) from exc
            except hvac_exc.VaultError as exc:
                raise SecretNotFound(
                    f"secret reference {ref.raw!r}: Vault rejected the read of "
                    f"{loc.describe()} (GET {loc.api_path}, {type(exc).__name__})",
                    details=self._details(ref, loc, "vault_rejected"),
                ) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _read_sync(self, loc: KvLocation) -> tuple[Mapping[str, Any], float]:
        kv = self._client.secrets.kv
        if loc.kv_version == 2:
            resp = kv.v2.read_secret_version(
                path=loc.path, mount_point=loc.mount, raise_on_deleted_version=True
            )
            data = (resp.get("data") or {}).get("data")
        else:
            resp = kv.v1.read_secret(path=loc.path, mount_point=loc.mount)
            data = resp.get("data")
        return (data if isinstance(data, dict) else {}), float(resp.get("lease_duration") or 0)

    def _details(self, ref: SecretRef, loc: KvLocation, reason: str) -> dict[str, Any]:
        return {"api_key_ref": ref.raw, "reason": reason, "vault_path": loc.api_path}

    def _not_found(self, ref: SecretRef, loc: KvLocation, exc: Any) -> SecretNotFound:
        body = exc.json if isinstance(exc.json, dict) else {}
        metadata = (body.get("data") or {}).get("metadata") or {}
        if metadata.get("destroyed") or metadata.get("deletion_time"):
            state = "destroyed" if metadata.get("destroyed") else "deleted"
            return SecretNotFound(
                f"secret reference {ref.raw!r}: the current version "
                f"({metadata.get('version')}) of {loc.describe()} is {state}; write a new "
                "version or undelete it",
                details={**self._details(ref, loc, "version_deleted"), "state": state},
            )
        if any("versioned K/V" in str(w) for w in body.get("warnings") or ()):
            return SecretNotFound(
                f"secret reference {ref.raw!r}: mount {loc.mount!r} is KV v2, but the "
                f"policy reads it as KV v{loc.kv_version}; set kv_version: 2",
                details=self._details(ref, loc, "kv_version_mismatch"),
            )
        return SecretNotFound(
            f"secret reference {ref.raw!r}: Vault has no {loc.describe()} "
            f"(GET {loc.api_path} answered 404); check the path, kv_mount and kv_version "
            "or map the ref under secrets.vault.refs",
            details=self._details(ref, loc, "secret_missing"),
        )

    def _unavailable(self, ref: SecretRef, loc: KvLocation, why: str) -> SecretBackendUnavailable:
        return SecretBackendUnavailable(
            f"secret reference {ref.raw!r}: Vault at {self._settings.address} is "
            f"unavailable ({why}) and no usable cached value exists",
            details=self._details(ref, loc, "vault_unavailable"),
            retry_after_s=UNAVAILABLE_HOLD_S,
        )

    def _stale_or_raise(
        self, ref: SecretRef, loc: KvLocation, exc: SecretBackendUnavailable
    ) -> ResolvedSecret:
        entry = self._cache.get(ref.raw)
        now = time.monotonic()
        if entry is None or now >= entry.stale_until:
            raise exc
        if now < entry.fresh_until:  # refreshed by another call meanwhile
            return ResolvedSecret(entry.secret, from_cache=True)
        late_s = now - entry.fresh_until
        vault_log().warning(
            "vault_stale_value_served",
            api_key_ref=ref.raw,
            vault_path=loc.api_path,
            stale_s=round(late_s, 3),
        )
        warning = (
            f"Vault unavailable: served the cached value of {ref.raw} {late_s:.1f} s past "
            f"its cache TTL (stale_if_error_s={self._spec.stale_if_error_s:g})"
        )
        return ResolvedSecret(entry.secret, from_cache=True, warnings=(warning,))
