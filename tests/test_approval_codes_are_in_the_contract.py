"""The approval codes: statuses and retryability in the exception tree, the OpenAPI
document's table and the Python client's classes agree with the design's table."""

from __future__ import annotations

import egress_client
import pytest

from gateway import errors
from gateway.envelope import ErrorCode
from gateway.openapi import error_codes


@pytest.mark.parametrize(
    ("cls", "code", "status", "retryable", "client_cls"),
    [
        (errors.ApprovalPending, "APPROVAL_PENDING", 428, True, egress_client.ApprovalPending),
        (errors.ApprovalDenied, "APPROVAL_DENIED", 403, False, egress_client.ApprovalDenied),
    ],
)
def test_the_code_is_listed_everywhere(
    cls: type[errors.GatewayError],
    code: str,
    status: int,
    retryable: bool,
    client_cls: type[egress_client.EgressError],
) -> None:
    err = cls("waiting", details={"approval_id": "apr_1"}, retry_after_s=2.0)
    payload = err.to_payload()
    assert (payload.code, err.http_status) == (ErrorCode(code), status)
    assert payload.retryable is retryable
    assert payload.details == {"approval_id": "apr_1"}
    assert payload.suggested_retry_after == 2.0
    assert error_codes()[code] == {"http_status": [str(status)], "retryable": retryable}
    assert egress_client.ERROR_CLASSES[code] is client_cls
