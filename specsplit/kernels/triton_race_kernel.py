"""The rejection sampler's second kernel: the two-level race on each random request's stop row
(recovered or bonus token; ``triton_group_race.py``); ``triton_rejection.py`` launches it
after ``specsplit/kernels/triton_rejection_kernels.py``.

One program per request races the groups, from masses the first pass already holds (p's pieces; a rejected
one-hot or sparse draft's ``min(p, q)`` taken out), then the ids of the winning group: 2,048 ids of noise
instead of a whole row. A rejected dense draft's residual ``max(p - q, 0)`` has group masses that no
statistic of the first pass holds: for those the grid has ``cdiv(V, CHUNK)`` programs per request that
read the stop row's p and q once and sum the residual per piece (``race_res``: one entry per (request,
piece)), and the request's last program races.
"""

import triton
import triton.language as tl

from specsplit.kernels.triton_group_race import GROUP_SIZE, piece_masses, piece_sums, race_stop_row
from specsplit.kernels.triton_rejection_common import (
    NO_RACE,
    RACE_RESIDUAL,
    UNALIGNED_INPUTS,
    last_of_request,
    publish,
    row_threshold,
    scaled_logits,
)
from specsplit.kernels.triton_rng import row_key


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
    q_ptr,  # dense: [num_draft_total, V]; sparse: probs [num_draft_total, K]; one-hot: unused
    q_stride,
    q_ids_ptr,  # sparse: ids [num_draft_total, K] int64
    q_ids_stride,
    num_q_ids,
    num_sampled_ptr,  # [num_reqs] int32: the stop row is num_sampled - 1
    race_mode_ptr,  # [num_reqs] int32
    row_max_ptr,  # [num_logits] float32: each row's softmax max and sum, from the first pass
    row_sum_ptr,
    block_max_ptr,  # [num_logits, num_stats_pieces] float32: the first pass's piece statistics
    block_sum_ptr,
    race_res_ptr,  # [num_reqs, num_pieces] float32: residual mass of each piece of the stop row
    counter_ptr,  # [num_reqs] int32, 0 between calls (the last program sets it back)
    sampled_ptr,  # [num_reqs, num_cols] int64 in/out
    vocab_size,
    num_pieces,  # cdiv(V, PIECE)
    num_stats_pieces,  # cdiv(V, STATS_PIECE)
    num_groups,
    num_cols,
    Q_MODE: tl.constexpr,  # 0 one-hot, 1 dense, 2 sparse
    HAS_THRESHOLD: tl.constexpr,
    CHUNK: tl.constexpr,
    PIECE: tl.constexpr,  # min(CHUNK, GROUP_SIZE)
    STATS_PIECE: tl.constexpr,
    BLOCK_V: tl.constexpr,  # the residual pass's tile
    RACE_TILE: tl.constexpr,  # the race's tile over the winning group
    NUM_GROUPS_PAD: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FAST_LOG2: tl.constexpr,  # GPU: approximate logs for the clocks and the Gumbel score (triton_rng.py)
):
    """Grid (num_reqs, cdiv(V, CHUNK) for dense q, else 1)."""
    req = tl.program_id(0)
    blk = tl.program_id(1)
    race_mode = tl.load(race_mode_ptr + req)
    if race_mode != NO_RACE:
        draft_start = tl.load(cu_num_draft_ptr + req).to(tl.int64)
        j = tl.load(num_sampled_ptr + req).to(tl.int64) - 1
        row = draft_start + req + j
        row_ptr = logits_ptr + row * logits_stride
        draft_index = draft_start + j
        row_q_ptr = q_ptr + draft_index * q_stride
        row_q_ids_ptr = q_ids_ptr + draft_index * q_ids_stride
        inv_temperature = 1.0 / tl.load(temperature_ptr + req)
        threshold = row_threshold(threshold_ptr, row, HAS_THRESHOLD)
        row_max = tl.load(row_max_ptr + row)
        row_sum = tl.load(row_sum_ptr + row)
        race_here = blk == 0
        if Q_MODE == 1:  # noqa: SIM102 (a compile-time branch around a run-time one)
            if race_mode == RACE_RESIDUAL:  # every program sums the residual of its pieces; the last one races
                lane = tl.arange(0, BLOCK_V)
                for piece in range(CHUNK // PIECE):
                    piece_index = blk * (CHUNK // PIECE) + piece
                    mass = tl.zeros([BLOCK_V], tl.float32)
                    for start in range(piece_index * PIECE, (piece_index + 1) * PIECE, BLOCK_V):
                        offs = start + lane
                        x = scaled_logits(row_ptr, offs, vocab_size, threshold, inv_temperature, HAS_THRESHOLD)
                        q = tl.load(row_q_ptr + offs, mask=offs < vocab_size, other=0.0).to(tl.float32)
                        mass += tl.maximum(tl.exp(x - row_max) / row_sum - q, 0.0)
                    if piece_index < num_pieces:
                        publish(race_res_ptr + req * num_pieces + piece_index, tl.sum(mass, axis=0))
                race_here = last_of_request(counter_ptr, req, tl.num_programs(1))
                if race_here:
                    tl.store(counter_ptr + req, 0)  # 0 again for the next call
        if race_here:
            p_masses = piece_masses(block_max_ptr, block_sum_ptr, row * num_stats_pieces, num_stats_pieces,
                                    row_max, row_sum, NUM_GROUPS_PAD, GROUP_SIZE // STATS_PIECE)  # fmt: skip
            masses = p_masses
            if Q_MODE == 1:  # noqa: SIM102 (a compile-time branch around a run-time one)
                if race_mode == RACE_RESIDUAL:
                    masses = piece_sums(race_res_ptr, req * num_pieces, num_pieces, NUM_GROUPS_PAD,
                                        GROUP_SIZE // PIECE)  # fmt: skip
            key = row_key(tl.load(seeds_ptr + req), tl.load(positions_ptr + req) + j)
            winner = race_stop_row(
                row_ptr, masses, p_masses, key, race_mode, draft_ids_ptr + draft_index, row_q_ptr, row_q_ids_ptr,
                num_q_ids, vocab_size, threshold, inv_temperature, row_max, row_sum, num_groups,
                Q_MODE, HAS_THRESHOLD, NUM_GROUPS_PAD, BLOCK_K, RACE_TILE, FAST_LOG2,
            )  # fmt: skip
            tl.store(sampled_ptr + req * num_cols + j, winner.to(tl.int64))
