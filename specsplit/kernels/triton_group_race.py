"""The two-level race of a stop row (``specsplit/kernels/reference.py``): first the group of ``GROUP_SIZE`` ids, from
the groups' masses, then the id within that group. Run by one program per request once the row's softmax
statistics are known: in ``specsplit/kernels/triton_race_kernel.py``, or for small one-hot and sparse calls in the last
program of ``specsplit/kernels/triton_rejection_kernels.py`` (``Launch.race_in_stats``).

Masses come from per-piece statistics: a piece is ``PIECE`` consecutive ids (a power of 2 dividing
``GROUP_SIZE``), each with its max ``m`` and its sum of ``exp(x - m)``; a group's mass in units of p is
``sum over its pieces of s * exp(m - row_max) / row_sum``.
"""

import triton
import triton.language as tl

import specsplit.kernels.rng as rng
from specsplit.kernels.triton_rejection_common import (
    LOG2E,
    RACE_P,
    RACE_P_EXCLUDE_DRAFT,
    RACE_RESIDUAL,
    first_argmax,
    lane_argmax,
    scaled_logits,
)
from specsplit.kernels.triton_rng import log2, vocab_clocks

GROUP_SIZE = tl.constexpr(rng.GROUP_SIZE)
GROUP_INDEX = tl.constexpr(rng.GROUP_INDEX)


@triton.jit
def vocab_id(token, vocab_size):
    """An int64 token id as int32 (compared with int32 offsets: no int64 per element); -1 where it is
    no vocabulary id, so it still matches none."""
    return tl.where((token >= 0) & (token < vocab_size), token, -1).to(tl.int32)


@triton.jit
def p_race_score(x, key, offs, excluded, FAST_LOG2: tl.constexpr):
    """The race from p, Gumbel-max in base 2: ``x log2(e) - log2 C`` per vocabulary id ``offs`` of the
    row with ``key``; -inf at ``excluded`` (a rejected one-hot draft; -1 excludes nothing)."""
    clock = vocab_clocks(key, offs, FAST_LOG2)
    score = x * LOG2E - log2(clock, FAST_LOG2)
    return tl.where(offs == excluded, float("-inf"), score)


@triton.jit
def piece_sums(sum_ptr, first_piece, num_pieces, NUM_GROUPS_PAD: tl.constexpr, PIECES_PER_GROUP: tl.constexpr):
    """[NUM_GROUPS_PAD] sum of each group's pieces (already in units of p), read past L1."""
    group = tl.arange(0, NUM_GROUPS_PAD)[:, None]
    piece = group * PIECES_PER_GROUP + tl.arange(0, PIECES_PER_GROUP)[None, :]
    s = tl.load(sum_ptr + first_piece + piece, mask=piece < num_pieces, other=0.0, cache_modifier=".cg")
    return tl.sum(s, axis=1)


@triton.jit
def piece_masses(max_ptr, sum_ptr, first_piece, num_pieces, row_max, row_sum,
                 NUM_GROUPS_PAD: tl.constexpr, PIECES_PER_GROUP: tl.constexpr):  # fmt: skip
    """[NUM_GROUPS_PAD] mass of each group in units of p, from the row's pieces at ``first_piece`` (0 past the
    last group). Pieces were written by other programs: read past L1."""
    group = tl.arange(0, NUM_GROUPS_PAD)[:, None]
    piece = group * PIECES_PER_GROUP + tl.arange(0, PIECES_PER_GROUP)[None, :]
    present = piece < num_pieces
    m = tl.load(max_ptr + first_piece + piece, mask=present, other=float("-inf"), cache_modifier=".cg")
    s = tl.load(sum_ptr + first_piece + piece, mask=present, other=0.0, cache_modifier=".cg")
    return tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - row_max)), axis=1) / row_sum


@triton.jit
def without_draft(masses, row_ptr, draft_ptr, q_ptr, q_ids_ptr, num_q_ids, vocab_size, threshold, inv_temperature,
                  row_max, row_sum, Q_MODE: tl.constexpr, HAS_THRESHOLD: tl.constexpr, NUM_GROUPS_PAD: tl.constexpr,
                  BLOCK_K: tl.constexpr):  # fmt: skip
    """The group masses of the residual ``max(p - q, 0)`` from those of p: each id q lists gives up
    ``min(p, q)`` (one-hot q: the draft, p(d)); clamped at 0 against rounding. A sum less a part of it
    loses relative precision where the part is most of the group, by at most ~1e-7 of p's mass; the
    rejection that needs the residual happens with probability sum(max(p - q, 0)), which keeps the
    token distribution's error at float32 rounding level."""
    k = tl.arange(0, BLOCK_K)
    if Q_MODE == 2:
        listed = k < num_q_ids
        ids = vocab_id(tl.load(q_ids_ptr + k, mask=listed, other=-1), vocab_size)
        q = tl.load(q_ptr + k, mask=listed, other=0.0).to(tl.float32)
    else:
        ids = vocab_id(tl.load(draft_ptr + k, mask=k < 1, other=-1), vocab_size)
        q = tl.full([BLOCK_K], 1.0, tl.float32)
    x = scaled_logits(row_ptr, tl.maximum(ids, 0), vocab_size, threshold, inv_temperature, HAS_THRESHOLD)
    taken = tl.where(ids >= 0, tl.minimum(tl.exp(x - row_max) / row_sum, q), 0.0)
    group = tl.arange(0, NUM_GROUPS_PAD)[:, None]
    taken_per_group = tl.sum(
        tl.where(group == (tl.maximum(ids, 0) // GROUP_SIZE)[None, :], taken[None, :], 0.0), axis=1
    )
    return tl.maximum(masses - taken_per_group, 0.0)


@triton.jit
def race_groups(masses, p_masses, key, num_groups, NUM_GROUPS_PAD: tl.constexpr, FAST_LOG2: tl.constexpr):
    """argmax mass / C_g over the groups (``p_masses`` where ``masses`` has none), lowest group on ties."""
    group = tl.arange(0, NUM_GROUPS_PAD)
    clock = vocab_clocks(key, group.to(tl.uint32) | GROUP_INDEX, FAST_LOG2)
    valid = group < num_groups
    top, winner = first_argmax(tl.where(valid, masses / clock, -1.0), group)
    if top <= 0:
        _, winner = first_argmax(tl.where(valid, p_masses / clock, -1.0), group)
    return winner


@triton.jit
def race_in_group(row_ptr, key, group, excluded, vocab_size, threshold, inv_temperature, row_max, row_sum,
                  q_ptr, q_ids_ptr, num_q_ids, RESIDUAL: tl.constexpr, Q_MODE: tl.constexpr,
                  HAS_THRESHOLD: tl.constexpr, BLOCK_V: tl.constexpr, FAST_LOG2: tl.constexpr):  # fmt: skip
    """The id the race picks within ``group``: from p without ``excluded`` (-1: nothing excluded); with
    ``RESIDUAL``, from max(p - q, 0) of the row's dense q (``Q_MODE`` 1) or sparse K ids (2), and from p if
    that is 0 over the whole group. Ties go to the lowest id; the group's first id if nothing scores."""
    group_start = group * GROUP_SIZE
    lane = tl.arange(0, BLOCK_V)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    token = group_start + lane
    residual_best = tl.full([BLOCK_V], -1.0, tl.float32)
    residual_token = group_start + lane
    for start in range(group_start, tl.minimum(group_start + GROUP_SIZE, vocab_size), BLOCK_V):
        offs = start + lane
        x = scaled_logits(row_ptr, offs, vocab_size, threshold, inv_temperature, HAS_THRESHOLD)
        if RESIDUAL:
            p = tl.exp(x - row_max) / row_sum
            if Q_MODE == 1:
                q = tl.load(q_ptr + offs, mask=offs < vocab_size, other=0.0).to(tl.float32)
            else:
                q = tl.zeros([BLOCK_V], tl.float32)
                for k in range(num_q_ids):
                    q_id = vocab_id(tl.load(q_ids_ptr + k), vocab_size)
                    if (q_id >= start) & (q_id < start + BLOCK_V):  # most tiles hold none of the K ids
                        q += tl.where(offs == q_id, tl.load(q_ptr + k).to(tl.float32), 0.0)
            clock = vocab_clocks(key, offs, FAST_LOG2)
            race = tl.where(offs < vocab_size, tl.maximum(p - q, 0.0) / clock, -1.0)
            residual_best, residual_token = lane_argmax(race, offs, residual_best, residual_token)
            best, token = lane_argmax(x * LOG2E - log2(clock, FAST_LOG2), offs, best, token)
        else:
            best, token = lane_argmax(p_race_score(x, key, offs, excluded, FAST_LOG2), offs, best, token)
    _, winner = first_argmax(best, token)
    if RESIDUAL:
        residual_top, residual_winner = first_argmax(residual_best, residual_token)
        if residual_top > 0:
            winner = residual_winner
    return winner


@triton.jit
def race_stop_row(row_ptr, masses, p_masses, key, race_mode, draft_ptr, q_ptr, q_ids_ptr, num_q_ids, vocab_size,
                  threshold, inv_temperature, row_max, row_sum, num_groups, Q_MODE: tl.constexpr,
                  HAS_THRESHOLD: tl.constexpr, NUM_GROUPS_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
                  RACE_TILE: tl.constexpr, FAST_LOG2: tl.constexpr):  # fmt: skip
    """The stop row's token (``race_mode``: triton_rejection_common.py). ``masses``: the groups' masses
    of p, or for dense q at a rejected draft of its residual; one-hot and sparse q take the rejected draft's
    ``min(p, q)`` out here. ``draft_ptr``, ``q_ptr``, ``q_ids_ptr``: the stop row's draft and q."""
    if Q_MODE != 1:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if race_mode != RACE_P:
            masses = without_draft(
                masses, row_ptr, draft_ptr, q_ptr, q_ids_ptr, num_q_ids, vocab_size, threshold, inv_temperature,
                row_max, row_sum, Q_MODE, HAS_THRESHOLD, NUM_GROUPS_PAD, BLOCK_K,
            )  # fmt: skip
    group = race_groups(masses, p_masses, key, num_groups, NUM_GROUPS_PAD, FAST_LOG2)
    excluded = tl.full([], -1, tl.int32)
    if race_mode == RACE_P_EXCLUDE_DRAFT:
        excluded = vocab_id(tl.load(draft_ptr), vocab_size)
    if race_mode == RACE_RESIDUAL:
        winner = race_in_group(row_ptr, key, group, excluded, vocab_size, threshold, inv_temperature, row_max,
                               row_sum, q_ptr, q_ids_ptr, num_q_ids, True, Q_MODE, HAS_THRESHOLD, RACE_TILE,
                               FAST_LOG2)  # fmt: skip
    else:
        winner = race_in_group(row_ptr, key, group, excluded, vocab_size, threshold, inv_temperature, row_max,
                               row_sum, q_ptr, q_ids_ptr, num_q_ids, False, Q_MODE, HAS_THRESHOLD, RACE_TILE,
                               FAST_LOG2)  # fmt: skip
    return winner


@triton.jit
def race_p(row_ptr, p_masses, key, vocab_size, threshold, inv_temperature, num_groups, HAS_THRESHOLD: tl.constexpr,
           NUM_GROUPS_PAD: tl.constexpr, RACE_TILE: tl.constexpr, FAST_LOG2: tl.constexpr):  # fmt: skip
    """The target's own sample at a row (a coupled row's token): the race from p, nothing excluded; ``p_masses``:
    the groups' masses of p."""
    group = race_groups(p_masses, p_masses, key, num_groups, NUM_GROUPS_PAD, FAST_LOG2)
    nothing = tl.full([], -1, tl.int32)
    # Without RESIDUAL the race reads neither the row's softmax statistics nor a q: placeholders.
    return race_in_group(row_ptr, key, group, nothing, vocab_size, threshold, inv_temperature, 0.0, 1.0, row_ptr,
                         row_ptr, 0, False, 0, HAS_THRESHOLD, RACE_TILE, FAST_LOG2)  # fmt: skip
