"""The SDK raises the SpecsplitError subclass of each gRPC status, with the status code on it, so callers can
`except InvalidArgument` (or retry on `Unavailable`) instead of reading codes."""

import grpc
import pytest

from specsplit.client import errors


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


@pytest.mark.parametrize(
    "code, cls",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgument),
        (grpc.StatusCode.FAILED_PRECONDITION, errors.FailedPrecondition),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhausted),
        (grpc.StatusCode.UNAVAILABLE, errors.Unavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, errors.DeadlineExceeded),
        (grpc.StatusCode.CANCELLED, errors.Cancelled),
        (grpc.StatusCode.UNAUTHENTICATED, errors.Unauthenticated),
        (grpc.StatusCode.INTERNAL, errors.SpecsplitError),
        (grpc.StatusCode.NOT_FOUND, errors.SpecsplitError),
    ],
)
def test_each_status_becomes_its_subclass_and_keeps_its_code(code, cls):
    err = errors.from_rpc_error(FakeRpcError(code, "what went wrong"))
    assert type(err) is cls and isinstance(err, errors.SpecsplitError)
    assert err.code is code and err.message == f"{code.name}: what went wrong"
