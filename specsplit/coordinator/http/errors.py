"""Errors as OpenAI's API gives them: `{"error": {"message", "type", "param", "code"}}` with its HTTP status."""

from __future__ import annotations

import grpc
from fastapi.responses import JSONResponse

from specsplit.client.errors import InvalidArgument, SpecsplitError

# A coordinator status → (HTTP status, OpenAI error type).
_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}


class BadOption(InvalidArgument):
    """A request option this server refuses, naming it (OpenAI's `param`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    type_: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


def status_of(err: SpecsplitError) -> tuple[int, str]:
    """The HTTP status and OpenAI error type of a coordinator error (500, server_error, for any other)."""
    return _STATUS.get(err.code, (500, "server_error"))


def from_specsplit_error(err: SpecsplitError) -> JSONResponse:
    status, type_ = status_of(err)
    code = "model_not_found" if err.code == grpc.StatusCode.NOT_FOUND else err.code.name.lower()
    return error_response(status, err.message, type_, getattr(err, "param", None), code)
