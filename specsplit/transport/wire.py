"""torch.Tensor ↔ `specsplit.v1.Tensor` (dtype, shape, raw little-endian bytes).

Receiving copies the data once (reading a bytes field of a upb message copies it: every read does, so
read `msg.data` once) and the returned tensor views that copy (read-only memory), so treat it as
read-only or pass `copy=True`; moving it to a device (`.to("cuda")`) copies anyway. Sending: fill the
message's own Tensor field with `fill_tensor_proto` (a `CopyFrom` of a built Tensor copies the bytes again).
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Sequence

import torch

from specsplit.proto import common_pb2

_TO_PROTO = {
    torch.float32: common_pb2.DTYPE_FLOAT32,
    torch.float16: common_pb2.DTYPE_FLOAT16,
    torch.bfloat16: common_pb2.DTYPE_BFLOAT16,
    torch.int32: common_pb2.DTYPE_INT32,
    torch.int64: common_pb2.DTYPE_INT64,
}
_FROM_PROTO = {v: k for k, v in _TO_PROTO.items()}

if sys.byteorder != "little":  # raw bytes are little-endian; a big-endian host would need byte swaps
    raise ImportError("specsplit.transport.wire supports little-endian hosts only")

# torch.frombuffer warns that message bytes are immutable; the tensors are documented as read-only.
# One filter for this module, instead of a warnings context per tensor (which costs more than the decoding).
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning, module=__name__)


def dtype_to_proto(dtype: torch.dtype) -> int:
    """The wire DType of `dtype`; raises ValueError for one the wire does not carry."""
    if dtype not in _TO_PROTO:
        raise ValueError(f"cannot send a {dtype} tensor; supported: {', '.join(map(str, _TO_PROTO))}")
    return _TO_PROTO[dtype]


def dtype_from_proto(value: int) -> torch.dtype | None:
    """The torch dtype of a wire DType; None when unknown or unset."""
    return _FROM_PROTO.get(value)


def tensor_to_proto(t: torch.Tensor) -> common_pb2.Tensor:
    msg = common_pb2.Tensor()
    fill_tensor_proto(msg, t)
    return msg


def fill_tensor_proto(msg: common_pb2.Tensor, t: torch.Tensor) -> None:
    """Writes `t` into an (empty) Tensor field in place: no intermediate message to copy."""
    msg.dtype = dtype_to_proto(t.dtype)
    host = t.detach().contiguous().cpu()
    msg.shape.extend(host.shape)
    if host.numel():
        msg.data = host.reshape(-1).view(torch.uint8).numpy().tobytes()


def fill_tensor_protos(msgs: Sequence[common_pb2.Tensor], tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> None:
    """`fill_tensor_proto(msg, t.to(dtype))` for each pair, with one cast, one host copy and one bytes
    conversion for them all (each costs more than the bytes of a small tensor).

    tensors: [n_i, *trailing] with the same trailing shape."""
    if len(tensors) <= 1:
        for msg, t in zip(msgs, tensors):
            fill_tensor_proto(msg, t.to(dtype))
        return
    code = dtype_to_proto(dtype)
    host = torch.cat(list(tensors)).to(dtype).cpu()  # [sum of n_i, *trailing]
    data = host.reshape(-1).view(torch.uint8).numpy().tobytes()
    row_bytes = math.prod(host.shape[1:]) * dtype.itemsize
    offset = 0
    for msg, t in zip(msgs, tensors):
        msg.dtype = code
        msg.shape.extend(t.shape)
        end = offset + t.shape[0] * row_bytes
        if end > offset:
            msg.data = data[offset:end]
        offset = end


def tensor_nbytes(msg: common_pb2.Tensor) -> int:
    """The bytes the Tensor's dtype and shape call for (0 when the dtype is unknown), without reading its data."""
    dtype = _FROM_PROTO.get(msg.dtype)
    return math.prod(msg.shape) * dtype.itemsize if dtype is not None else 0


def tensor_from_proto(
    msg: common_pb2.Tensor,
    *,
    expected_dtype: torch.dtype | None = None,
    expected_shape: Sequence[int | None] | None = None,
    copy: bool = False,
) -> torch.Tensor:
    """Decodes and validates a Tensor message; raises ValueError naming what is wrong.

    expected_shape: one entry per dimension, None where any size is accepted.
    """
    dtype = _FROM_PROTO.get(msg.dtype)
    if dtype is None:
        raise ValueError(f"tensor has unknown or unset dtype {msg.dtype} ({_dtype_name(msg.dtype)})")
    shape = list(msg.shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"tensor shape {shape} has a negative dimension")
    if expected_dtype is not None and dtype != expected_dtype:
        raise ValueError(f"tensor dtype is {dtype}, expected {expected_dtype}")
    if expected_shape is not None and (
        len(shape) != len(expected_shape) or any(e is not None and e != d for d, e in zip(shape, expected_shape))
    ):
        wanted = ["*" if e is None else e for e in expected_shape]
        raise ValueError(f"tensor shape {shape} does not match expected {wanted}")
    itemsize = dtype.itemsize
    numel = math.prod(shape)
    data = msg.data  # each read of a bytes field copies it out of the message: read it once
    if len(data) != numel * itemsize:
        raise ValueError(
            f"tensor data has {len(data)} bytes, expected {numel * itemsize} "
            f"({numel} elements of {dtype} for shape {shape})"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    t = torch.frombuffer(data, dtype=dtype).view(shape)
    return t.clone() if copy else t


def _dtype_name(value: int) -> str:
    try:
        return common_pb2.DType.Name(value)
    except ValueError:
        return "not a DType"
