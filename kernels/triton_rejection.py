"""Triton rejection sampler: the same function as ``kernels/reference.py``, on the GPU.

Terms (accepted / recovered / bonus, x, p, q, the exponential race) are defined in the reference's
docstring. Every logits row is cut into chunks of ``CHUNK`` vocabulary ids; the kernels
(``kernels/triton_rejection_kernels.py``):

1. ``block_stats_kernel``, grid ``(num_reqs, max_num_draft + 1, num_chunks)``: the only full pass
   over the logits. Per (row, chunk): online softmax statistics (max, sum of exp) and the winner of
   the race from p, ``argmax x_i - log E_i`` (the row's own draft left out when q is one-hot, which
   makes the winner the one-hot recovered token); greedy rows: the argmax.
2. ``accept_kernel``, grid ``(num_reqs,)``: per request, rows in order until the first rejection:
   combine the chunk statistics, ``p(d) = exp(x_d - max) / sum`` from one load, accept iff
   ``u * q(d) < p(d)`` (greedy: ``d == argmax``); write ``sampled`` / ``num_sampled`` /
   ``num_rejected`` with the race winner of the stop row (recovered or bonus).
3. dense / sparse q only, when the stop row rejected a draft: ``residual_kernel``, grid
   ``(num_reqs, num_chunks)``, races ``max(p_i - q_i, 0) / E_i`` over that one row (sparse q is
   matched against the row's K ids in registers; no dense q is built), and
   ``patch_residual_kernel``, grid ``(num_reqs,)``, writes the winner over the stop token.

So the logits are read once, plus one row per request that rejected a dense / sparse draft. Ties
go to the lowest id everywhere, as in ``torch.argmax``.

Top-k / top-p rows take a slower path: a per-row logit threshold from ``kernels/filtering.py`` (a
sort, in torch, of those rows only) before the kernels run; the kernels mask ``logits < threshold``.
Randomness: ``kernels/triton_rng.py``, the same bits as the reference's. Tokens equal the
reference's except where two candidates' float scores tie to within the last-ulp differences of
exp/log/sum between libraries (about 1e-7 per row).
"""

import torch
import triton

from kernels.filtering import row_thresholds
from kernels.triton_rejection_kernels import accept_kernel, block_stats_kernel, patch_residual_kernel, residual_kernel
from kernels.types import RejectionOutput, SparseDraftProbs

ONE_HOT, DENSE, SPARSE = 0, 1, 2


def rejection_sample_triton(
    target_logits: torch.Tensor,  # [num_logits, V]
    draft_token_ids: torch.Tensor,  # [num_draft_total] int64
    cu_num_draft: torch.Tensor,  # [num_reqs + 1] int32
    temperature: torch.Tensor,  # [num_reqs] float32
    top_k: torch.Tensor | None,  # [num_reqs] int32; None = off everywhere
    top_p: torch.Tensor | None,  # [num_reqs] float32; None = off everywhere
    seeds: torch.Tensor,  # [num_reqs] int64
    positions: torch.Tensor,  # [num_reqs] int64
    draft_probs: SparseDraftProbs | torch.Tensor | None = None,
    max_num_draft: int | None = None,
    chunk: int | None = None,  # vocabulary ids per program; default by device
) -> RejectionOutput:
    """Launches the kernels. Host syncs: one for ``max_num_draft`` unless given, one to find the
    top-k/top-p rows unless ``top_k`` and ``top_p`` are both None (then none: graph-capturable).
    """
    device = target_logits.device
    num_logits, vocab_size = target_logits.shape
    num_reqs = cu_num_draft.numel() - 1
    if target_logits.stride(1) != 1:
        target_logits = target_logits.contiguous()
    cu_num_draft = cu_num_draft.to(torch.int32)
    draft_token_ids = draft_token_ids.to(torch.int64)
    temperature = temperature.float()
    seeds, positions = seeds.to(torch.int64), positions.to(torch.int64)
    if max_num_draft is None:
        max_num_draft = int((cu_num_draft[1:] - cu_num_draft[:-1]).max()) if num_reqs else 0
    num_cols = max_num_draft + 1

    sampled = torch.empty(num_reqs, num_cols, dtype=torch.int64, device=device)
    num_sampled = torch.empty(num_reqs, dtype=torch.int32, device=device)
    num_rejected = torch.empty(num_reqs, dtype=torch.int32, device=device)
    if num_reqs == 0:
        return RejectionOutput(sampled, num_sampled, num_rejected)

    has_threshold = top_k is not None or top_p is not None
    # Without filters the kernels read no threshold (no -inf fill to launch); the pointer is a placeholder.
    threshold = (
        row_thresholds(target_logits, cu_num_draft, temperature, top_k, top_p) if has_threshold else target_logits
    )
    q_mode, q, q_ids, num_q_ids = ONE_HOT, target_logits, draft_token_ids, 1
    if isinstance(draft_probs, SparseDraftProbs):
        q_mode, q_ids = SPARSE, draft_probs.ids.to(torch.int64).contiguous()
        q, num_q_ids = draft_probs.probs.float().contiguous(), q_ids.shape[1]
    elif draft_probs is not None:
        q_mode, q = DENSE, draft_probs.float().contiguous()
    q_stride = q.stride(0) if q_mode != ONE_HOT else 0
    q_ids_stride = q_ids.stride(0) if q_mode == SPARSE else 0

    interpreted = device.type == "cpu"  # TRITON_INTERPRET: few, large programs run fastest
    if chunk is None:
        chunk = min(triton.next_power_of_2(vocab_size), 32768 if interpreted else 4096)
    block_v = min(chunk, 16384 if interpreted else 1024)
    num_blocks = triton.cdiv(vocab_size, chunk)
    num_blocks_pad = triton.next_power_of_2(num_blocks)

    stats = torch.empty(3, num_logits, num_blocks, dtype=torch.float32, device=device)
    block_token = torch.empty(num_logits, num_blocks, dtype=torch.int32, device=device)
    block_stats_kernel[(num_reqs, num_cols, num_blocks)](
        target_logits, target_logits.stride(0), draft_token_ids, cu_num_draft, temperature, seeds, positions,
        threshold, stats[0], stats[1], stats[2], block_token, vocab_size, num_blocks,
        EXCLUDE_DRAFT=q_mode == ONE_HOT, HAS_THRESHOLD=has_threshold, CHUNK=chunk, BLOCK_V=block_v, num_warps=4,
        enable_fp_fusion=False,
    )  # fmt: skip
    stop_max, stop_sum = torch.empty(2, num_reqs, dtype=torch.float32, device=device)
    needs_residual = torch.empty(num_reqs, dtype=torch.int8, device=device)  # accept_kernel writes every entry
    accept_kernel[(num_reqs,)](
        stats[0], stats[1], stats[2], block_token, target_logits, target_logits.stride(0), draft_token_ids,
        cu_num_draft, temperature, seeds, positions, threshold, q, q_stride, q_ids, q_ids_stride, num_q_ids,
        sampled, num_sampled, num_rejected, stop_max, stop_sum, needs_residual, vocab_size, num_blocks, num_cols,
        Q_MODE=q_mode, HAS_THRESHOLD=has_threshold, NUM_BLOCKS_PAD=num_blocks_pad,
        BLOCK_K=triton.next_power_of_2(num_q_ids), BLOCK_COLS=triton.next_power_of_2(num_cols), num_warps=1,
        enable_fp_fusion=False,
    )  # fmt: skip
    if q_mode != ONE_HOT:
        res_best = torch.empty(num_reqs, num_blocks, dtype=torch.float32, device=device)
        res_token = torch.empty(num_reqs, num_blocks, dtype=torch.int32, device=device)
        residual_kernel[(num_reqs, num_blocks)](
            target_logits, target_logits.stride(0), cu_num_draft, temperature, seeds, positions, threshold,
            q, q_stride, q_ids, q_ids_stride, num_q_ids, num_sampled, stop_max, stop_sum, needs_residual,
            res_best, res_token, vocab_size, num_blocks,
            Q_MODE=q_mode, HAS_THRESHOLD=has_threshold, CHUNK=chunk, BLOCK_V=block_v, num_warps=4,
            enable_fp_fusion=False,
        )  # fmt: skip
        patch_residual_kernel[(num_reqs,)](
            res_best, res_token, needs_residual, num_sampled, sampled, num_blocks, num_cols,
            NUM_BLOCKS_PAD=num_blocks_pad, num_warps=1,
        )  # fmt: skip
    return RejectionOutput(sampled, num_sampled, num_rejected)
