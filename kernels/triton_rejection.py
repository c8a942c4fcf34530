"""Triton rejection sampler: the same function as ``kernels/reference.py``, on the GPU.

Terms (accepted / recovered / bonus, x, p, q, the exponential race) are defined in the reference's
docstring. Every logits row is cut into chunks of vocabulary ids, one per program, each kernel with its own
chunk size (``kernels/triton_rejection_launch.py``); two launches
(``kernels/triton_rejection_kernels.py``, ``kernels/triton_race_kernel.py``):

1. ``stats_accept_kernel``, grid ``(num_reqs, max_num_draft + 1, num_stats_chunks)``: the only full pass
   over the logits. Per (row, chunk): online softmax statistics (max, sum of exp); greedy rows: the
   argmax. The request's last program then walks its rows until the first rejection: combine the
   chunk statistics, ``p(d) = exp(x_d - max) / sum`` from one load, accept iff ``u * q(d) < p(d)``
   (greedy: ``d == argmax``), write ``sampled`` / ``num_sampled`` / ``num_rejected``; greedy
   requests are done here.
2. ``race_kernel``, grid ``(num_reqs, num_race_chunks)``: for random requests only, the exponential race
   on the one stop row: from p (bonus row, padded draft), from p without the rejected draft (one-hot
   q), or from ``max(p - q, 0)`` (dense q, or sparse q matched against the row's K ids in registers;
   no dense q is built). The last program writes the winner into the stop column. Skipped when the
   caller says every request is greedy.

So the logits are read once, plus one row per random request, and the per-token noise (a hash and a
log per vocabulary id) is computed for that one row only. Small one-hot calls
(``Launch.one_hot_race_in_stats``) launch the stats kernel alone instead: the race from p needs neither
the row's max nor its sum, so every chunk of every random row runs its race in the same pass, and the
request's last program takes the stop row's winner. The noise is then computed for every row, which pays
only while the logits are few (``kernels/triton_rejection_launch.py``). Ties go to the lowest id everywhere, as in
``torch.argmax``. Each call allocates its outputs and two scratch buffers (the int one zeroed: it holds
the per-request counters), so calls share no state.

Top-k / top-p rows take a slower path: a per-row logit threshold from ``kernels/filtering.py`` (a
sort, in torch, of those rows only) before the kernels run; the kernels mask ``logits < threshold``.
Randomness: ``kernels/triton_rng.py``, the same bits as the reference's. Tokens equal the
reference's except where two candidates' float scores tie to within the last-ulp differences of
exp/log/sum between libraries (about 1e-7 per row).
"""

import torch
import triton

from kernels.filtering import row_thresholds
from kernels.triton_race_kernel import race_kernel
from kernels.triton_rejection_kernels import stats_accept_kernel
from kernels.triton_rejection_launch import INTERPRETER_LAUNCH, Launch, default_launch
from kernels.types import RejectionOutput, SparseDraftProbs

ONE_HOT, DENSE, SPARSE = 0, 1, 2
SEGMENT_ALIGN = 32  # elements: every scratch buffer starts 128-byte aligned
# The output columns' tile is at least this wide: batches with 0..3 drafts per request (prefill chunks,
# unfilled held drafts) share one compiled kernel with k = 3 batches instead of compiling their own.
MIN_BLOCK_COLS = 4


def _segments(sizes: list[int], dtype: torch.dtype, zero: bool, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Buffers of at least ``sizes`` elements carved from one allocation. Aligned starts keep Triton's
    pointer specialisation, and so the compiled kernel, the same for every batch size."""
    padded = [triton.cdiv(n, SEGMENT_ALIGN) * SEGMENT_ALIGN for n in sizes]
    return (torch.zeros if zero else torch.empty)(sum(padded), dtype=dtype, device=device).split(padded)


def _scratch(
    num_logits: int,
    num_reqs: int,
    num_stats_blocks: int,
    num_race_blocks: int,
    race_in_stats: bool,
    device: torch.device,
) -> tuple[torch.Tensor, ...]:
    """The kernels' scratch for one call: one float and one int allocation; the ints (counters among
    them) are zeroed, so a call never depends on an earlier one, also inside CUDA graphs. ``block_*``
    hold one entry per (logits row, stats chunk), ``race_*`` / ``fallback_*`` per (request, race chunk)
    (with the race in the stats pass: ``race_*`` per (logits row, stats chunk), no ``fallback_*``)."""
    rows = num_logits * num_stats_blocks
    reqs = 0 if race_in_stats else num_reqs * num_race_blocks
    races = rows if race_in_stats else reqs
    block_max, block_sum, race_best, fallback_best, stop_max, stop_sum = _segments(
        [rows, rows, races, reqs, num_reqs, num_reqs], torch.float32, False, device
    )
    block_token, race_token, fallback_token, race_mode, stats_counter, race_counter = _segments(
        [rows, races, reqs, num_reqs, num_reqs, num_reqs], torch.int32, True, device
    )
    return (block_max, block_sum, block_token, stats_counter, stop_max, stop_sum, race_mode,
            race_best, race_token, fallback_best, fallback_token, race_counter)  # fmt: skip


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
    if max_num_draft is None:
        max_num_draft = int((cu_num_draft[1:] - cu_num_draft[:-1]).max()) if num_reqs else 0
    num_cols = max_num_draft + 1

    sampled = torch.empty(num_reqs, num_cols, dtype=torch.int64, device=device)
    num_sampled, num_rejected = (out[:num_reqs] for out in _segments([num_reqs] * 2, torch.int32, False, device))
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
    race_in_stats = q_mode == ONE_HOT and launch.one_hot_race_in_stats and not all_greedy
    num_stats_blocks = triton.cdiv(vocab_size, launch.stats_chunk)
    num_race_blocks = triton.cdiv(vocab_size, launch.race_chunk)
    (block_max, block_sum, block_token, stats_counter, stop_max, stop_sum, race_mode,
     race_best, race_token, fallback_best, fallback_token, race_counter) = _scratch(
        num_logits, num_reqs, num_stats_blocks, num_race_blocks, race_in_stats, device)  # fmt: skip

    stats_accept_kernel[(num_reqs, num_cols, num_stats_blocks)](
        target_logits, target_logits.stride(0), draft_token_ids, cu_num_draft, temperature, seeds, positions,
        threshold, q, q_stride, q_ids, q_ids_stride, num_q_ids, block_max, block_sum, block_token, stats_counter,
        sampled, num_sampled, num_rejected, stop_max, stop_sum, race_mode, race_best, race_token, vocab_size,
        num_stats_blocks, num_cols, Q_MODE=q_mode, HAS_THRESHOLD=has_threshold, CHUNK=launch.stats_chunk,
        BLOCK_V=launch.stats_block_v, NUM_BLOCKS_PAD=triton.next_power_of_2(num_stats_blocks),
        BLOCK_K=triton.next_power_of_2(num_q_ids), BLOCK_COLS=triton.next_power_of_2(max(num_cols, MIN_BLOCK_COLS)),
        RACE_IN_STATS=race_in_stats, FAST_LOG2=on_gpu, num_warps=launch.stats_warps, enable_fp_fusion=False,
    )  # fmt: skip
    if not (all_greedy or race_in_stats):
        race_kernel[(num_reqs, num_race_blocks)](
            target_logits, target_logits.stride(0), draft_token_ids, cu_num_draft, temperature, seeds, positions,
            threshold, q, q_stride, q_ids, q_ids_stride, num_q_ids, num_sampled, stop_max, stop_sum, race_mode,
            race_best, race_token, fallback_best, fallback_token, race_counter, sampled, vocab_size, num_race_blocks,
            num_cols, Q_MODE=q_mode, HAS_THRESHOLD=has_threshold, CHUNK=launch.race_chunk,
            BLOCK_V=launch.race_block_v, NUM_BLOCKS_PAD=triton.next_power_of_2(num_race_blocks),
            FAST_LOG2=on_gpu, num_warps=launch.race_warps, enable_fp_fusion=False,
        )  # fmt: skip
    return RejectionOutput(sampled, num_sampled, num_rejected)


WARM_UP_MAX_REQS = 1024  # past the last bucket of LAUNCH_TABLE and of the race-in-stats rule


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


def warm_up(vocab_size: int, device: torch.device, num_drafts: int = 3, num_q_ids: int = 16) -> int:
    """Compiles (or loads from Triton's on-disk cache) the kernel variants that batches without top-k /
    top-p make the sampler launch, so that no request waits ~0.5 s for a compile mid-run: every launch
    shape `default_launch` can pick, greedy, one-hot and sparse (`num_q_ids` ids per draft, the
    drafter's `--draft-top-k`). Returns the number of calls made."""
    plan = warm_up_plan(vocab_size, num_drafts)
    for mode, num_reqs in plan:
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
        )
    return len(plan)
