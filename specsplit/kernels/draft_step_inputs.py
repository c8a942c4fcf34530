"""The attention inputs of the drafter's later steps 1..S, all in one launch (`specsplit/drafter/later_steps.py`).

Row r (a request that drafts) takes later step s while s <= steps[r]. Its request's cache entries after step 0 are
context0[r]; the device hand-off moves every later step back by shift[r] ≤ 0 (num_sampled - rows). At step s:
- context: context0 + shift + s cache entries (taken), 0 otherwise: the row attends over nothing;
- slot: its new token's KV slot, read from its request's row req_rows[r] of the block tables (taken), -1 otherwise:
  nothing is written;
- position: its last token's position + shift + s (taken), 0 otherwise.
`step_inputs_reference` holds the same as torch ops, about a dozen launches a step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def step_inputs_reference(
    context0: torch.Tensor,  # [n] int32
    shift: torch.Tensor,  # [n] int64 ≤ 0
    last_positions: torch.Tensor,  # [n] int64
    steps: torch.Tensor,  # [n] int32
    req_rows: torch.Tensor,  # [n] int32
    block_tables: torch.Tensor,  # [num_reqs, width] int32
    block_size: int,
    num_steps: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # context [S, n] int32, slots [S, n] int64, positions [S, n]
    s = torch.arange(1, num_steps + 1, device=context0.device)[:, None]  # [S, 1]
    taken = steps[None].to(torch.int64) >= s  # [S, n]
    context = torch.where(taken, context0[None].to(torch.int64) + shift[None] + s, 0)
    index = (context - 1).clamp_min(0)
    blocks = block_tables[req_rows.to(torch.int64)[None].expand_as(index), index // block_size].to(torch.int64)
    slots = torch.where(taken, blocks * block_size + index % block_size, -1)
    positions = torch.where(taken, last_positions[None] + shift[None] + s, 0)
    return context.to(torch.int32), slots, positions


@triton.jit
def _step_inputs_kernel(
    context0_ptr,
    shift_ptr,
    last_positions_ptr,
    steps_ptr,
    req_rows_ptr,
    tables_ptr,
    context_ptr,
    slots_ptr,
    positions_ptr,
    n,
    stride_tables,
    BLOCK_SIZE: tl.constexpr,
    ROWS: tl.constexpr,
):
    s = tl.program_id(0) + 1
    r = tl.arange(0, ROWS)
    valid = r < n
    taken = valid & (tl.load(steps_ptr + r, mask=valid, other=0) >= s)
    shift = tl.load(shift_ptr + r, mask=valid, other=0)
    context = tl.where(taken, tl.load(context0_ptr + r, mask=valid, other=0).to(tl.int64) + shift + s, 0)
    index = tl.maximum(context - 1, 0)
    row = tl.load(req_rows_ptr + r, mask=valid, other=0).to(tl.int64)
    block = tl.load(tables_ptr + row * stride_tables + index // BLOCK_SIZE, mask=taken, other=0).to(tl.int64)
    slots = tl.where(taken, block * BLOCK_SIZE + index % BLOCK_SIZE, -1)
    positions = tl.where(taken, tl.load(last_positions_ptr + r, mask=valid, other=0) + shift + s, 0)
    out = (s - 1) * n + r
    tl.store(context_ptr + out, context.to(tl.int32), mask=valid)
    tl.store(slots_ptr + out, slots, mask=valid)
    tl.store(positions_ptr + out, positions, mask=valid)


def step_inputs(
    context0: torch.Tensor,
    shift: torch.Tensor,
    last_positions: torch.Tensor,
    steps: torch.Tensor,
    req_rows: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    num_steps: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`step_inputs_reference` in one launch (contiguous 1-D inputs of n rows; the block tables' rows contiguous)."""
    n, device = context0.shape[0], context0.device
    if block_tables.stride(1) != 1:
        raise ValueError("the block tables' rows must be contiguous")
    context = torch.empty(num_steps, n, dtype=torch.int32, device=device)
    slots = torch.empty(num_steps, n, dtype=torch.int64, device=device)
    positions = torch.empty(num_steps, n, dtype=torch.int64, device=device)
    _step_inputs_kernel[(num_steps,)](
        context0,
        shift,
        last_positions,
        steps,
        req_rows,
        block_tables,
        context,
        slots,
        positions,
        n,
        block_tables.stride(0),
        BLOCK_SIZE=block_size,
        ROWS=triton.next_power_of_2(n),
    )
    return context, slots, positions
