"""Triton rejection sampler: the same function as ``kernels/reference.py``, in two launches.

Terms (accepted / recovered / bonus, x, p, q, the exponential race) are defined in the reference's
docstring. The kernels:

1. ``_verify_row_kernel``, grid ``(num_reqs, max_num_draft + 1)``: one program per logits row,
   independent of every other row. It decides whether the row's own draft would be accepted and which
   token the request emits if it stops at this row (recovered on a rejected row, bonus on the last).

   - greedy rows: one pass, the argmax.
   - random rows, one pass over the vocabulary: online max and sum of ``exp(x)`` (softmax statistics),
     and the race ``argmax x_i - log E_i`` with the row's own draft dropped when q is one-hot. Then
     ``p(d) = exp(x_d - max) / sum`` from one extra load decides acceptance.
   - dense / sparse q: only a row whose draft is rejected makes a second pass, racing
     ``max(p_i - q_i, 0) / E_i`` now that the row's max and sum are known (sparse q is matched
     against the row's K ids in registers; no dense q is built).

2. ``_emit_kernel``, grid ``(num_reqs,)``: the leading run of accepted rows, then that row's stop
   token; writes ``sampled`` / ``num_sampled`` / ``num_rejected``.

Rows past a request's first rejection are still verified (in parallel); that costs bandwidth when
batches are large and acceptance is low, and wins latency when batches are small.

Top-k / top-p rows take a slower path: a per-row logit threshold computed by
``kernels/filtering.py`` (a sort, in torch, for those rows only) before the kernels run; the kernels
mask ``logits < threshold``. Randomness: ``kernels/triton_rng.py``, bit-identical to the reference's.
Tokens equal the reference's except where two candidates' float scores tie to within the rounding
of exp/log/sum between libraries (probability ~1e-7 per row).
"""

import torch
import triton
import triton.language as tl

from kernels.filtering import logit_thresholds
from kernels.triton_rng import accept_uniform, row_key, vocab_exponential
from kernels.types import RejectionOutput, SparseDraftProbs

ONE_HOT, DENSE, SPARSE = 0, 1, 2


@triton.jit
def _scaled_logits(row_ptr, offs, vocab_size, threshold, inv_temperature):
    """x = logits / T where logits >= threshold, else -inf (also past the vocabulary)."""
    logits = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
    return tl.where(logits >= threshold, logits * inv_temperature, float("-inf"))


@triton.jit
def _lane_argmax(values, offs, best, token):
    """Per-lane running argmax; a later block replaces a lane's entry only if strictly larger."""
    take = values > best
    return tl.where(take, values, best), tl.where(take, offs, token)


@triton.jit
def _first_argmax(best, token):
    """The smallest token among the lanes holding the maximum: torch.argmax's tie rule."""
    top = tl.max(best, axis=0)
    return tl.min(tl.where(best == top, token, 2147483647), axis=0)


@triton.jit
def _draft_prob(q_ptr, q_stride, q_ids_ptr, q_ids_stride, num_q_ids, draft_index, draft, has_draft,
                Q_MODE: tl.constexpr, BLOCK_K: tl.constexpr):
    """q(d) of the row's own draft d; 0 where the row has no draft (nothing is read there)."""
    if Q_MODE == 1:
        q_d = tl.load(q_ptr + draft_index * q_stride + draft, mask=has_draft, other=0.0).to(tl.float32)
    elif Q_MODE == 2:
        k = tl.arange(0, BLOCK_K)
        used = k < tl.where(has_draft, num_q_ids, 0)
        ids = tl.load(q_ids_ptr + draft_index * q_ids_stride + k, mask=used, other=-1)
        probs = tl.load(q_ptr + draft_index * q_stride + k, mask=used, other=0.0).to(tl.float32)
        q_d = tl.sum(tl.where(ids == draft, probs, 0.0), axis=0)
    else:
        q_d = tl.full([], 1.0, tl.float32)
    return q_d


@triton.jit
def _verify_row_kernel(
    logits_ptr,  # [num_logits, V] float32 / bf16 / fp16, unit stride along V
    logits_stride,
    draft_ids_ptr,  # [num_draft_total] int64; -1 = padded
    cu_num_draft_ptr,  # [num_reqs + 1] int32
    temperature_ptr,  # [num_reqs] float32
    seeds_ptr,  # [num_reqs] int64
    positions_ptr,  # [num_reqs] int64
    threshold_ptr,  # [num_logits] float32; -inf = no top-k/top-p
    q_ptr,  # dense: [num_draft_total, V] float32; sparse: probs [num_draft_total, K]; one-hot: unused
    q_stride,
    q_ids_ptr,  # sparse: ids [num_draft_total, K] int64; otherwise unused
    q_ids_stride,
    num_q_ids,  # K
    accepted_ptr,  # [num_logits] int8 out
    stop_token_ptr,  # [num_logits] int64 out
    vocab_size,
    Q_MODE: tl.constexpr,  # ONE_HOT | DENSE | SPARSE
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    req = tl.program_id(0)
    row = tl.program_id(1)
    draft_start = tl.load(cu_num_draft_ptr + req).to(tl.int64)
    num_draft = tl.load(cu_num_draft_ptr + req + 1).to(tl.int64) - draft_start
    if row <= num_draft:
        logits_row = draft_start + req + row
        row_ptr = logits_ptr + logits_row * logits_stride
        draft_index = draft_start + row
        draft = tl.load(draft_ids_ptr + draft_index, mask=row < num_draft, other=-1).to(tl.int64)
        has_draft = draft >= 0
        temperature = tl.load(temperature_ptr + req)
        lane = tl.arange(0, BLOCK_V)
        if temperature <= 0:
            # Greedy: the argmax.
            best = tl.full([BLOCK_V], float("-inf"), tl.float32)
            token = lane
            for start in range(0, vocab_size, BLOCK_V):
                offs = start + lane
                logits = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
                best, token = _lane_argmax(logits, offs, best, token)
            token = _first_argmax(best, token)
            accepted = has_draft & (draft == token)
            stop_token = token.to(tl.int64)
        else:
            inv_temperature = 1.0 / temperature
            threshold = tl.load(threshold_ptr + logits_row)
            key = row_key(tl.load(seeds_ptr + req), tl.load(positions_ptr + req) + row)
            if Q_MODE == 0:
                excluded = draft
            else:
                excluded = tl.full([], -1, tl.int64)
            # Pass 1: per-lane online softmax statistics, and the race from p (one-hot q: without
            # the own draft), reduced across lanes once at the end.
            lane_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
            lane_sum = tl.zeros([BLOCK_V], tl.float32)
            best = tl.full([BLOCK_V], float("-inf"), tl.float32)
            token = lane
            for start in range(0, vocab_size, BLOCK_V):
                offs = start + lane
                x = _scaled_logits(row_ptr, offs, vocab_size, threshold, inv_temperature)
                new_max = tl.maximum(lane_max, x)
                # exp of (smaller - larger): one exp per element rescales the sum or adds the term
                ratio = tl.where(new_max == float("-inf"), 0.0, tl.exp(tl.minimum(lane_max, x) - new_max))
                lane_sum = tl.where(x > lane_max, lane_sum * ratio + 1.0, lane_sum + ratio)
                lane_max = new_max
                score = x - tl.log(vocab_exponential(key, offs))
                score = tl.where(offs == excluded, float("-inf"), score)
                best, token = _lane_argmax(score, offs, best, token)
            stop_token = _first_argmax(best, token).to(tl.int64)
            row_max = tl.max(lane_max, axis=0)
            row_sum = tl.sum(tl.where(lane_max == float("-inf"), 0.0, lane_sum * tl.exp(lane_max - row_max)),
                             axis=0)

            # Acceptance of the own draft: u * q(d) < p(d).
            safe_draft = tl.maximum(draft, 0)
            x_d = _scaled_logits(row_ptr, safe_draft, vocab_size, threshold, inv_temperature)
            p_d = tl.exp(x_d - row_max) / row_sum
            q_d = _draft_prob(q_ptr, q_stride, q_ids_ptr, q_ids_stride, num_q_ids, draft_index, safe_draft,
                              has_draft, Q_MODE, BLOCK_K)
            keep = ((q_d > 0) & (accept_uniform(key) * q_d < p_d)).to(tl.int32)
            accepted = has_draft & (keep != 0)

            if Q_MODE != 0:
                if has_draft & (keep == 0):
                    # Pass 2 (rejected rows only): race over the residual max(p - q, 0).
                    best = tl.full([BLOCK_V], -1.0, tl.float32)
                    token = lane
                    for start in range(0, vocab_size, BLOCK_V):
                        offs = start + lane
                        x = _scaled_logits(row_ptr, offs, vocab_size, threshold, inv_temperature)
                        p = tl.exp(x - row_max) / row_sum
                        if Q_MODE == 1:
                            q = tl.load(q_ptr + draft_index * q_stride + offs, mask=offs < vocab_size,
                                        other=0.0).to(tl.float32)
                        else:
                            q = tl.zeros([BLOCK_V], tl.float32)
                            for k in range(num_q_ids):
                                q_id = tl.load(q_ids_ptr + draft_index * q_ids_stride + k)
                                q_prob = tl.load(q_ptr + draft_index * q_stride + k).to(tl.float32)
                                q += tl.where(offs == q_id, q_prob, 0.0)
                        race = tl.maximum(p - q, 0.0) / vocab_exponential(key, offs)
                        race = tl.where(offs < vocab_size, race, -1.0)
                        best, token = _lane_argmax(race, offs, best, token)
                    if tl.max(best, axis=0) > 0:
                        stop_token = _first_argmax(best, token).to(tl.int64)
        tl.store(accepted_ptr + logits_row, accepted.to(tl.int8))
        tl.store(stop_token_ptr + logits_row, stop_token)


@triton.jit
def _emit_kernel(
    accepted_ptr,  # [num_logits] int8
    stop_token_ptr,  # [num_logits] int64
    draft_ids_ptr,  # [num_draft_total] int64
    cu_num_draft_ptr,  # [num_reqs + 1] int32
    sampled_ptr,  # [num_reqs, max_num_draft + 1] int64 out
    num_sampled_ptr,  # [num_reqs] int32 out
    num_rejected_ptr,  # [num_reqs] int32 out
    num_cols,  # max_num_draft + 1
    BLOCK_COLS: tl.constexpr,
):
    req = tl.program_id(0)
    draft_start = tl.load(cu_num_draft_ptr + req)
    num_draft = tl.load(cu_num_draft_ptr + req + 1) - draft_start
    first_row = draft_start + req
    col = tl.arange(0, BLOCK_COLS)
    is_draft = col < num_draft
    accepted = tl.load(accepted_ptr + first_row + col, mask=is_draft, other=0)
    num_accepted = tl.min(tl.where(is_draft & (accepted == 0), col, num_draft), axis=0)
    drafts = tl.load(draft_ids_ptr + draft_start + col, mask=col < num_accepted, other=-1)
    stop_token = tl.load(stop_token_ptr + first_row + num_accepted)
    sampled = tl.where(col == num_accepted, stop_token, drafts)
    tl.store(sampled_ptr + req * num_cols + col, sampled, mask=col < num_cols)
    tl.store(num_sampled_ptr + req, num_accepted + 1)
    tl.store(num_rejected_ptr + req, num_draft - num_accepted)


def rejection_sample_triton(
    target_logits: torch.Tensor,  # [num_logits, V]
    draft_token_ids: torch.Tensor,  # [num_draft_total] int64
    cu_num_draft: torch.Tensor,  # [num_reqs + 1] int32
    temperature: torch.Tensor,  # [num_reqs] float32
    top_k: torch.Tensor,  # [num_reqs] int32
    top_p: torch.Tensor,  # [num_reqs] float32
    seeds: torch.Tensor,  # [num_reqs] int64
    positions: torch.Tensor,  # [num_reqs] int64
    draft_probs: SparseDraftProbs | torch.Tensor | None = None,
    max_num_draft: int | None = None,
    block_v: int | None = None,
) -> RejectionOutput:
    device = target_logits.device
    num_logits, vocab_size = target_logits.shape
    num_reqs = cu_num_draft.numel() - 1
    if target_logits.stride(1) != 1:
        target_logits = target_logits.contiguous()
    cu_num_draft = cu_num_draft.to(torch.int32)
    draft_token_ids = draft_token_ids.to(torch.int64)
    temperature = temperature.float()
    num_draft = cu_num_draft[1:] - cu_num_draft[:-1]
    if max_num_draft is None:
        max_num_draft = int(num_draft.max()) if num_reqs else 0
    num_cols = max_num_draft + 1

    sampled = torch.empty(num_reqs, num_cols, dtype=torch.int64, device=device)
    num_sampled = torch.empty(num_reqs, dtype=torch.int32, device=device)
    num_rejected = torch.empty(num_reqs, dtype=torch.int32, device=device)
    if num_reqs == 0:
        return RejectionOutput(sampled, num_sampled, num_rejected)

    threshold = _thresholds(target_logits, num_draft, temperature, top_k, top_p)
    q_mode, q, q_ids = ONE_HOT, target_logits, draft_token_ids
    if isinstance(draft_probs, SparseDraftProbs):
        q_mode, q_ids = SPARSE, draft_probs.ids.to(torch.int64).contiguous()
        q = draft_probs.probs.float().contiguous()
    elif draft_probs is not None:
        q_mode, q = DENSE, draft_probs.float().contiguous()
    num_q_ids = q_ids.shape[1] if q_mode == SPARSE else 1
    q_ids_stride = q_ids.stride(0) if q_mode == SPARSE else 0
    q_stride = q.stride(0) if q_mode != ONE_HOT else 0
    if block_v is None:
        block_v = min(triton.next_power_of_2(vocab_size), 16384 if device.type == "cpu" else 2048)

    accepted = torch.empty(num_logits, dtype=torch.int8, device=device)
    stop_token = torch.empty(num_logits, dtype=torch.int64, device=device)
    _verify_row_kernel[(num_reqs, num_cols)](
        target_logits, target_logits.stride(0), draft_token_ids, cu_num_draft, temperature,
        seeds.to(torch.int64), positions.to(torch.int64), threshold,
        q, q_stride, q_ids, q_ids_stride, num_q_ids,
        accepted, stop_token, vocab_size,
        Q_MODE=q_mode, BLOCK_V=block_v, BLOCK_K=triton.next_power_of_2(num_q_ids),
        num_warps=8, enable_fp_fusion=False,
    )
    _emit_kernel[(num_reqs,)](
        accepted, stop_token, draft_token_ids, cu_num_draft, sampled, num_sampled, num_rejected,
        num_cols, BLOCK_COLS=triton.next_power_of_2(num_cols),
    )
    return RejectionOutput(sampled, num_sampled, num_rejected)


def _thresholds(
    target_logits: torch.Tensor,  # [num_logits, V]
    num_draft: torch.Tensor,  # [num_reqs] int32
    temperature: torch.Tensor,  # [num_reqs] float32
    top_k: torch.Tensor,  # [num_reqs] int
    top_p: torch.Tensor,  # [num_reqs] float32
) -> torch.Tensor:  # [num_logits] float32
    """Per-row logit thresholds; rows of requests without top-k/top-p (or greedy) stay -inf.

    One device sync (``nonzero``) finds the rows that filter; only those are sorted.
    """
    num_logits, vocab_size = target_logits.shape
    threshold = torch.full((num_logits,), float("-inf"), dtype=torch.float32, device=target_logits.device)
    filters = (temperature > 0) & (((top_k > 0) & (top_k < vocab_size)) | (top_p < 1))
    rows = torch.nonzero(torch.repeat_interleave(filters, num_draft + 1, output_size=num_logits)).squeeze(1)
    if rows.numel():
        req = torch.repeat_interleave(
            torch.arange(num_draft.numel(), device=rows.device), num_draft + 1, output_size=num_logits
        )[rows]
        threshold[rows] = logit_thresholds(target_logits[rows], temperature[req], top_k[req], top_p[req])
    return threshold
