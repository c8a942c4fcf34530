"""Triton rejection sampler: the same function as ``specsplit/kernels/reference.py``, on the GPU.

Terms (accepted / recovered / bonus, x, p, q, the two-level exponential race) are defined in the
reference's docstring. Every logits row is cut into chunks of vocabulary ids, one per program, each kernel
with its own chunk size (``specsplit/kernels/triton_rejection_launch.py``), and chunks into pieces of at most
``GROUP_SIZE`` ids, whose statistics make up the race's groups.

1. ``stats_accept_kernel``, grid ``(num_stats_chunks * num_reqs, max_num_draft + 1)``: the only full pass
   over the logits, rows in order. Per (row, piece): online softmax statistics (max, sum of exp); greedy
   rows: the argmax per chunk. A row's last program combines the statistics, computes
   ``p(d) = exp(x_d - max) / sum`` from one load and accepts iff ``u * q(d) < p(d)`` (greedy:
   ``d == argmax``), then marks the row done (and rejected) in the request's state word with one atomic OR.
   **Early exit:** the request's later rows' programs that start after a rejection read nothing, since no
   output depends on a row past the first rejection (at large batches, where programs run in several
   waves, rows after an early rejection cost almost nothing). **Early finish:** the program whose mark
   completes the rows up to the first rejection writes ``sampled`` / ``num_sampled`` / ``num_rejected``
   at once, whatever the rows past it still do; greedy requests are done here.
2. ``race_kernel``, grid ``(num_reqs, 1)`` (dense q: ``(num_reqs, num_race_chunks)``): the two-level race on
   each random request's stop row (``specsplit/kernels/triton_group_race.py``). The groups' masses come from the
   pieces' statistics (a rejected one-hot or sparse draft's ``min(p, q)`` taken out; a rejected dense draft's
   residual summed by one read of the stop row's p and q), and the per-id noise is computed for the winning
   group's 2,048 ids only. Skipped when the caller says every request is greedy. Small one-hot and sparse
   calls (``Launch.race_in_stats``) run this race in the stats kernel's last program instead: one launch.

So the logits are read at most once (a rejected dense draft: plus its stop row and q row). Ties go to the
lowest id everywhere, as in ``torch.argmax``. Each call allocates its outputs and scratch; the counters
live in a per-device workspace that every call leaves at zero (``_counters``), so no memset runs per call.
A request has at most ``MAX_DRAFTS_PER_REQUEST`` drafts (its rows are bits of one state word).

Top-k / top-p rows take a slower path: a per-row logit threshold from ``specsplit/kernels/filtering.py`` (a
sort, in torch, of those rows only) before the kernels run; the kernels mask ``logits < threshold``.
Randomness: ``specsplit/kernels/triton_rng.py``, the same bits as the reference's. Tokens equal the
reference's except where two candidates' float scores tie to within the last-ulp differences of
exp/log/sum between libraries (about 1e-7 per row).
"""

import torch
import triton

from specsplit.kernels.filtering import row_thresholds
from specsplit.kernels.rng import GROUP_SIZE
from specsplit.kernels.triton_race_kernel import race_kernel
from specsplit.kernels.triton_rejection_kernels import stats_accept_kernel
from specsplit.kernels.triton_rejection_launch import INTERPRETER_LAUNCH, Launch, default_launch
from specsplit.kernels.types import MAX_DRAFTS_PER_REQUEST, RejectionOutput, SparseDraftProbs

ONE_HOT, DENSE, SPARSE = 0, 1, 2
SEGMENT_ALIGN = 32  # elements: every scratch buffer starts 128-byte aligned
# The output columns' tile is at least this wide: batches with 0..3 drafts per request (prefill chunks,
# unfilled held drafts) share one compiled kernel with k = 3 batches instead of compiling their own.
MIN_BLOCK_COLS = 4
RACE_TILE = 512  # ids per tile of the race over one group (at most the launch's race tile)


def _aligned(sizes: list[int]) -> list[int]:
    """Each size rounded up to SEGMENT_ALIGN elements, so that every segment starts 128-byte aligned."""
    return [triton.cdiv(n, SEGMENT_ALIGN) * SEGMENT_ALIGN for n in sizes]


def _segments(sizes: list[int], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Buffers of at least ``sizes`` elements carved from one allocation. Aligned starts keep Triton's
    pointer specialisation, and so the compiled kernel, the same for every batch size."""
    padded = _aligned(sizes)
    return torch.empty(sum(padded), dtype=dtype, device=device).split(padded)


def _scratch(
    num_logits: int, num_reqs: int, num_stats_pieces: int, num_race_pieces: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """The kernels' scratch for one call: one float and one int allocation, uninitialised (an entry is used
    only once a program of this call has written it). ``block_*`` hold one entry per (logits row, stats
    piece), ``row_*`` one per logits row, ``race_res`` per (request, race piece): dense q only, else 0."""
    rows, reqs = num_logits * num_stats_pieces, num_reqs * num_race_pieces
    floats = _segments([rows, rows, num_logits, num_logits, reqs], torch.float32, device)
    return floats + _segments([rows, num_logits, num_reqs], torch.int32, device)


# Per device, the counters' workspaces, newest last; older ones stay allocated, since a captured CUDA graph may
# still use one.
_WORKSPACES: dict[tuple[str, int | None], list[torch.Tensor]] = {}


def _counters(num_logits: int, num_reqs: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The kernels' counters and states: per logits row, the stats kernel's chunks done (int32); per request,
    the stats kernel's state (int64: rows done and rejected) and the race kernel's programs done (int32).
    Zeros that each call leaves at zero (the program that completes a count sets it back), held per device
    so that no memset runs per call. Calls on one device must therefore run in stream order (one stream, as
    in the verifier). Inside a CUDA graph capture that finds the workspace too small, a zeroed buffer of the
    graph's own."""
    sizes = _aligned([num_logits, 2 * num_reqs, num_reqs])  # int32 elements; aligned, so the int64 view fits
    held = _WORKSPACES.setdefault((device.type, device.index), [])
    if held and held[-1].numel() >= sum(sizes):
        buf = held[-1]
    elif device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        buf = torch.zeros(sum(sizes), dtype=torch.int32, device=device)
    else:
        buf = torch.zeros(max(sum(sizes), 2 * held[-1].numel() if held else 0), dtype=torch.int32, device=device)
        held.append(buf)
    row_counter, state, race_counter = buf[: sum(sizes)].split(sizes)
    return row_counter, state.view(torch.int64), race_counter


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
    all_greedy: bool = False,  # the caller knows every temperature is 0: no race launch
    launch: Launch | None = None,  # the kernels' launch shapes; None: default_launch (GPU) or large programs
    coupled: torch.Tensor | None = None,  # [num_reqs] bool / int: coupled sampling; None: no request is
) -> RejectionOutput:
    """Launches the kernels. Host syncs: one for ``max_num_draft`` unless given, one to find the
    top-k/top-p rows unless ``top_k`` and ``top_p`` are both None (then none: graph-capturable).
    The tokens do not depend on ``launch``.
    """
    device = target_logits.device
    num_logits, vocab_size = target_logits.shape
    num_reqs = cu_num_draft.numel() - 1
    if target_logits.stride(1) != 1:
        target_logits = target_logits.contiguous()
    if cu_num_draft.dtype != torch.int32:
        cu_num_draft = cu_num_draft.to(torch.int32)
    if draft_token_ids.dtype != torch.int64:
        draft_token_ids = draft_token_ids.to(torch.int64)
    if temperature.dtype != torch.float32:
        temperature = temperature.float()
    if seeds.dtype != torch.int64 or positions.dtype != torch.int64:
        seeds, positions = seeds.to(torch.int64), positions.to(torch.int64)
    if coupled is not None and coupled.dtype != torch.int32:
        coupled = coupled.to(torch.int32)
    if max_num_draft is None:
        max_num_draft = int((cu_num_draft[1:] - cu_num_draft[:-1]).max()) if num_reqs else 0
    if max_num_draft > MAX_DRAFTS_PER_REQUEST:
        raise ValueError(f"at most {MAX_DRAFTS_PER_REQUEST} drafts per request, got {max_num_draft}")
    num_cols = max_num_draft + 1

    sampled = torch.empty(num_reqs, num_cols, dtype=torch.int64, device=device)
    num_sampled, num_rejected = (out[:num_reqs] for out in _segments([num_reqs] * 2, torch.int32, device))
    if num_reqs == 0:
        return RejectionOutput(sampled, num_sampled, num_rejected)

    has_threshold = top_k is not None or top_p is not None
    # Without filters the kernels read no threshold; the pointer is a placeholder.
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

    on_gpu = device.type != "cpu"  # CPU tensors run under TRITON_INTERPRET
    if launch is None:
        mode = "greedy" if all_greedy else ("one_hot", "dense", "sparse")[q_mode]
        launch = default_launch(num_reqs, num_logits, vocab_size, mode) if on_gpu else INTERPRETER_LAUNCH
    launch = launch.fit(vocab_size)
    # Pieces: the statistics the race's groups are made of (a power of 2 dividing GROUP_SIZE), no tile wider.
    stats_piece, race_piece = min(launch.stats_chunk, GROUP_SIZE), min(launch.race_chunk, GROUP_SIZE)
    num_stats_pieces = triton.cdiv(vocab_size, stats_piece)
    num_race_pieces = triton.cdiv(vocab_size, race_piece) if q_mode == DENSE else 0
    num_groups = triton.cdiv(vocab_size, GROUP_SIZE)
    race_in_stats = launch.race_in_stats and q_mode != DENSE and not all_greedy
    scratch = _scratch(num_logits, num_reqs, num_stats_pieces, num_race_pieces, device)
    block_max, block_sum, row_max, row_sum, race_res, block_token, row_token, race_mode = scratch
    row_counter, state, race_counter = _counters(num_logits, num_reqs, device)
    num_stats_chunks = triton.cdiv(vocab_size, launch.stats_chunk)
    # A random row's tile spans every piece of its chunk: at least one id of each.
    stats_tile = max(min(launch.stats_block_v, stats_piece), launch.stats_chunk // stats_piece)

    # Requests on axis 0 in both kernels: CUDA caps axes 1 and 2 at 65,535 programs, axis 0 at 2**31 - 1.
    stats_accept_kernel[(num_stats_chunks * num_reqs, num_cols)](
        target_logits, target_logits.stride(0), draft_token_ids, cu_num_draft, temperature, seeds, positions,
        seeds if coupled is None else coupled, threshold, q, q_stride, q_ids, q_ids_stride, num_q_ids, block_max,
        block_sum, block_token, row_counter, row_max, row_sum, row_token, state, sampled, num_sampled, num_rejected,
        race_mode, vocab_size,
        num_stats_pieces, num_cols, Q_MODE=q_mode, HAS_THRESHOLD=has_threshold, CHUNK=launch.stats_chunk,
        PIECE=stats_piece, BLOCK_V=stats_tile, NUM_BLOCKS_PAD=triton.next_power_of_2(num_stats_chunks),
        NUM_PIECES_PAD=triton.next_power_of_2(num_stats_pieces), BLOCK_K=triton.next_power_of_2(num_q_ids),
        BLOCK_COLS=block_cols(max_num_draft), num_warps=launch.stats_warps,
        enable_fp_fusion=False, num_groups=num_groups, RACE_IN_STATS=race_in_stats,
        NUM_GROUPS_PAD=triton.next_power_of_2(num_groups), RACE_TILE=min(RACE_TILE, launch.stats_block_v),
        FAST_LOG2=on_gpu, COUPLED=coupled is not None,
    )  # fmt: skip
    if not (all_greedy or race_in_stats):
        race_programs = triton.cdiv(vocab_size, launch.race_chunk) if q_mode == DENSE else 1
        race_kernel[(num_reqs, race_programs)](
            target_logits, target_logits.stride(0), draft_token_ids, cu_num_draft, temperature, seeds, positions,
            threshold, q, q_stride, q_ids, q_ids_stride, num_q_ids, num_sampled, race_mode, row_max, row_sum,
            block_max, block_sum, race_res, race_counter, sampled, vocab_size, num_race_pieces, num_stats_pieces,
            num_groups, num_cols, Q_MODE=q_mode, HAS_THRESHOLD=has_threshold, CHUNK=launch.race_chunk,
            PIECE=race_piece, STATS_PIECE=stats_piece, BLOCK_V=min(launch.race_block_v, race_piece),
            RACE_TILE=min(RACE_TILE, launch.race_block_v), NUM_GROUPS_PAD=triton.next_power_of_2(num_groups),
            BLOCK_K=triton.next_power_of_2(num_q_ids), FAST_LOG2=on_gpu, num_warps=launch.race_warps,
            enable_fp_fusion=False,
        )  # fmt: skip
    return RejectionOutput(sampled, num_sampled, num_rejected)


WARM_UP_MAX_REQS = 1024  # past the last bucket of LAUNCH_TABLE and of the race-in-stats rule
# Draft counts per request the start-up warm-up covers: every BLOCK_COLS width up to this many (4 and 8 columns). A
# width left out compiles at its first batch, which then takes many times a step's time, in the middle of adaptive
# speculation's first measurements of that depth (docs/performance.md, "Adaptive speculation").
WARM_UP_MAX_DRAFTS = 7


def block_cols(max_num_draft: int) -> int:
    """The kernels' BLOCK_COLS (a compiled variant each) for calls whose requests have at most `max_num_draft`
    drafts: a power of two holding the drafts and the bonus token."""
    return triton.next_power_of_2(max(max_num_draft + 1, MIN_BLOCK_COLS))


def warm_up_draft_counts(max_drafts: int = WARM_UP_MAX_DRAFTS) -> list[int]:
    """The draft counts whose calls compile every BLOCK_COLS width of 1..max_drafts drafts: the largest of each."""
    widest = {}
    for num_drafts in range(1, max_drafts + 1):
        widest[block_cols(num_drafts)] = num_drafts
    return sorted(widest.values())


def warm_up_plan(vocab_size: int, num_drafts: int = 3) -> list[tuple[str, int]]:
    """(mode, num_reqs) calls that make `default_launch` pick each launch shape it can pick for `num_drafts`
    drafts per request once, for greedy, one-hot and sparse batches: the smallest batch of each."""
    plan = []
    for mode in ("greedy", "one_hot", "sparse"):
        seen = set()
        for num_reqs in range(1, WARM_UP_MAX_REQS + 1):
            launch = default_launch(num_reqs, num_reqs * (num_drafts + 1), vocab_size, mode).fit(vocab_size)
            if launch not in seen:
                seen.add(launch)
                plan.append((mode, num_reqs))
    return plan


def warm_up(vocab_size: int, device: torch.device, max_drafts: int = WARM_UP_MAX_DRAFTS, num_q_ids: int = 16) -> int:
    """Compiles (or loads from Triton's on-disk cache) the kernel variants that batches without top-k /
    top-p make the sampler launch, so that no request waits for a compile mid-run: every launch
    shape `default_launch` can pick, greedy, one-hot and sparse (`num_q_ids` ids per draft, the
    drafter's `--draft-top-k`), for every BLOCK_COLS width of up to `max_drafts` drafts per request;
    one-hot and sparse also with coupled requests (their own variants). Returns the number of calls made."""
    plan = [
        (n, mode, r, coupled)
        for n in warm_up_draft_counts(max_drafts)
        for mode, r in warm_up_plan(vocab_size, n)
        for coupled in ((False,) if mode == "greedy" else (False, True))
    ]
    for num_drafts, mode, num_reqs, coupled in plan:
        num_logits = num_reqs * (num_drafts + 1)
        draft_total = num_reqs * num_drafts
        probs = None
        if mode == "sparse":
            ids = torch.arange(num_q_ids, device=device).remainder(vocab_size).expand(draft_total, -1).contiguous()
            probs = SparseDraftProbs(ids, torch.full((draft_total, num_q_ids), 1.0 / num_q_ids, device=device))
        rejection_sample_triton(
            torch.zeros(num_logits, vocab_size, device=device),
            torch.zeros(draft_total, dtype=torch.int64, device=device),
            torch.arange(0, draft_total + 1, num_drafts, dtype=torch.int32, device=device),
            torch.full((num_reqs,), 0.0 if mode == "greedy" else 1.0, device=device),
            None,
            None,
            torch.zeros(num_reqs, dtype=torch.int64, device=device),
            torch.zeros(num_reqs, dtype=torch.int64, device=device),
            draft_probs=probs,
            max_num_draft=num_drafts,
            all_greedy=mode == "greedy",
            coupled=torch.ones(num_reqs, dtype=torch.int32, device=device) if coupled else None,
        )
    return len(plan)
