"""torch ↔ protobuf Tensor: exact round trips for every dtype, clear rejection of bad messages."""

from __future__ import annotations

import pytest
import torch

from specsplit.proto import common_pb2
from specsplit.transport.wire import fill_tensor_proto, fill_tensor_protos, tensor_from_proto, tensor_to_proto

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64]


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    return torch.randint(-(2**30), 2**30, shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 5), (7,), (), (0, 4), (2, 1, 3)], ids=str)
def test_round_trip_is_exact(dtype, shape):
    t = _sample(dtype, shape)
    msg = common_pb2.Tensor.FromString(tensor_to_proto(t).SerializeToString())
    assert list(msg.shape) == list(shape)
    back = tensor_from_proto(msg, expected_dtype=dtype, expected_shape=shape)
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back, t)


@pytest.mark.parametrize("dtype", [torch.int32, torch.float32, torch.bfloat16], ids=str)
def test_many_tensors_filled_at_once_equal_each_filled_alone(dtype):
    tensors = [_sample(torch.float32, (n, 5)) for n in (3, 1, 0, 2)]
    tensors[1] = tensors[1].t().contiguous().t()  # any layout
    at_once = [common_pb2.Tensor() for _ in tensors]
    fill_tensor_protos(at_once, tensors, dtype)
    for msg, t in zip(at_once, tensors):
        alone = common_pb2.Tensor()
        fill_tensor_proto(alone, t.to(dtype))
        assert msg == alone
    single = common_pb2.Tensor()
    fill_tensor_protos([single], tensors[:1], dtype)
    assert single == at_once[0]


def test_bytes_are_little_endian_row_major():
    msg = tensor_to_proto(torch.tensor([[1, 2], [3, 256]], dtype=torch.int32))
    assert msg.dtype == common_pb2.DTYPE_INT32
    assert msg.data == bytes([1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 0, 1, 0, 0])
    assert tensor_to_proto(torch.tensor([1.0], dtype=torch.bfloat16)).data == b"\x80\x3f"


def test_non_contiguous_tensors_are_sent_in_logical_order():
    t = torch.arange(12, dtype=torch.int64).view(3, 4).t()
    assert torch.equal(tensor_from_proto(tensor_to_proto(t)), t)


def test_copy_gives_a_writable_tensor():
    back = tensor_from_proto(tensor_to_proto(torch.ones(4)), copy=True)
    back += 1
    assert torch.equal(back, torch.full((4,), 2.0))


def test_expected_shape_accepts_wildcards():
    msg = tensor_to_proto(torch.zeros(3, 8))
    assert tensor_from_proto(msg, expected_shape=[None, 8]).shape == (3, 8)


def test_unsupported_dtype_cannot_be_sent():
    with pytest.raises(ValueError, match="cannot send a torch.float64"):
        tensor_to_proto(torch.zeros(2, dtype=torch.float64))


@pytest.mark.parametrize(
    "msg,kwargs,match",
    [
        (common_pb2.Tensor(shape=[1], data=b"\0" * 4), {}, "unknown or unset dtype 0"),
        (common_pb2.Tensor(dtype=99, shape=[1], data=b"\0" * 4), {}, "unknown or unset dtype 99"),
        (
            common_pb2.Tensor(dtype=common_pb2.DTYPE_FLOAT32, shape=[2, -1], data=b""),
            {},
            "negative dimension",
        ),
        (
            common_pb2.Tensor(dtype=common_pb2.DTYPE_FLOAT32, shape=[2, 3], data=b"\0" * 20),
            {},
            "20 bytes, expected 24",
        ),
        (
            common_pb2.Tensor(dtype=common_pb2.DTYPE_INT64, shape=[], data=b"\0" * 4),
            {},
            "4 bytes, expected 8",
        ),
        (
            common_pb2.Tensor(dtype=common_pb2.DTYPE_INT32, shape=[2], data=b"\0" * 8),
            {"expected_dtype": torch.int64},
            "dtype is torch.int32, expected torch.int64",
        ),
        (
            common_pb2.Tensor(dtype=common_pb2.DTYPE_INT32, shape=[2, 3], data=b"\0" * 24),
            {"expected_shape": [None, 4]},
            r"shape \[2, 3\] does not match expected \['\*', 4\]",
        ),
        (
            common_pb2.Tensor(dtype=common_pb2.DTYPE_INT32, shape=[6], data=b"\0" * 24),
            {"expected_shape": [2, 3]},
            "does not match expected",
        ),
    ],
)
def test_bad_messages_are_rejected_with_a_clear_message(msg, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tensor_from_proto(msg, **kwargs)
