"""Errors that cross a service boundary, with the gRPC status code each one maps to; and `UsageError`, a
mistake at start-up, which does not."""

from __future__ import annotations

import grpc


class SpecsplitError(Exception):
    """An error with a gRPC status code and a message a person can act on."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self)


class InvalidArgument(SpecsplitError):
    """The caller sent something malformed; retrying the same call cannot succeed."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(SpecsplitError):
    """The call is well formed but does not fit the server's state (e.g. unknown request)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(SpecsplitError):
    """The server is full (queue, KV cache); retry later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(SpecsplitError):
    """A service this call needs cannot be reached."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(SpecsplitError):
    """The call's deadline passed before the answer came."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(SpecsplitError):
    """The call was cancelled (by the caller, or the request was aborted)."""

    code = grpc.StatusCode.CANCELLED


class Unauthenticated(SpecsplitError):
    """The call lacked valid credentials (bearer token, client certificate)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class UsageError(Exception):
    """A mistake in how a service or command was started (a flag value, a path, a port, a model that does
    not fit), found at start-up. The message reads `<problem>; <fix>`; the CLI prints it as one line and
    exits 2 (`specsplit.cli.commands.main`). Never crosses a service boundary."""


_BY_CODE = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        FailedPrecondition,
        ResourceExhausted,
        Unavailable,
        DeadlineExceeded,
        Cancelled,
        Unauthenticated,
    )
}


def from_rpc_error(err: grpc.RpcError) -> SpecsplitError:
    """Turns a grpc error raised by a stub into the SpecsplitError subclass of its status (the base class
    for a status without one), carrying the same code."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    return _BY_CODE.get(code, SpecsplitError)(f"{code.name}: {details}", code)
