"""A ragged step's paged layout for the attention kernels' tests: each request's context in blocks scattered through
a pool, and its last new tokens as causal queries."""

from __future__ import annotations

import torch


def scattered_layout(context_lens: list[int], new_tokens: list[int], block_size: int, g: torch.Generator):
    """(num_blocks, block_tables [R, width] int32 with a spare -1 column as a padded table has, token_req_index [T]
    int32, token_context_lens [T]): query j of a request's n new tokens sees cache indices 0 .. context - n + j."""
    blocks_per_req = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_req) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()  # blocks scattered through the pool
    block_tables = torch.full((len(context_lens), max(blocks_per_req) + 1), -1, dtype=torch.int32)
    for r, nb in enumerate(blocks_per_req):
        block_tables[r, :nb] = torch.tensor([order.pop() for _ in range(nb)])
    req_index, ctx = [], []
    for r, (n, new) in enumerate(zip(context_lens, new_tokens)):
        req_index += [r] * new
        ctx += list(range(n - new + 1, n + 1))
    return num_blocks, block_tables, torch.tensor(req_index, dtype=torch.int32), torch.tensor(ctx)
