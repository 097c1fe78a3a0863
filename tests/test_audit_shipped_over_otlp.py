"""The audit trail shipped over OTLP/HTTP logs (``audit.otlp``), at least once: a real
loopback receiver taken down and brought back loses no record, and ``audit verify``
passes on what it received; the spool resumes after a restart and stays bounded."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)

from gateway.audit.log import AuditLog
from gateway.audit.query.verify import verify
from gateway.audit.spool import SEGMENT_BYTES, Spool
from gateway.call.record import CallContext, audit_record
from gateway.envelope import ExternalCallResponse
from gateway.metrics import Metrics
from gateway.policy import AuditOtlpSpec, AuditSpec, parse_policy
from tests.conftest import wait_for


class Receiver:
    """An OTLP/HTTP logs endpoint on 127.0.0.1 that can be stopped and started again on
    the same port; ``bodies`` holds every log record body it accepted, in order."""

    def __init__(self) -> None:
        self.bodies: list[str] = []
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def _logs(self, request: web.Request) -> web.Response:
        message = ExportLogsServiceRequest.FromString(await request.read())
        for resource in message.resource_logs:
            for scope in resource.scope_logs:
                self.bodies += [r.body.string_value for r in scope.log_records]
        return web.Response(
            body=ExportLogsServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/logs", self._logs)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/logs"


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    up = Receiver()
    await up.start()
    yield up
    await up.stop()


def _spec(url: str, spool: Path, **extra: object) -> AuditSpec:
    otlp = AuditOtlpSpec(endpoint=url, spool_path=str(spool), timeout_s=1, **extra)  # type: ignore[arg-type]
    return AuditSpec(chain=True, otlp=otlp)


def _calls(log: AuditLog, n: int) -> None:
    for i in range(n):
        answer = ExternalCallResponse(success=True, status_code=200 + i % 2, latency_ms=1.0)
        log.call(audit_record(CallContext(started=0.0, agent_id="a"), answer))


async def test_a_collector_outage_loses_no_record(receiver: Receiver, tmp_path: Path) -> None:
    written = io.StringIO()
    log = AuditLog(_spec(receiver.url, tmp_path / "spool"), written, agent_id="a")
    shipper = log._otlp
    assert shipper is not None
    try:
        _calls(log, 5)
        await wait_for(lambda: len(receiver.bodies) == 5, 30)

        await receiver.stop()  # the collector goes away
        _calls(log, 20)
        await wait_for(lambda: shipper.failures >= 2, 30)  # it was tried, and failed
        log.event("breaker_state_change", target_system="t", old_state="closed", new_state="open")
        _calls(log, 20)
        assert len(receiver.bodies) == 5
        assert shipper.spool.pending_bytes > 0
        metrics = Metrics()
        metrics.watch(
            audit_failures=lambda: 0,
            secrets_ready=lambda: True,
            audit_shipping=lambda: log.shipping,
        )
        exposed = metrics.render()[0].decode()
        assert "egress_gateway_audit_shipping_dropped_total 0.0" in exposed
        assert (
            f"egress_gateway_audit_shipping_pending_bytes {float(shipper.spool.pending_bytes)}"
            in (exposed)
        )

        await receiver.start()  # back, on the same port
        await wait_for(lambda: len(receiver.bodies) == 46, 30)
    finally:
        log.close()
    lines = written.getvalue().splitlines()
    assert receiver.bodies == lines  # every line, once, in order, byte for byte
    result = verify(["-"], stdin=io.BytesIO("".join(b + "\n" for b in receiver.bodies).encode()))
    assert result.ok, result.breaks
    assert result.chained == 46
    assert shipper.spool.dropped == 0
    assert shipper.spool.pending_bytes == 0
    assert log.shipping is None  # closed


async def test_a_restart_ships_what_the_last_start_spooled(
    receiver: Receiver, tmp_path: Path
) -> None:
    await receiver.stop()
    first = AuditLog(_spec(receiver.url, tmp_path / "spool"), io.StringIO(), agent_id="a")
    _calls(first, 7)
    first.close()  # the collector is down: the 7 lines stay in the spool
    assert receiver.bodies == []
    await receiver.start()
    second = AuditLog(_spec(receiver.url, tmp_path / "spool"), io.StringIO(), agent_id="a")
    try:
        _calls(second, 3)
        await wait_for(lambda: len(receiver.bodies) == 10, 30)
    finally:
        second.close()
    result = verify(["-"], stdin=io.BytesIO("".join(b + "\n" for b in receiver.bodies).encode()))
    assert result.ok, result.breaks
    assert result.chains == 2


def test_the_spool_is_bounded_and_counts_what_it_dropped(tmp_path: Path) -> None:
    line = "x" * 1023  # 1 KiB with its newline
    spool = Spool(tmp_path / "spool", max_bytes=2 * SEGMENT_BYTES)
    total = 3 * SEGMENT_BYTES // 1024
    for i in range(total):
        spool.append(f"{i:08d}" + line[8:])
    assert spool.pending_bytes <= 2 * SEGMENT_BYTES
    assert spool.dropped == SEGMENT_BYTES // 1024  # the oldest segment, whole
    lines, end = spool.read(10)
    assert lines[0].startswith(f"{spool.dropped:08d}")  # the oldest left
    spool.commit(end)
    spool.close()
    again = Spool(tmp_path / "spool", max_bytes=2 * SEGMENT_BYTES)  # resumed from its cursor
    assert again.read(1)[0][0].startswith(f"{spool.dropped + 10:08d}")
    again.close()


def test_the_policy_takes_an_otlp_sink() -> None:
    text = (
        "version: 1\nagent_id: a\ntargets: {}\n"
        "audit: {sink: stdout, chain: true, otlp: {endpoint: 'http://otel:4318/v1/logs'}}\n"
    )
    otlp = parse_policy(text, "p.yaml").audit.otlp
    assert otlp is not None
    assert otlp.spool_path == "/tmp/egress-gateway/audit-spool"
    assert otlp.spool_max_bytes == 32 * 1024 * 1024
