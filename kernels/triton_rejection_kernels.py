"""The Triton kernels of the rejection sampler; ``kernels/triton_rejection.py`` launches them.

Vocabulary rows are cut into chunks of ``CHUNK`` ids, so even a batch of one request fills the GPU.
Terms and the algorithm: ``kernels/reference.py``. Tensors named ``block_*`` hold one entry per
(logits row, chunk); ``res_*`` one per (request, chunk).
"""

import triton
import triton.language as tl

from kernels.triton_rng import accept_uniform, row_key, vocab_exponential

BIG_TOKEN = tl.constexpr(2147483647)


@triton.jit
def _threshold(threshold_ptr, row, HAS_THRESHOLD: tl.constexpr):
    """The row's top-k / top-p logit threshold; -inf when no request filters."""
    threshold = tl.full([], float("-inf"), tl.float32)
    if HAS_THRESHOLD:
        threshold = tl.load(threshold_ptr + row)
    return threshold


@triton.jit
def _scaled_logits(row_ptr, offs, vocab_size, threshold, inv_temperature):
    """x = logits / T where logits >= threshold, else -inf (also past the vocabulary)."""
    logits = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
    return tl.where(logits >= threshold, logits * inv_temperature, float("-inf"))


@triton.jit
def _lane_argmax(values, offs, best, token):
    """Per-lane running argmax; a later tile replaces a lane's entry only if strictly larger."""
    take = values > best
    return tl.where(take, values, best), tl.where(take, offs, token)


@triton.jit
def _first_argmax(best, token):
    """(max, smallest token holding it) over lanes or chunks: torch.argmax's tie rule."""
    top = tl.max(best, axis=0)
    return top, tl.min(tl.where(best == top, token, BIG_TOKEN), axis=0)


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


@triton.jit
def block_stats_kernel(
    logits_ptr,  # [num_logits, V] float32 / bf16 / fp16, unit stride along V
    logits_stride,
    draft_ids_ptr,  # [num_draft_total] int64; -1 = padded
    cu_num_draft_ptr,  # [num_reqs + 1] int32
    temperature_ptr,  # [num_reqs] float32
    seeds_ptr,  # [num_reqs] int64
    positions_ptr,  # [num_reqs] int64
    threshold_ptr,  # [num_logits] float32; -inf = no top-k/top-p (unused without HAS_THRESHOLD)
    block_max_ptr,  # [num_logits, num_blocks] float32 out: max of x (random rows)
    block_sum_ptr,  # [num_logits, num_blocks] float32 out: sum of exp(x - block max)
    block_best_ptr,  # [num_logits, num_blocks] float32 out: best race score (greedy: max logit)
    block_token_ptr,  # [num_logits, num_blocks] int32 out: its token
    vocab_size,
    num_blocks,
    EXCLUDE_DRAFT: tl.constexpr,  # one-hot q: the own draft drops out of the race
    HAS_THRESHOLD: tl.constexpr,  # False: no row filters (top-k / top-p), threshold_ptr is not read
    CHUNK: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Grid (num_reqs, max_num_draft + 1, num_blocks): one pass over one chunk of one row."""
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
        token = chunk_start + lane
        temperature = tl.load(temperature_ptr + req)
        if temperature <= 0:  # greedy: the argmax of the raw logits
            best = tl.full([BLOCK_V], float("-inf"), tl.float32)
            for start in range(chunk_start, chunk_start + CHUNK, BLOCK_V):
                offs = start + lane
                logits = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
                best, token = _lane_argmax(logits, offs, best, token)
        else:
            inv_temperature = 1.0 / temperature
            threshold = _threshold(threshold_ptr, logits_row, HAS_THRESHOLD)
            key = row_key(tl.load(seeds_ptr + req), tl.load(positions_ptr + req) + row)
            excluded = tl.full([], -1, tl.int64)
            if EXCLUDE_DRAFT:
                excluded = tl.load(draft_ids_ptr + draft_start + row, mask=row < num_draft, other=-1)
            lane_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
            lane_sum = tl.zeros([BLOCK_V], tl.float32)
            best = tl.full([BLOCK_V], float("-inf"), tl.float32)
            for start in range(chunk_start, chunk_start + CHUNK, BLOCK_V):
                offs = start + lane
                x = _scaled_logits(row_ptr, offs, vocab_size, threshold, inv_temperature)
                # Online softmax per lane, one exp per element: exp(smaller - larger) either
                # rescales the running sum or is the new term.
                new_max = tl.maximum(lane_max, x)
                ratio = tl.exp(tl.minimum(lane_max, x) - tl.where(new_max == float("-inf"), 0.0, new_max))
                lane_sum = tl.where(x > lane_max, lane_sum * ratio + 1.0, lane_sum + ratio)
                lane_max = new_max
                # The race from p: argmax x - log E (Gumbel-max).
                score = x - tl.log(vocab_exponential(key, offs))
                score = tl.where(offs == excluded, float("-inf"), score)
                best, token = _lane_argmax(score, offs, best, token)
            chunk_max = tl.max(lane_max, axis=0)
            safe_max = tl.where(chunk_max == float("-inf"), 0.0, chunk_max)
            tl.store(block_max_ptr + out, chunk_max)
            tl.store(block_sum_ptr + out, tl.sum(lane_sum * tl.exp(lane_max - safe_max), axis=0))
        top, top_token = _first_argmax(best, token)
        tl.store(block_best_ptr + out, top)
        tl.store(block_token_ptr + out, top_token)


@triton.jit
def accept_kernel(
    block_max_ptr,  # [num_logits, num_blocks] float32
    block_sum_ptr,  # [num_logits, num_blocks] float32
    block_best_ptr,  # [num_logits, num_blocks] float32
    block_token_ptr,  # [num_logits, num_blocks] int32
    logits_ptr,  # [num_logits, V]
    logits_stride,
    draft_ids_ptr,  # [num_draft_total] int64
    cu_num_draft_ptr,  # [num_reqs + 1] int32
    temperature_ptr,  # [num_reqs] float32
    seeds_ptr,  # [num_reqs] int64
    positions_ptr,  # [num_reqs] int64
    threshold_ptr,  # [num_logits] float32
    q_ptr,  # dense: [num_draft_total, V]; sparse: probs [num_draft_total, K]; one-hot: unused
    q_stride,
    q_ids_ptr,  # sparse: ids [num_draft_total, K] int64; otherwise unused
    q_ids_stride,
    num_q_ids,  # K
    sampled_ptr,  # [num_reqs, num_cols] int64 out
    num_sampled_ptr,  # [num_reqs] int32 out
    num_rejected_ptr,  # [num_reqs] int32 out
    stop_max_ptr,  # [num_reqs] float32 out (dense / sparse): softmax max of the stop row
    stop_sum_ptr,  # [num_reqs] float32 out (dense / sparse): softmax sum of the stop row
    needs_residual_ptr,  # [num_reqs] int8 out (dense / sparse): the stop row rejected a draft
    vocab_size,
    num_blocks,
    num_cols,  # max_num_draft + 1
    Q_MODE: tl.constexpr,  # 0 one-hot, 1 dense, 2 sparse
    HAS_THRESHOLD: tl.constexpr,
    NUM_BLOCKS_PAD: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """Grid (num_reqs,): walk the rows until the first rejection; write the request's output."""
    req = tl.program_id(0)
    draft_start = tl.load(cu_num_draft_ptr + req).to(tl.int64)
    num_draft = tl.load(cu_num_draft_ptr + req + 1).to(tl.int64) - draft_start
    temperature = tl.load(temperature_ptr + req)
    greedy = temperature <= 0
    inv_temperature = 1.0 / tl.where(greedy, 1.0, temperature)
    seed = tl.load(seeds_ptr + req)
    position = tl.load(positions_ptr + req)
    blocks = tl.arange(0, NUM_BLOCKS_PAD)
    in_blocks = blocks < num_blocks

    searching = tl.full([], 1, tl.int32)
    num_accepted = num_draft
    stop_token = tl.zeros([], tl.int32)
    stop_max = tl.zeros([], tl.float32)
    stop_sum = tl.full([], 1.0, tl.float32)
    needs_residual = tl.zeros([], tl.int32)
    for j in range(0, num_draft + 1):
        if searching != 0:
            row = draft_start + req + j
            chunks = row * num_blocks + blocks
            best = tl.load(block_best_ptr + chunks, mask=in_blocks, other=float("-inf"))
            tokens = tl.load(block_token_ptr + chunks, mask=in_blocks, other=BIG_TOKEN)
            _, token = _first_argmax(best, tokens)
            draft = tl.load(draft_ids_ptr + draft_start + j, mask=j < num_draft, other=-1)
            has_draft = draft >= 0
            if greedy:
                accepted = (has_draft & (draft == token)).to(tl.int32)
                row_max = tl.zeros([], tl.float32)
                row_sum = tl.full([], 1.0, tl.float32)
            else:
                chunk_max = tl.load(block_max_ptr + chunks, mask=in_blocks, other=float("-inf"))
                chunk_sum = tl.load(block_sum_ptr + chunks, mask=in_blocks, other=0.0)
                row_max = tl.max(chunk_max, axis=0)
                row_sum = tl.sum(
                    tl.where(chunk_max == float("-inf"), 0.0, chunk_sum * tl.exp(chunk_max - row_max)), axis=0
                )
                safe_draft = tl.maximum(draft, 0)
                x_d = _scaled_logits(
                    logits_ptr + row * logits_stride, safe_draft, vocab_size,
                    _threshold(threshold_ptr, row, HAS_THRESHOLD), inv_temperature,
                )  # fmt: skip
                p_d = tl.exp(x_d - row_max) / row_sum
                q_d = _draft_prob(q_ptr, q_stride, q_ids_ptr, q_ids_stride, num_q_ids, draft_start + j,
                                  safe_draft, has_draft, Q_MODE, BLOCK_K)  # fmt: skip
                u = accept_uniform(row_key(seed, position + j))
                accepted = (has_draft & (q_d > 0) & (u * q_d < p_d)).to(tl.int32)
            if accepted == 0:
                searching = tl.zeros([], tl.int32)
                num_accepted = j
                stop_token = token
                stop_max = row_max
                stop_sum = row_sum
                needs_residual = (has_draft & (temperature > 0)).to(tl.int32)

    col = tl.arange(0, BLOCK_COLS)
    drafts = tl.load(draft_ids_ptr + draft_start + col, mask=col < num_accepted, other=-1)
    sampled = tl.where(col == num_accepted, stop_token.to(tl.int64), drafts)
    tl.store(sampled_ptr + req * num_cols + col, sampled, mask=col < num_cols)
    tl.store(num_sampled_ptr + req, (num_accepted + 1).to(tl.int32))
    tl.store(num_rejected_ptr + req, (num_draft - num_accepted).to(tl.int32))
    if Q_MODE != 0:
        tl.store(stop_max_ptr + req, stop_max)
        tl.store(stop_sum_ptr + req, stop_sum)
        tl.store(needs_residual_ptr + req, needs_residual.to(tl.int8))


@triton.jit
def residual_kernel(
    logits_ptr,  # [num_logits, V]
    logits_stride,
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
    needs_residual_ptr,  # [num_reqs] int8
    res_best_ptr,  # [num_reqs, num_blocks] float32 out: best of max(p - q, 0) / E
    res_token_ptr,  # [num_reqs, num_blocks] int32 out
    vocab_size,
    num_blocks,
    Q_MODE: tl.constexpr,  # 1 dense, 2 sparse
    HAS_THRESHOLD: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Grid (num_reqs, num_blocks): the residual race on the rejected stop row, one chunk."""
    req = tl.program_id(0)
    blk = tl.program_id(1)
    if tl.load(needs_residual_ptr + req) != 0:
        draft_start = tl.load(cu_num_draft_ptr + req).to(tl.int64)
        j = tl.load(num_sampled_ptr + req).to(tl.int64) - 1
        row = draft_start + req + j
        row_ptr = logits_ptr + row * logits_stride
        draft_index = draft_start + j
        inv_temperature = 1.0 / tl.load(temperature_ptr + req)
        threshold = _threshold(threshold_ptr, row, HAS_THRESHOLD)
        row_max = tl.load(stop_max_ptr + req)
        row_sum = tl.load(stop_sum_ptr + req)
        key = row_key(tl.load(seeds_ptr + req), tl.load(positions_ptr + req) + j)
        chunk_start = blk * CHUNK
        lane = tl.arange(0, BLOCK_V)
        best = tl.full([BLOCK_V], -1.0, tl.float32)
        token = chunk_start + lane
        for start in range(chunk_start, chunk_start + CHUNK, BLOCK_V):
            offs = start + lane
            x = _scaled_logits(row_ptr, offs, vocab_size, threshold, inv_temperature)
            p = tl.exp(x - row_max) / row_sum
            if Q_MODE == 1:
                q = tl.load(q_ptr + draft_index * q_stride + offs, mask=offs < vocab_size, other=0.0).to(tl.float32)
            else:
                q = tl.zeros([BLOCK_V], tl.float32)
                for k in range(num_q_ids):
                    q_id = tl.load(q_ids_ptr + draft_index * q_ids_stride + k)
                    q_prob = tl.load(q_ptr + draft_index * q_stride + k).to(tl.float32)
                    q += tl.where(offs == q_id, q_prob, 0.0)
            race = tl.maximum(p - q, 0.0) / vocab_exponential(key, offs)
            best, token = _lane_argmax(tl.where(offs < vocab_size, race, -1.0), offs, best, token)
        top, top_token = _first_argmax(best, token)
        tl.store(res_best_ptr + req * num_blocks + blk, top)
        tl.store(res_token_ptr + req * num_blocks + blk, top_token)


@triton.jit
def patch_residual_kernel(
    res_best_ptr,  # [num_reqs, num_blocks] float32
    res_token_ptr,  # [num_reqs, num_blocks] int32
    needs_residual_ptr,  # [num_reqs] int8
    num_sampled_ptr,  # [num_reqs] int32
    sampled_ptr,  # [num_reqs, num_cols] int64 in/out
    num_blocks,
    num_cols,
    NUM_BLOCKS_PAD: tl.constexpr,
):
    """Grid (num_reqs,): the residual race's winner replaces the stop token (if it has mass)."""
    req = tl.program_id(0)
    if tl.load(needs_residual_ptr + req) != 0:
        blocks = tl.arange(0, NUM_BLOCKS_PAD)
        in_blocks = blocks < num_blocks
        best = tl.load(res_best_ptr + req * num_blocks + blocks, mask=in_blocks, other=-1.0)
        tokens = tl.load(res_token_ptr + req * num_blocks + blocks, mask=in_blocks, other=BIG_TOKEN)
        top, token = _first_argmax(best, tokens)
        if top > 0:
            col = tl.load(num_sampled_ptr + req) - 1
            tl.store(sampled_ptr + req * num_cols + col, token.to(tl.int64))
