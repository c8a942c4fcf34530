"""The rejection sampler's second kernel: the exponential race on each random request's stop row
(recovered or bonus token); ``kernels/triton_rejection.py`` launches it after
``kernels/triton_rejection_kernels.py``. Tensors named ``race_*`` hold one entry per (request, chunk).
"""

import triton
import triton.language as tl

from kernels.triton_rejection_common import (
    LOG2E,
    NO_RACE,
    RACE_P_EXCLUDE_DRAFT,
    RACE_RESIDUAL,
    UNALIGNED_INPUTS,
    first_argmax,
    lane_argmax,
    last_of_request,
    p_race_score,
    publish,
    reduce_chunks,
    row_threshold,
    scaled_logits,
    vocab_id,
)
from kernels.triton_rng import log2, row_key, vocab_clocks


@triton.jit(do_not_specialize=["num_cols"], do_not_specialize_on_alignment=UNALIGNED_INPUTS)
def race_kernel(
    logits_ptr,  # [num_logits, V]
    logits_stride,
    draft_ids_ptr,  # [num_draft_total] int64
    cu_num_draft_ptr,  # [num_reqs + 1] int32
    temperature_ptr,  # [num_reqs] float32
    seeds_ptr,  # [num_reqs] int64
    positions_ptr,  # [num_reqs] int64
    threshold_ptr,  # [num_logits] float32
    q_ptr,  # dense: [num_draft_total, V]; sparse: probs [num_draft_total, K]
    q_stride,
    q_ids_ptr,  # sparse: ids [num_draft_total, K] int64
    q_ids_stride,
    num_q_ids,
    num_sampled_ptr,  # [num_reqs] int32: the stop row is num_sampled - 1
    stop_max_ptr,  # [num_reqs] float32
    stop_sum_ptr,  # [num_reqs] float32
    race_mode_ptr,  # [num_reqs] int32
    race_best_ptr,  # [num_reqs, num_blocks] float32: best race score of the chunk
    race_token_ptr,  # [num_reqs, num_blocks] int32
    fallback_best_ptr,  # [num_reqs, num_blocks] float32: residual rows: the race from p
    fallback_token_ptr,  # [num_reqs, num_blocks] int32
    counter_ptr,  # [num_reqs] int32, 0 between calls
    sampled_ptr,  # [num_reqs, num_cols] int64 in/out
    vocab_size,
    num_blocks,
    num_cols,
    Q_MODE: tl.constexpr,  # 0 one-hot, 1 dense, 2 sparse
    HAS_THRESHOLD: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NUM_BLOCKS_PAD: tl.constexpr,
    FAST_LOG2: tl.constexpr,  # GPU: approximate logs for the clocks and the Gumbel score (kernels/triton_rng.py)
):
    """Grid (num_reqs, num_blocks): the exponential race on each random request's stop row, one
    chunk per program; the request's last program writes the winner into the stop column."""
    req = tl.program_id(0)
    blk = tl.program_id(1)
    race_mode = tl.load(race_mode_ptr + req)
    if race_mode != NO_RACE:
        draft_start = tl.load(cu_num_draft_ptr + req).to(tl.int64)
        j = tl.load(num_sampled_ptr + req).to(tl.int64) - 1
        row = draft_start + req + j
        row_ptr = logits_ptr + row * logits_stride
        draft_index = draft_start + j
        inv_temperature = 1.0 / tl.load(temperature_ptr + req)
        threshold = row_threshold(threshold_ptr, row, HAS_THRESHOLD)
        key = row_key(tl.load(seeds_ptr + req), tl.load(positions_ptr + req) + j)
        chunk_start = blk * CHUNK
        lane = tl.arange(0, BLOCK_V)
        out = req * num_blocks + blk
        if race_mode == RACE_RESIDUAL:  # argmax max(p - q, 0) / C, and the race from p if that is all 0
            row_max = tl.load(stop_max_ptr + req)
            row_sum = tl.load(stop_sum_ptr + req)
            best = tl.full([BLOCK_V], -1.0, tl.float32)
            token = chunk_start + lane
            p_best = tl.full([BLOCK_V], float("-inf"), tl.float32)
            p_token = chunk_start + lane
            for start in range(chunk_start, chunk_start + CHUNK, BLOCK_V):
                offs = start + lane
                x = scaled_logits(row_ptr, offs, vocab_size, threshold, inv_temperature, HAS_THRESHOLD)
                p = tl.exp(x - row_max) / row_sum
                if Q_MODE == 1:
                    q = tl.load(q_ptr + draft_index * q_stride + offs, mask=offs < vocab_size, other=0.0)
                    q = q.to(tl.float32)
                else:
                    q = tl.zeros([BLOCK_V], tl.float32)
                    for k in range(num_q_ids):
                        q_id = vocab_id(tl.load(q_ids_ptr + draft_index * q_ids_stride + k), vocab_size)
                        if (q_id >= start) & (q_id < start + BLOCK_V):  # most tiles hold none of the K ids
                            q_prob = tl.load(q_ptr + draft_index * q_stride + k).to(tl.float32)
                            q += tl.where(offs == q_id, q_prob, 0.0)
                clock = vocab_clocks(key, offs, FAST_LOG2)
                race = tl.maximum(p - q, 0.0) / clock
                best, token = lane_argmax(tl.where(offs < vocab_size, race, -1.0), offs, best, token)
                p_best, p_token = lane_argmax(x * LOG2E - log2(clock, FAST_LOG2), offs, p_best, p_token)
            top, top_token = first_argmax(best, token)
            p_top, p_top_token = first_argmax(p_best, p_token)
            publish(fallback_best_ptr + out, p_top)
            publish(fallback_token_ptr + out, p_top_token)
        else:  # the race from p: argmax x log2(e) - log2 C (Gumbel-max), maybe without the rejected draft
            excluded = tl.full([], -1, tl.int32)
            if race_mode == RACE_P_EXCLUDE_DRAFT:
                excluded = vocab_id(tl.load(draft_ids_ptr + draft_index), vocab_size)
            best = tl.full([BLOCK_V], float("-inf"), tl.float32)
            token = chunk_start + lane
            for start in range(chunk_start, chunk_start + CHUNK, BLOCK_V):
                offs = start + lane
                x = scaled_logits(row_ptr, offs, vocab_size, threshold, inv_temperature, HAS_THRESHOLD)
                best, token = lane_argmax(p_race_score(x, key, offs, excluded, FAST_LOG2), offs, best, token)
            top, top_token = first_argmax(best, token)
        publish(race_best_ptr + out, top)
        publish(race_token_ptr + out, top_token)
        if last_of_request(counter_ptr, req, num_blocks):
            blocks = tl.arange(0, NUM_BLOCKS_PAD)
            in_blocks = blocks < num_blocks
            chunks = req * num_blocks + blocks
            top, winner = reduce_chunks(race_best_ptr, race_token_ptr, chunks, in_blocks)
            if (race_mode == RACE_RESIDUAL) & (top <= 0):  # no residual mass (p == q up to rounding)
                _, winner = reduce_chunks(fallback_best_ptr, fallback_token_ptr, chunks, in_blocks)
            tl.store(sampled_ptr + req * num_cols + j, winner.to(tl.int64))
