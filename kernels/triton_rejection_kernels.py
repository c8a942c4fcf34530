"""The rejection sampler's first kernel: softmax statistics (or the argmax) of every logits row,
then, per request, the walk to the first rejection; ``kernels/triton_rejection.py`` launches it.

Vocabulary rows are cut into chunks of ``CHUNK`` ids, so even a batch of one request fills the GPU, and
chunks into pieces of ``PIECE`` ids (``min(CHUNK, GROUP_SIZE)``), whose statistics are what the race's groups
are made of. Terms and the algorithm: ``kernels/reference.py``. Tensors named ``block_*`` hold one entry per
(logits row, piece). The race on the stop row is ``kernels/triton_race_kernel.py``.
"""

import triton
import triton.language as tl

from kernels.triton_group_race import GROUP_SIZE, piece_masses, race_stop_row
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
    publish,
    row_threshold,
    scaled_logits,
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
    block_max_ptr,  # [num_logits, num_pieces] float32: max of x (greedy rows: max logit)
    block_sum_ptr,  # [num_logits, num_pieces] float32: sum of exp(x - piece max) (random rows)
    block_token_ptr,  # [num_logits, num_pieces] int32: argmax (greedy rows: of the chunk, at its first piece)
    counter_ptr,  # [num_reqs] int32, 0 between calls
    sampled_ptr,  # [num_reqs, num_cols] int64 out (the stop column is patched by race_kernel)
    num_sampled_ptr,  # [num_reqs] int32 out
    num_rejected_ptr,  # [num_reqs] int32 out
    stop_max_ptr,  # [num_reqs] float32 out: softmax max of the stop row
    stop_sum_ptr,  # [num_reqs] float32 out: softmax sum of the stop row
    race_mode_ptr,  # [num_reqs] int32 out: what race_kernel does for the request
    vocab_size,
    num_pieces,  # per row: cdiv(V, PIECE)
    num_cols,  # max_num_draft + 1
    Q_MODE: tl.constexpr,  # 0 one-hot, 1 dense, 2 sparse
    HAS_THRESHOLD: tl.constexpr,
    CHUNK: tl.constexpr,
    PIECE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NUM_BLOCKS_PAD: tl.constexpr,  # next_power_of_2(cdiv(V, CHUNK))
    NUM_PIECES_PAD: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    num_groups=0,  # RACE_IN_STATS: cdiv(V, GROUP_SIZE)
    RACE_IN_STATS: tl.constexpr = False,  # one-hot / sparse q: race the stop row here, no race_kernel
    NUM_GROUPS_PAD: tl.constexpr = 1,
    RACE_TILE: tl.constexpr = 1,
    FAST_LOG2: tl.constexpr = False,
):
    """Grid (num_reqs, max_num_draft + 1, cdiv(V, CHUNK)): the one full pass over the logits, one chunk
    of one row per program; the request's last program then walks its rows to the first rejection."""
    req = tl.program_id(0)
    row = tl.program_id(1)
    blk = tl.program_id(2)
    draft_start = tl.load(cu_num_draft_ptr + req).to(tl.int64)
    num_draft = tl.load(cu_num_draft_ptr + req + 1).to(tl.int64) - draft_start
    if row <= num_draft:
        logits_row = draft_start + req + row
        row_ptr = logits_ptr + logits_row * logits_stride
        temperature = tl.load(temperature_ptr + req)
        chunk_start = blk * CHUNK
        if temperature <= 0:  # greedy: the argmax of the raw logits, one entry per chunk (at its first piece)
            lane = tl.arange(0, BLOCK_V)
            best = tl.full([BLOCK_V], float("-inf"), tl.float32)
            token = chunk_start + lane
            for start in range(chunk_start, chunk_start + CHUNK, BLOCK_V):
                offs = start + lane
                logits = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
                best, token = lane_argmax(logits, offs, best, token)
            top, top_token = first_argmax(best, token)
            out = logits_row * num_pieces + blk * (CHUNK // PIECE)
            publish(block_max_ptr + out, top)
            publish(block_token_ptr + out, top_token)
        else:
            _piece_stats(
                row_ptr, logits_row, chunk_start, num_pieces, threshold_ptr, 1.0 / temperature, vocab_size,
                block_max_ptr, block_sum_ptr, HAS_THRESHOLD, CHUNK, PIECE, BLOCK_V,
            )  # fmt: skip
        if last_of_request(counter_ptr, req, (num_draft + 1) * tl.num_programs(2)):
            _accept_request(
                req, draft_start, num_draft, logits_ptr, logits_stride, draft_ids_ptr, temperature_ptr, seeds_ptr,
                positions_ptr, threshold_ptr, q_ptr, q_stride, q_ids_ptr, q_ids_stride, num_q_ids, block_max_ptr,
                block_sum_ptr, block_token_ptr, sampled_ptr, num_sampled_ptr, num_rejected_ptr, stop_max_ptr,
                stop_sum_ptr, race_mode_ptr, vocab_size, tl.num_programs(2), num_pieces, num_cols,
                Q_MODE, HAS_THRESHOLD, CHUNK, PIECE, NUM_BLOCKS_PAD, NUM_PIECES_PAD, BLOCK_K, BLOCK_COLS,
                num_groups, RACE_IN_STATS, NUM_GROUPS_PAD, RACE_TILE, FAST_LOG2,
            )  # fmt: skip


@triton.jit
def _piece_stats(
    row_ptr, logits_row, chunk_start, num_pieces, threshold_ptr, inv_temperature, vocab_size, block_max_ptr,
    block_sum_ptr, HAS_THRESHOLD: tl.constexpr, CHUNK: tl.constexpr, PIECE: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """A random row's chunk: online softmax per lane, one exp per element, as a [pieces, ids] tile so that
    every lane stays in one piece and the pieces are reduced once, at the end."""
    NUM: tl.constexpr = CHUNK // PIECE
    WIDTH: tl.constexpr = BLOCK_V // NUM
    threshold = row_threshold(threshold_ptr, logits_row, HAS_THRESHOLD)
    piece = tl.arange(0, NUM)
    base = chunk_start + piece[:, None] * PIECE + tl.arange(0, WIDTH)[None, :]
    # A finite start (below any logit) keeps exp's argument finite without a guard per element.
    lane_max = tl.full([NUM, WIDTH], NO_MAX, tl.float32)
    lane_sum = tl.zeros([NUM, WIDTH], tl.float32)
    for start in range(0, PIECE, WIDTH):
        x = scaled_logits(row_ptr, base + start, vocab_size, threshold, inv_temperature, HAS_THRESHOLD)
        # exp(smaller - larger) either rescales the running sum or is the new term.
        new_max = tl.maximum(lane_max, x)
        ratio = tl.exp(tl.minimum(lane_max, x) - new_max)
        lane_sum = tl.where(x > lane_max, lane_sum * ratio + 1.0, lane_sum + ratio)
        lane_max = new_max
    piece_max = tl.max(lane_max, axis=1)
    piece_max = tl.where(piece_max == NO_MAX, float("-inf"), piece_max)  # nothing but -inf here
    safe_max = tl.where(piece_max == float("-inf"), 0.0, piece_max)
    piece_sum = tl.sum(lane_sum * tl.exp(lane_max - safe_max[:, None]), axis=1)
    piece_index = chunk_start // PIECE + piece
    out = logits_row * num_pieces + piece_index
    present = piece_index < num_pieces
    publish(block_max_ptr + out, piece_max, present)
    publish(block_sum_ptr + out, piece_sum, present)


@triton.jit
def _accept_request(
    req, draft_start, num_draft, logits_ptr, logits_stride, draft_ids_ptr, temperature_ptr, seeds_ptr, positions_ptr,
    threshold_ptr, q_ptr, q_stride, q_ids_ptr, q_ids_stride, num_q_ids, block_max_ptr, block_sum_ptr,
    block_token_ptr, sampled_ptr, num_sampled_ptr, num_rejected_ptr, stop_max_ptr, stop_sum_ptr, race_mode_ptr,
    vocab_size, num_blocks, num_pieces, num_cols,
    Q_MODE: tl.constexpr, HAS_THRESHOLD: tl.constexpr, CHUNK: tl.constexpr, PIECE: tl.constexpr,
    NUM_BLOCKS_PAD: tl.constexpr, NUM_PIECES_PAD: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_COLS: tl.constexpr, num_groups, RACE_IN_STATS: tl.constexpr,
    NUM_GROUPS_PAD: tl.constexpr, RACE_TILE: tl.constexpr, FAST_LOG2: tl.constexpr,
):  # fmt: skip
    """One request's rows in order until the first rejection; writes its output but the stop token
    of a random row, which ``race_kernel`` samples (``race_mode`` says from what), or with
    ``RACE_IN_STATS`` this program (one launch for the call; its registers cost the pass at large batches)."""
    temperature = tl.load(temperature_ptr + req)
    greedy = temperature <= 0
    inv_temperature = 1.0 / tl.where(greedy, 1.0, temperature)
    seed = tl.load(seeds_ptr + req)
    position = tl.load(positions_ptr + req)
    pieces = tl.arange(0, NUM_PIECES_PAD)
    in_pieces = pieces < num_pieces
    chunk_pieces = tl.arange(0, NUM_BLOCKS_PAD) * (CHUNK // PIECE)  # a greedy row's entry per chunk
    in_chunks = tl.arange(0, NUM_BLOCKS_PAD) < num_blocks

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
            row_pieces = row * num_pieces + pieces
            draft = tl.load(draft_ids_ptr + draft_start + j, mask=j < num_draft, other=-1)
            has_draft = draft >= 0
            if greedy:
                chunks = row * num_pieces + chunk_pieces
                chunk_max = tl.load(block_max_ptr + chunks, mask=in_chunks, other=float("-inf"), cache_modifier=".cg")
                tokens = tl.load(block_token_ptr + chunks, mask=in_chunks, other=BIG_TOKEN, cache_modifier=".cg")
                _, token = first_argmax(chunk_max, tokens)
                accepted = (has_draft & (draft == token)).to(tl.int32)
                row_max = tl.zeros([], tl.float32)
                row_sum = tl.full([], 1.0, tl.float32)
                mode = tl.full([], NO_RACE, tl.int32)
            else:
                token = tl.full([], -1, tl.int32)
                piece_max = tl.load(
                    block_max_ptr + row_pieces, mask=in_pieces, other=float("-inf"), cache_modifier=".cg"
                )
                piece_sum = tl.load(block_sum_ptr + row_pieces, mask=in_pieces, other=0.0, cache_modifier=".cg")
                row_max = tl.max(piece_max, axis=0)
                row_sum = tl.sum(
                    tl.where(piece_max == float("-inf"), 0.0, piece_sum * tl.exp(piece_max - row_max)), axis=0
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
            stop_row = draft_start + req + num_accepted
            draft_index = draft_start + num_accepted
            threshold = row_threshold(threshold_ptr, stop_row, HAS_THRESHOLD)
            p_masses = piece_masses(block_max_ptr, block_sum_ptr, stop_row * num_pieces, num_pieces, stop_max,
                                    stop_sum, NUM_GROUPS_PAD, GROUP_SIZE // PIECE)  # fmt: skip
            stop_token = race_stop_row(
                logits_ptr + stop_row * logits_stride, p_masses, p_masses, row_key(seed, position + num_accepted),
                race_mode, draft_ids_ptr + draft_index, q_ptr + draft_index * q_stride,
                q_ids_ptr + draft_index * q_ids_stride, num_q_ids, vocab_size, threshold, inv_temperature, stop_max,
                stop_sum, num_groups, Q_MODE, HAS_THRESHOLD, NUM_GROUPS_PAD, BLOCK_K, RACE_TILE, FAST_LOG2,
            )  # fmt: skip
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
