"""The later draft steps' inputs kernel (`specsplit/kernels/draft_step_inputs.py`) against its torch reference: rows
that take every step, some or none, device hand-off shifts, requests whose rows are not in table order, odd row
counts; and a row past its steps writes nothing (slot -1) and reads nothing (context 0)."""

import pytest
import torch

from specsplit.kernels.draft_step_inputs import step_inputs, step_inputs_reference

BLOCK = 4


def case(n: int, num_reqs: int, num_steps: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    width = 6
    context0 = torch.randint(1, width * BLOCK - num_steps, (n,), generator=g, dtype=torch.int32)
    shift = -torch.randint(0, 4, (n,), generator=g).clamp(max=context0.to(torch.int64) - 1)
    steps = torch.randint(0, num_steps + 1, (n,), generator=g, dtype=torch.int32)
    req_rows = torch.randperm(num_reqs, generator=g)[:n].to(torch.int32)
    tables = torch.randperm(num_reqs * width * 3, generator=g)[: num_reqs * width].view(num_reqs, width).to(torch.int32)
    last_positions = torch.randint(0, 1000, (n,), generator=g)
    return context0, shift, last_positions, steps, req_rows, tables


@pytest.mark.parametrize("n, num_reqs", [(1, 1), (3, 5), (7, 7), (32, 40), (100, 100)])
@pytest.mark.parametrize("num_steps", [1, 2, 4])
def test_kernel_equals_the_reference(n, num_reqs, num_steps):
    args = case(n, num_reqs, num_steps, seed=n * 10 + num_steps)
    got = step_inputs(*args, BLOCK, num_steps)
    expected = step_inputs_reference(*args, BLOCK, num_steps)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_a_row_past_its_steps_neither_writes_nor_reads():
    context0 = torch.tensor([5, 9], dtype=torch.int32)
    shift = torch.tensor([0, -2])
    steps = torch.tensor([2, 0], dtype=torch.int32)
    tables = torch.tensor([[10, 11, 12], [20, 21, 22]], dtype=torch.int32)
    context, slots, positions = step_inputs(
        context0, shift, torch.tensor([40, 80]), steps, torch.tensor([0, 1], dtype=torch.int32), tables, BLOCK, 2
    )
    assert context.tolist() == [[6, 0], [7, 0]]
    assert slots.tolist() == [[11 * BLOCK + 1, -1], [11 * BLOCK + 2, -1]]  # cache indices 5 and 6 of request 0
    assert positions.tolist() == [[41, 0], [42, 0]]


def test_the_shift_moves_a_step_back_into_the_earlier_block():
    context, slots, positions = step_inputs(
        torch.tensor([8], dtype=torch.int32),
        torch.tensor([-3]),  # 3 of the row's 4 rows rejected
        torch.tensor([50]),
        torch.tensor([1], dtype=torch.int32),
        torch.tensor([0], dtype=torch.int32),
        torch.tensor([[7, 3, 9]], dtype=torch.int32),
        BLOCK,
        1,
    )
    assert context.tolist() == [[6]] and slots.tolist() == [[3 * BLOCK + 1]] and positions.tolist() == [[48]]


def test_block_tables_with_strided_rows_are_refused():
    args = list(case(2, 2, 1, seed=0))
    args[5] = args[5].t().contiguous().t()
    with pytest.raises(ValueError, match="contiguous"):
        step_inputs(*args, BLOCK, 1)
