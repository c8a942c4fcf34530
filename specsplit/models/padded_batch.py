"""An eager step's attention as one SDPA call: the step's requests padded to its longest (`specsplit.models.attention`),
instead of a loop of about ten launches per request and layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Bound on a padded batch's (query, key) pairs: its SDPA scores are pairs x heads floats.
PADDED_BATCH_MAX_PAIRS = 1 << 22


@dataclass
class PaddedBatch:
    """A ragged eager step as [num_reqs, max_new] queries over [num_reqs, max_len] keys."""

    slots: torch.Tensor  # [R, L] int64 flat cache slots (padding: 0)
    query_index: torch.Tensor  # [R, N] int64 rows of q (padding: the request's last row again)
    mask: torch.Tensor  # [R, N, L] bool, causal and padding
    out_index: torch.Tensor  # [T] int64, each token's row in the flattened [R * N] output
    max_new: int
    max_len: int


def worth_padding(num_reqs: int, real_pairs: int, padded_pairs: int, on_cuda: bool) -> bool:
    """One SDPA call over a step padded to its longest request, rather than a loop of about ten launches
    per request and layer? Never for one request or past `PADDED_BATCH_MAX_PAIRS`. On CUDA always
    otherwise: the loop's launches cost far more host time than the padding costs the GPU (a large batch
    mixing prefill and decode: docs/performance.md, "Decode step and kernels"). On CPU the padding is real
    work: only while it at most doubles the (query, key) pairs."""
    if num_reqs < 2 or padded_pairs > PADDED_BATCH_MAX_PAIRS:
        return False
    return on_cuda or padded_pairs <= 2 * real_pairs


def build_padded_batch(
    query_start_loc: list[int],  # [R + 1] host
    seq_lens: list[int],  # [R] host, after the step
    slots: torch.Tensor,  # [R, max(seq_lens)] int64 host flat slots (0 past a request's end; padding reads it)
    device: torch.device,
) -> PaddedBatch | None:
    """The step padded (None where `worth_padding` says no); its index tensors on `device`."""
    n_new = [b - a for a, b in zip(query_start_loc, query_start_loc[1:])]
    num_reqs, max_new, max_len = len(seq_lens), max(n_new), max(seq_lens)
    real_pairs = sum(n * length for n, length in zip(n_new, seq_lens))
    padded_pairs = num_reqs * max_new * max_len
    if not worth_padding(num_reqs, real_pairs, padded_pairs, device.type == "cuda"):
        return None
    key = torch.arange(max_len)
    lens = torch.tensor(seq_lens)
    new = torch.tensor(n_new)
    j = torch.minimum(torch.arange(max_new)[None, :], new[:, None] - 1)  # [R, N]: padded rows repeat the last
    query_index = torch.tensor(query_start_loc[:-1])[:, None] + j  # [R, N] rows of q
    last_visible = (lens - new)[:, None] + j  # [R, N]: query j sees keys 0 .. seq_len - n + j
    mask = key[None, None, :] <= last_visible[:, :, None]  # [R, N, L]
    out_index = torch.cat([r * max_new + torch.arange(n) for r, n in enumerate(n_new)])  # [T] rows of [R * N]
    return PaddedBatch(
        slots.to(device), query_index.to(device), mask.to(device), out_index.to(device), max_new, max_len
    )
