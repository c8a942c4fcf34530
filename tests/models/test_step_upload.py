"""StepUpload: a step's small host arrays become device tensors with the values and dtypes asked for
(empty arrays included), equal to what `torch.tensor` makes of the same lists."""

import torch

from specsplit.models.step_upload import StepUpload


def test_arrays_come_back_per_dtype_in_order_with_their_values():
    int64 = [[1, 2, 3], [], [2**62, -(2**63)]]
    int32 = [[5], [-1, 2**31 - 1]]
    float32 = [[0.1, 1 / 3, 1e-40, 3.4e38, -2.5], []]
    got = StepUpload("cpu")(int64, int32, float32)
    for arrays, tensors, dtype in zip((int64, int32, float32), got, (torch.int64, torch.int32, torch.float32)):
        assert len(tensors) == len(arrays)
        for values, tensor in zip(arrays, tensors):
            assert tensor.dtype == dtype and tensor.shape == (len(values),)
            assert torch.equal(tensor, torch.tensor(values, dtype=dtype))  # float32: rounded alike


def test_no_arrays_of_a_dtype_and_all_empty_arrays():
    int64, int32, float32 = StepUpload("cpu")([[], []])
    assert [t.numel() for t in int64] == [0, 0] and int32 == [] and float32 == []
