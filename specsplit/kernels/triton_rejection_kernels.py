"""The rejection sampler's first kernel: softmax statistics (or the argmax) of every logits row,
then, per request, the walk to the first rejection; ``specsplit/kernels/triton_rejection.py`` launches it.

Vocabulary rows are cut into chunks of ``CHUNK`` ids, so even a batch of one request fills the GPU, and
chunks into pieces of ``PIECE`` ids (``min(CHUNK, GROUP_SIZE)``), whose statistics are what the race's groups
are made of. Terms and the algorithm: ``specsplit/kernels/reference.py``. Tensors named ``block_*`` hold one entry per
(logits row, piece). The race on the stop row is ``specsplit/kernels/triton_race_kernel.py``.
"""

import triton
import triton.language as tl

from specsplit.kernels.triton_group_race import GROUP_SIZE, piece_masses, race_p, race_stop_row
from specsplit.kernels.triton_rejection_common import (
    BIG_TOKEN,
    NO_MAX,
    NO_RACE,
    RACE_P,
    RACE_P_EXCLUDE_DRAFT,
    RACE_RESIDUAL,
    ROW_BITS,
    UNALIGNED_INPUTS,
    first_argmax,
    lane_argmax,
    last_of_request,
    publish,
    row_threshold,
    scaled_logits,
)
from specsplit.kernels.triton_rng import accept_uniform, row_key


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
@triton.jit(do_not_specialize=["num_cols"], do_not_specialize_on_alignment=[*UNALIGNED_INPUTS, "coupled_ptr"])
def stats_accept_kernel(
    logits_ptr,  # [num_logits, V] float32 / bf16 / fp16, unit stride along V
    logits_stride,
    draft_ids_ptr,  # [num_draft_total] int64; -1 = padded
    cu_num_draft_ptr,  # [num_reqs + 1] int32
    temperature_ptr,  # [num_reqs] float32
    seeds_ptr,  # [num_reqs] int64
    positions_ptr,  # [num_reqs] int64
    coupled_ptr,  # [num_reqs] int32: nonzero for a coupled request (read only with COUPLED)
    threshold_ptr,  # [num_logits] float32 (read only with HAS_THRESHOLD)
    q_ptr,  # dense: [num_draft_total, V]; sparse: probs [num_draft_total, K]; one-hot: unused
    q_stride,
    q_ids_ptr,  # sparse: ids [num_draft_total, K] int64; otherwise unused
    q_ids_stride,
    num_q_ids,  # K
    block_max_ptr,  # [num_logits, num_pieces] float32: max of x (greedy rows: max logit)
    block_sum_ptr,  # [num_logits, num_pieces] float32: sum of exp(x - piece max) (random rows)
    block_token_ptr,  # [num_logits, num_pieces] int32: argmax (greedy rows: of the chunk, at its first piece)
    row_counter_ptr,  # [num_logits] int32, 0 between calls: the row's chunks done (or skipped)
    row_max_ptr,  # [num_logits] float32: the row's softmax max (written by the row's last program)
    row_sum_ptr,  # [num_logits] float32: and sum
    row_token_ptr,  # [num_logits] int32: a greedy row's argmax
    state_ptr,  # [num_reqs] int64, 0 between calls: bit j once row j is done, bit ROW_BITS + j if it was rejected
    sampled_ptr,  # [num_reqs, num_cols] int64 out (the stop column is patched by race_kernel)
    num_sampled_ptr,  # [num_reqs] int32 out
    num_rejected_ptr,  # [num_reqs] int32 out
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
    COUPLED: tl.constexpr = False,  # some request is coupled: its rows race here (its draft is accepted iff it won)
):
    """Grid (cdiv(V, CHUNK) * num_reqs, max_num_draft + 1): the one full pass over the logits, one chunk of
    one row per program, rows in order (the GPU starts programs roughly in grid order). The chunk and the
    request share axis 0, chunk fastest, since CUDA caps a grid's axes 1 and 2 at 65,535 programs and a batch
    may hold more requests; the GPU's launch order stays that of a (chunk, request, row) grid. A row's last
    program decides its acceptance and marks the row done (and rejected) in the request's state; a
    rejection tells the request's later rows, whose programs that start after it read nothing (no token
    depends on a row after the first rejection). The program whose mark completes the rows up to the
    first rejection writes the request's output at once, not after the rows past it: with the race in
    this kernel, the race runs while other requests still stream. Every counter is back at 0 when the
    call ends."""
    num_blocks = tl.cdiv(vocab_size, CHUNK)
    req = tl.program_id(0) // num_blocks
    blk = tl.program_id(0) - req * num_blocks
    row = tl.program_id(1)
    draft_start = tl.load(cu_num_draft_ptr + req).to(tl.int64)
    num_draft = tl.load(cu_num_draft_ptr + req + 1).to(tl.int64) - draft_start
    temperature = tl.load(temperature_ptr + req)
    coupled = temperature < 0  # False: temperatures are >= 0
    if COUPLED:
        coupled = (tl.load(coupled_ptr + req) != 0) & (temperature > 0)
    if row <= num_draft:
        logits_row = draft_start + req + row
        row_ptr = logits_ptr + logits_row * logits_stride
        # What the row's last program needs to accept or reject: the draft and, for random rows, its x and
        # q(d), loaded by every program while its chunk streams in, off the request's critical path.
        draft = tl.load(draft_ids_ptr + draft_start + row, mask=row < num_draft, other=-1)
        safe_draft = tl.maximum(draft, 0)
        inv_temperature = 1.0 / tl.where(temperature > 0, temperature, 1.0)
        threshold = row_threshold(threshold_ptr, logits_row, HAS_THRESHOLD)
        x_d = scaled_logits(row_ptr, safe_draft, vocab_size, threshold, inv_temperature, HAS_THRESHOLD)
        q_d = _draft_prob(q_ptr, q_stride, q_ids_ptr, q_ids_stride, num_q_ids, draft_start + row, safe_draft,
                          draft >= 0, Q_MODE, BLOCK_K)  # fmt: skip
        if _needed(state_ptr, req, row):
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
                    row_ptr, logits_row, chunk_start, num_pieces, threshold, inv_temperature, vocab_size,
                    block_max_ptr, block_sum_ptr, HAS_THRESHOLD, CHUNK, PIECE, BLOCK_V,
                )  # fmt: skip
        if last_of_request(row_counter_ptr, logits_row, num_blocks):
            tl.store(row_counter_ptr + logits_row, 0)
            mark = tl.full([], 1, tl.int64) << row.to(tl.int64)
            # A chunk skips only after an earlier rejection, which this read then sees too (release/acquire
            # through the row's counter): a row cut short is not needed, and its acceptance is not worked out.
            if _needed(state_ptr, req, row):
                accepted = _accept_row(
                    req, row, logits_row, draft, x_d, q_d, temperature, seeds_ptr, positions_ptr, block_max_ptr,
                    block_sum_ptr, block_token_ptr, row_max_ptr, row_sum_ptr, row_token_ptr, num_blocks,
                    num_pieces, CHUNK, PIECE, NUM_BLOCKS_PAD, NUM_PIECES_PAD, coupled, row_ptr, threshold,
                    inv_temperature, vocab_size, num_groups, COUPLED, HAS_THRESHOLD, NUM_GROUPS_PAD, RACE_TILE,
                    FAST_LOG2,
                )  # fmt: skip
                mark = tl.where(accepted, mark, mark | (mark << ROW_BITS))
            stop, finish, last = _mark_row(state_ptr, req, mark, num_draft)
            if last:  # every row is done: no program of the request reads its state any more
                tl.store(state_ptr + req, 0)
            if finish:
                _finish_request(
                    req, draft_start, num_draft, stop, logits_ptr, logits_stride, draft_ids_ptr, temperature, coupled,
                    seeds_ptr, positions_ptr, threshold_ptr, q_ptr, q_stride, q_ids_ptr, q_ids_stride, num_q_ids,
                    block_max_ptr, block_sum_ptr, row_max_ptr, row_sum_ptr, row_token_ptr, sampled_ptr, num_sampled_ptr,
                    num_rejected_ptr, race_mode_ptr, vocab_size, num_pieces, num_cols, Q_MODE, HAS_THRESHOLD, PIECE,
                    BLOCK_K, BLOCK_COLS, num_groups, RACE_IN_STATS, NUM_GROUPS_PAD, RACE_TILE, FAST_LOG2,
                )  # fmt: skip


@triton.jit
def _needed(state_ptr, req, row):
    """False once an earlier row of the request is known to be rejected. The state changes while programs run,
    so it is read by an atomic, whose one value the whole program shares: a plain load would be issued by
    every thread, and threads reading different values would split the program's branches (and barriers)."""
    needed = row >= 0
    if row > 0:  # row 0 is always needed
        state = tl.atomic_add(state_ptr + req, 0, sem="relaxed")
        rows_before = (tl.full([], 1, tl.int64) << row.to(tl.int64)) - 1
        needed = (state >> ROW_BITS) & rows_before == 0
    return needed


@triton.jit
def _stop_row(state):
    """(the first rejected row, whether every row up to it is done) in a request's state; the first part is
    ROW_BITS while no row is known rejected. Once true, the second part stays true and the row stays the
    stop row: rows before it are done and accepted."""
    col = tl.arange(0, ROW_BITS)
    stop = tl.min(tl.where(((state >> ROW_BITS) >> col) & 1 == 1, col, ROW_BITS), axis=0)
    rows_to_stop = (tl.full([], 2, tl.int64) << stop.to(tl.int64)) - 1
    return stop, (stop < ROW_BITS) & (state & rows_to_stop == rows_to_stop)


@triton.jit
def _mark_row(state_ptr, req, mark, num_draft):
    """Marks a row done (and rejected) with one atomic OR. Returns the stop row as the state now stands,
    whether this mark completed the rows up to it (true for exactly one program of the request, which
    then writes the output), and whether it completed all the request's rows (which zeroes the state)."""
    tl.debug_barrier()  # the row's results, whatever thread published them, before the release
    old = tl.atomic_or(state_ptr + req, mark, sem="acq_rel")
    tl.debug_barrier()  # and the finishing program's loads after the acquire
    new = old | mark
    stop, complete = _stop_row(new)
    _, was_complete = _stop_row(old)
    all_rows = (tl.full([], 2, tl.int64) << num_draft) - 1
    last = (new & all_rows == all_rows) & (old & all_rows != all_rows)
    return stop, complete & ~was_complete, last


@triton.jit
def _piece_stats(
    row_ptr, logits_row, chunk_start, num_pieces, threshold, inv_temperature, vocab_size, block_max_ptr,
    block_sum_ptr, HAS_THRESHOLD: tl.constexpr, CHUNK: tl.constexpr, PIECE: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """A random row's chunk: online softmax per lane, one exp per element, as a [pieces, ids] tile so that
    every lane stays in one piece and the pieces are reduced once, at the end."""
    NUM: tl.constexpr = CHUNK // PIECE
    WIDTH: tl.constexpr = BLOCK_V // NUM
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
def _accept_row(
    req, j, row, draft, x_d, q_d, temperature, seeds_ptr, positions_ptr, block_max_ptr, block_sum_ptr, block_token_ptr,
    row_max_ptr, row_sum_ptr, row_token_ptr, num_blocks, num_pieces, CHUNK: tl.constexpr, PIECE: tl.constexpr,
    NUM_BLOCKS_PAD: tl.constexpr, NUM_PIECES_PAD: tl.constexpr, coupled, row_ptr, threshold, inv_temperature,
    vocab_size, num_groups, COUPLED: tl.constexpr, HAS_THRESHOLD: tl.constexpr, NUM_GROUPS_PAD: tl.constexpr,
    RACE_TILE: tl.constexpr, FAST_LOG2: tl.constexpr,
):  # fmt: skip
    """Row j of the request (logits row ``row``), once all its chunks are in: combine the statistics, accept or
    reject the draft (the bonus row has none: never accepted), publish what the request's output needs from
    the row and return whether it is accepted. A coupled row races here: its token (published as a greedy row's
    argmax is) is the target's own sample, and its draft is accepted iff it is that token."""
    has_draft = draft >= 0
    if temperature <= 0:
        chunks = row * num_pieces + tl.arange(0, NUM_BLOCKS_PAD) * (CHUNK // PIECE)  # one entry per chunk
        in_chunks = tl.arange(0, NUM_BLOCKS_PAD) < num_blocks
        chunk_max = tl.load(block_max_ptr + chunks, mask=in_chunks, other=float("-inf"), cache_modifier=".cg")
        tokens = tl.load(block_token_ptr + chunks, mask=in_chunks, other=BIG_TOKEN, cache_modifier=".cg")
        _, token = first_argmax(chunk_max, tokens)
        accepted = has_draft & (draft == token)
        publish(row_token_ptr + row, token)
    else:
        pieces = tl.arange(0, NUM_PIECES_PAD)
        in_pieces = pieces < num_pieces
        row_pieces = row * num_pieces + pieces
        piece_max = tl.load(block_max_ptr + row_pieces, mask=in_pieces, other=float("-inf"), cache_modifier=".cg")
        piece_sum = tl.load(block_sum_ptr + row_pieces, mask=in_pieces, other=0.0, cache_modifier=".cg")
        row_max = tl.max(piece_max, axis=0)
        row_sum = tl.sum(tl.where(piece_max == float("-inf"), 0.0, piece_sum * tl.exp(piece_max - row_max)), axis=0)
        p_d = tl.exp(x_d - row_max) / row_sum
        key = row_key(tl.load(seeds_ptr + req), tl.load(positions_ptr + req) + j)
        accepted = has_draft & (q_d > 0) & (accept_uniform(key) * q_d < p_d)
        if COUPLED:  # noqa: SIM102 (a compile-time branch around a run-time one)
            if coupled:
                p_masses = piece_masses(block_max_ptr, block_sum_ptr, row * num_pieces, num_pieces, row_max, row_sum,
                                        NUM_GROUPS_PAD, GROUP_SIZE // PIECE)  # fmt: skip
                token = race_p(row_ptr, p_masses, key, vocab_size, threshold, inv_temperature, num_groups,
                               HAS_THRESHOLD, NUM_GROUPS_PAD, RACE_TILE, FAST_LOG2)  # fmt: skip
                accepted = has_draft & (draft == token)
                publish(row_token_ptr + row, token)
        publish(row_max_ptr + row, row_max)
        publish(row_sum_ptr + row, row_sum)
    return accepted


@triton.jit
def _finish_request(
    req, draft_start, num_draft, num_accepted, logits_ptr, logits_stride, draft_ids_ptr, temperature, coupled,
    seeds_ptr, positions_ptr, threshold_ptr, q_ptr, q_stride, q_ids_ptr, q_ids_stride, num_q_ids, block_max_ptr,
    block_sum_ptr, row_max_ptr, row_sum_ptr, row_token_ptr, sampled_ptr, num_sampled_ptr, num_rejected_ptr,
    race_mode_ptr, vocab_size, num_pieces, num_cols, Q_MODE: tl.constexpr,
    HAS_THRESHOLD: tl.constexpr, PIECE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_COLS: tl.constexpr, num_groups,
    RACE_IN_STATS: tl.constexpr, NUM_GROUPS_PAD: tl.constexpr, RACE_TILE: tl.constexpr, FAST_LOG2: tl.constexpr,
):  # fmt: skip
    """The request's output once its rows up to the first rejection (row ``num_accepted``) are decided: the
    accepted drafts, and the stop token of a greedy or coupled row; a random stop row's token is left to
    ``race_kernel`` (``race_mode`` says from what), or with ``RACE_IN_STATS`` raced by this program (one
    launch for the call; its registers cost the pass at large batches)."""
    first_row = draft_start + req
    col = tl.arange(0, BLOCK_COLS)
    num_accepted = num_accepted.to(tl.int64)
    drafts = tl.load(draft_ids_ptr + draft_start + col, mask=col < num_draft, other=-1)
    at_stop = col == num_accepted
    stop_row = first_row + num_accepted
    draft_index = draft_start + num_accepted
    stop_draft = tl.max(tl.where(at_stop, drafts, -1), axis=0)
    # A greedy or coupled row published its token; another random row's entry holds anything.
    published = (temperature <= 0) | coupled
    stop_token = tl.where(published, tl.load(row_token_ptr + stop_row, cache_modifier=".cg"), -1)
    if published:
        race_mode = tl.full([], NO_RACE, tl.int32)
    elif Q_MODE == 0:  # a rejected one-hot draft drops out of the race from p
        race_mode = tl.where(stop_draft >= 0, RACE_P_EXCLUDE_DRAFT, RACE_P).to(tl.int32)
    else:
        race_mode = tl.where(stop_draft >= 0, RACE_RESIDUAL, RACE_P).to(tl.int32)

    if RACE_IN_STATS:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if race_mode != NO_RACE:
            threshold = row_threshold(threshold_ptr, stop_row, HAS_THRESHOLD)
            stop_max = tl.load(row_max_ptr + stop_row, cache_modifier=".cg")
            stop_sum = tl.load(row_sum_ptr + stop_row, cache_modifier=".cg")
            p_masses = piece_masses(block_max_ptr, block_sum_ptr, stop_row * num_pieces, num_pieces, stop_max,
                                    stop_sum, NUM_GROUPS_PAD, GROUP_SIZE // PIECE)  # fmt: skip
            key = row_key(tl.load(seeds_ptr + req), tl.load(positions_ptr + req) + num_accepted)
            stop_token = race_stop_row(
                logits_ptr + stop_row * logits_stride, p_masses, p_masses, key, race_mode,
                draft_ids_ptr + draft_index, q_ptr + draft_index * q_stride, q_ids_ptr + draft_index * q_ids_stride,
                num_q_ids, vocab_size, threshold, 1.0 / temperature, stop_max, stop_sum, num_groups, Q_MODE,
                HAS_THRESHOLD, NUM_GROUPS_PAD, BLOCK_K, RACE_TILE, FAST_LOG2,
            )  # fmt: skip
            race_mode = tl.full([], NO_RACE, tl.int32)
    sampled = tl.where(at_stop, stop_token.to(tl.int64), tl.where(col < num_accepted, drafts, -1))
    tl.store(sampled_ptr + req * num_cols + col, sampled, mask=col < num_cols)
    tl.store(num_sampled_ptr + req, (num_accepted + 1).to(tl.int32))
    tl.store(num_rejected_ptr + req, (num_draft - num_accepted).to(tl.int32))
    tl.store(race_mode_ptr + req, race_mode)
