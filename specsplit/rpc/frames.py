"""The frames of a request/response stream on a Unix socket: the one codec of every socket client and server
(`specsplit.rpc.local_stream`'s `LocalStream` and `LocalStreamServer`, `specsplit.rpc.threaded_stream`'s
`ThreadedLocalStreamServer`, the verifier's `specsplit.verifier.socket_channel`).

Frame: `<u32 length><u8 kind>` then `length` bytes.
    kind 0  a message (the protobuf's serialised bytes)
    kind 1  an error: `<u32 grpc status code>` then the details in UTF-8; the server closes the
            connection after it, as a gRPC stream ends with its status

A server refuses a bad request frame (a truncated header, an unknown kind, a body over its limit, a body that does
not parse) with an error frame and ends the connection (`BadFrame`). A client reads an answer as a gRPC stream's
would fail: an error frame is its status, an answer that does not parse is INTERNAL (`answer_of`).
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from specsplit.rpc.bidi_stream import StreamError

HEADER = struct.Struct("<IB")
ERROR_CODE = struct.Struct("<I")
KIND_MESSAGE, KIND_ERROR = 0, 1
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def message_frame(message) -> bytes:
    body = message.SerializeToString()
    return HEADER.pack(len(body), KIND_MESSAGE) + body


def error_frame(code: grpc.StatusCode, details: str) -> bytes:
    body = ERROR_CODE.pack(code.value[0]) + details.encode()
    return HEADER.pack(len(body), KIND_ERROR) + body


class BadFrame(Exception):
    """A request frame a server refuses; `frame` is the error frame that answers it (the connection ends after)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.frame = error_frame(code, details)


def request_length(header: bytes, max_message_bytes: int) -> int:
    """The body length a request's header announces; BadFrame for a truncated header (the connection closed
    inside it), an unknown kind or a body over `max_message_bytes`."""
    if len(header) < HEADER.size:
        raise BadFrame(grpc.StatusCode.INVALID_ARGUMENT, "truncated frame header")
    length, kind = HEADER.unpack(header)
    if kind != KIND_MESSAGE:
        raise BadFrame(grpc.StatusCode.INVALID_ARGUMENT, f"unknown frame kind {kind}")
    if length > max_message_bytes:
        details = f"message of {length} bytes over the limit of {max_message_bytes}"
        raise BadFrame(grpc.StatusCode.RESOURCE_EXHAUSTED, details)
    return length


def parse_request(body: bytes, parse: Callable[[bytes], Any]):
    """`parse(body)`; BadFrame when it does not parse."""
    try:
        return parse(body)
    except DecodeError as err:
        raise BadFrame(grpc.StatusCode.INVALID_ARGUMENT, f"cannot parse the request: {err}") from None


def answer_of(kind: int, body: bytes, parse: Callable[[bytes], Any], peer: str):
    """The answer a frame from `peer` carries; StreamError with the status of an error frame, or INTERNAL for an
    answer that does not parse (the client closes the connection on either)."""
    if kind == KIND_ERROR:
        (code,) = ERROR_CODE.unpack_from(body)
        details = body[ERROR_CODE.size :].decode(errors="replace")
        raise StreamError(_CODES.get(code, grpc.StatusCode.UNKNOWN), details)
    try:
        return parse(body)
    except DecodeError as err:
        raise StreamError(grpc.StatusCode.INTERNAL, f"cannot parse the {peer}'s answer: {err}") from None


def recv_exactly(conn: socket.socket, n: int) -> bytes:
    """Up to `n` bytes from a blocking socket: fewer only when the peer closed the connection."""
    chunks, left = [], n
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(conn: socket.socket) -> tuple[int, bytes]:
    """The next frame's kind and body from a blocking socket; ConnectionError when the peer closed the connection
    before a whole frame (the socket's own OSErrors, its timeout included, pass through)."""
    header = recv_exactly(conn, HEADER.size)
    if len(header) < HEADER.size:
        raise ConnectionError("connection closed")
    length, kind = HEADER.unpack(header)
    body = recv_exactly(conn, length)
    if len(body) < length:
        raise ConnectionError("connection closed")
    return kind, body
