"""The rejection sampler's first kernel: softmax statistics (or the argmax) of every logits row,
then, per request, the walk to the first rejection; ``kernels/triton_rejection.py`` launches it.

Vocabulary rows are cut into chunks of ``CHUNK`` ids, so even a batch of one request fills the GPU.
Terms and the algorithm: ``kernels/reference.py``. Tensors named ``block_*`` hold one entry per
(logits row, chunk). The race on the stop row is ``kernels/triton_race_kernel.py``.
"""

import triton
import triton.language as tl

from kernels.triton_rejection_common import (
    BIG_TOKEN,
    NO_MAX,
    NO_RACE,
    RACE_P,
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
from kernels.triton_rng import accept_uniform, row_key


@triton.jit
def _draft_prob(q_ptr, q_stride, q_ids_ptr, q_ids_stride, num_q_ids, draft_index, draft, has_draft,
                Q_MODE: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
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


# One compiled variant whatever the batch's most drafts and wherever its per-request inputs start.
@triton.jit(do_not_specialize=["num_cols"], do_not_specialize_on_alignment=UNALIGNED_INPUTS)
def stats_accept_kernel(
    logits_ptr,  # [num_logits, V] float32 / bf16 / fp16, unit stride along V
    logits_stride,
    draft_ids_ptr,  # [num_draft_total] int64; -1 = padded
    cu_num_draft_ptr,  # [num_reqs + 1] int32
    temperature_ptr,  # [num_reqs] float32
    seeds_ptr,  # [num_reqs] int64
    positions_ptr,  # [num_reqs] int64
    threshold_ptr,  # [num_logits] float32 (read only with HAS_THRESHOLD)
    q_ptr,  # dense: [num_draft_total, V]; sparse: probs [num_draft_total, K]; one-hot: unused
    q_stride,
    q_ids_ptr,  # sparse: ids [num_draft_total, K] int64; otherwise unused
    q_ids_stride,
    num_q_ids,  # K
    block_max_ptr,  # [num_logits, num_blocks] float32: max of x (greedy rows: max logit)
    block_sum_ptr,  # [num_logits, num_blocks] float32: sum of exp(x - block max) (random rows)
    block_token_ptr,  # [num_logits, num_blocks] int32: argmax (greedy rows)
    counter_ptr,  # [num_reqs] int32, 0 between calls
    sampled_ptr,  # [num_reqs, num_cols] int64 out (the stop column is patched by race_kernel)
    num_sampled_ptr,  # [num_reqs] int32 out
    num_rejected_ptr,  # [num_reqs] int32 out
    stop_max_ptr,  # [num_reqs] float32 out: softmax max of the stop row
    stop_sum_ptr,  # [num_reqs] float32 out: softmax sum of the stop row
    race_mode_ptr,  # [num_reqs] int32 out: what race_kernel does for the request
    block_race_ptr,  # RACE_IN_STATS: [num_logits, num_blocks] float32: best race score of the chunk
    block_race_token_ptr,  # RACE_IN_STATS: [num_logits, num_blocks] int32
    vocab_size,
    num_blocks,
    num_cols,  # max_num_draft + 1
    Q_MODE: tl.constexpr,  # 0 one-hot, 1 dense, 2 sparse
    HAS_THRESHOLD: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NUM_BLOCKS_PAD: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    RACE_IN_STATS: tl.constexpr,  # one-hot q only: every random row's race from p in this pass; no race_kernel
    FAST_LOG2: tl.constexpr,  # GPU: approximate logs for the race (kernels/triton_rng.py)
):
    """Grid (num_reqs, max_num_draft + 1, num_blocks): the one full pass over the logits, one chunk
    of one row per program; the request's last program then walks its rows to the first rejection."""
    req = tl.program_id(0)
    row = tl.program_id(1)
    blk = tl.program_id(2)
    draft_start = tl.load(cu_num_draft_ptr + req).to(tl.int64)
    num_draft = tl.load(cu_num_draft_ptr + req + 1).to(tl.int64) - draft_start
    if row <= num_draft:
        logits_row = draft_start + req + row
        row_ptr = logits_ptr + logits_row * logits_stride
        out = logits_row * num_blocks + blk
        chunk_start = blk * CHUNK
        lane = tl.arange(0, BLOCK_V)
        temperature = tl.load(temperature_ptr + req)
        if temperature <= 0:  # greedy: the argmax of the raw logits
            best = tl.full([BLOCK_V], float("-inf"), tl.float32)
            token = chunk_start + lane
            for start in range(chunk_start, chunk_start + CHUNK, BLOCK_V):
                offs = start + lane
                logits = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
                best, token = lane_argmax(logits, offs, best, token)
            top, top_token = first_argmax(best, token)
            publish(block_max_ptr + out, top)
            publish(block_token_ptr + out, top_token)
        else:  # online softmax per lane, one exp per element
            inv_temperature = 1.0 / temperature
            threshold = row_threshold(threshold_ptr, logits_row, HAS_THRESHOLD)
            # A finite start (below any logit) keeps exp's argument finite without a guard per element.
            lane_max = tl.full([BLOCK_V], NO_MAX, tl.float32)
            lane_sum = tl.zeros([BLOCK_V], tl.float32)
            if RACE_IN_STATS:  # the token if the request stops here: the race from p without this row's draft
                key = row_key(tl.load(seeds_ptr + req), tl.load(positions_ptr + req) + row)
                own_draft = tl.load(draft_ids_ptr + draft_start + row, mask=row < num_draft, other=-1)
                excluded = vocab_id(own_draft, vocab_size)
                race_best = tl.full([BLOCK_V], float("-inf"), tl.float32)
                race_token = chunk_start + lane
            for start in range(chunk_start, chunk_start + CHUNK, BLOCK_V):
                offs = start + lane
                x = scaled_logits(row_ptr, offs, vocab_size, threshold, inv_temperature, HAS_THRESHOLD)
                # exp(smaller - larger) either rescales the running sum or is the new term.
                new_max = tl.maximum(lane_max, x)
                ratio = tl.exp(tl.minimum(lane_max, x) - new_max)
                lane_sum = tl.where(x > lane_max, lane_sum * ratio + 1.0, lane_sum + ratio)
                lane_max = new_max
                if RACE_IN_STATS:
                    score = p_race_score(x, key, offs, excluded, FAST_LOG2)
                    race_best, race_token = lane_argmax(score, offs, race_best, race_token)
            if RACE_IN_STATS:
                race_top, race_top_token = first_argmax(race_best, race_token)
                publish(block_race_ptr + out, race_top)
                publish(block_race_token_ptr + out, race_top_token)
            chunk_max = tl.max(lane_max, axis=0)
            chunk_max = tl.where(chunk_max == NO_MAX, float("-inf"), chunk_max)  # nothing but -inf here
            safe_max = tl.where(chunk_max == float("-inf"), 0.0, chunk_max)
            publish(block_max_ptr + out, chunk_max)
            publish(block_sum_ptr + out, tl.sum(lane_sum * tl.exp(lane_max - safe_max), axis=0))
        if last_of_request(counter_ptr, req, (num_draft + 1) * num_blocks):
            _accept_request(
                req, draft_start, num_draft, logits_ptr, logits_stride, draft_ids_ptr, temperature_ptr, seeds_ptr,
                positions_ptr, threshold_ptr, q_ptr, q_stride, q_ids_ptr, q_ids_stride, num_q_ids, block_max_ptr,
                block_sum_ptr, block_token_ptr, sampled_ptr, num_sampled_ptr, num_rejected_ptr, stop_max_ptr,
                stop_sum_ptr, race_mode_ptr, block_race_ptr, block_race_token_ptr, vocab_size, num_blocks, num_cols,
                Q_MODE, HAS_THRESHOLD, NUM_BLOCKS_PAD, BLOCK_K, BLOCK_COLS, RACE_IN_STATS,
            )  # fmt: skip


@triton.jit
def _accept_request(
    req, draft_start, num_draft, logits_ptr, logits_stride, draft_ids_ptr, temperature_ptr, seeds_ptr, positions_ptr,
    threshold_ptr, q_ptr, q_stride, q_ids_ptr, q_ids_stride, num_q_ids, block_max_ptr, block_sum_ptr, block_token_ptr,
    sampled_ptr, num_sampled_ptr, num_rejected_ptr, stop_max_ptr, stop_sum_ptr, race_mode_ptr,
    block_race_ptr, block_race_token_ptr, vocab_size, num_blocks, num_cols,
    Q_MODE: tl.constexpr, HAS_THRESHOLD: tl.constexpr, NUM_BLOCKS_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_COLS: tl.constexpr, RACE_IN_STATS: tl.constexpr,
):  # fmt: skip
    """One request's rows in order until the first rejection; writes its output but the stop token
    of a random row, which ``race_kernel`` samples (``race_mode`` says from what), or, with
    ``RACE_IN_STATS``, the winner of the stop row's chunk races."""
    temperature = tl.load(temperature_ptr + req)
    greedy = temperature <= 0
    inv_temperature = 1.0 / tl.where(greedy, 1.0, temperature)
    seed = tl.load(seeds_ptr + req)
    position = tl.load(positions_ptr + req)
    blocks = tl.arange(0, NUM_BLOCKS_PAD)
    in_blocks = blocks < num_blocks

    searching = tl.full([], 1, tl.int32)
    num_accepted = num_draft
    stop_token = tl.full([], -1, tl.int32)
    stop_max = tl.zeros([], tl.float32)
    stop_sum = tl.full([], 1.0, tl.float32)
    race_mode = tl.zeros([], tl.int32)
    if Q_MODE == 0:  # a rejected one-hot draft drops out of the race from p
        draft_race = tl.full([], RACE_P_EXCLUDE_DRAFT, tl.int32)
    else:
        draft_race = tl.full([], RACE_RESIDUAL, tl.int32)
    for j in range(0, num_draft + 1):
        if searching != 0:
            row = draft_start + req + j
            chunks = row * num_blocks + blocks
            chunk_max = tl.load(block_max_ptr + chunks, mask=in_blocks, other=float("-inf"), cache_modifier=".cg")
            draft = tl.load(draft_ids_ptr + draft_start + j, mask=j < num_draft, other=-1)
            has_draft = draft >= 0
            if greedy:
                tokens = tl.load(block_token_ptr + chunks, mask=in_blocks, other=BIG_TOKEN, cache_modifier=".cg")
                _, token = first_argmax(chunk_max, tokens)
                accepted = (has_draft & (draft == token)).to(tl.int32)
                row_max = tl.zeros([], tl.float32)
                row_sum = tl.full([], 1.0, tl.float32)
                mode = tl.full([], NO_RACE, tl.int32)
            else:
                token = tl.full([], -1, tl.int32)
                chunk_sum = tl.load(block_sum_ptr + chunks, mask=in_blocks, other=0.0, cache_modifier=".cg")
                row_max = tl.max(chunk_max, axis=0)
                row_sum = tl.sum(
                    tl.where(chunk_max == float("-inf"), 0.0, chunk_sum * tl.exp(chunk_max - row_max)), axis=0
                )
                safe_draft = tl.maximum(draft, 0)
                x_d = scaled_logits(
                    logits_ptr + row * logits_stride, safe_draft, vocab_size,
                    row_threshold(threshold_ptr, row, HAS_THRESHOLD), inv_temperature, HAS_THRESHOLD,
                )  # fmt: skip
                p_d = tl.exp(x_d - row_max) / row_sum
                q_d = _draft_prob(q_ptr, q_stride, q_ids_ptr, q_ids_stride, num_q_ids, draft_start + j,
                                  safe_draft, has_draft, Q_MODE, BLOCK_K)  # fmt: skip
                u = accept_uniform(row_key(seed, position + j))
                accepted = (has_draft & (q_d > 0) & (u * q_d < p_d)).to(tl.int32)
                mode = tl.where(has_draft, draft_race, RACE_P).to(tl.int32)
            if accepted == 0:
                searching = tl.zeros([], tl.int32)
                num_accepted = j
                stop_token = token
                stop_max = row_max
                stop_sum = row_sum
                race_mode = mode

    if RACE_IN_STATS:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if race_mode != NO_RACE:
            stop_chunks = (draft_start + req + num_accepted) * num_blocks + blocks
            _, stop_token = reduce_chunks(block_race_ptr, block_race_token_ptr, stop_chunks, in_blocks)
            race_mode = tl.full([], NO_RACE, tl.int32)
    col = tl.arange(0, BLOCK_COLS)
    drafts = tl.load(draft_ids_ptr + draft_start + col, mask=col < num_accepted, other=-1)
    sampled = tl.where(col == num_accepted, stop_token.to(tl.int64), drafts)
    tl.store(sampled_ptr + req * num_cols + col, sampled, mask=col < num_cols)
    tl.store(num_sampled_ptr + req, (num_accepted + 1).to(tl.int32))
    tl.store(num_rejected_ptr + req, (num_draft - num_accepted).to(tl.int32))
    tl.store(stop_max_ptr + req, stop_max)
    tl.store(stop_sum_ptr + req, stop_sum)
    tl.store(race_mode_ptr + req, race_mode)
