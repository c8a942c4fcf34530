"""Launch shapes of the rejection sampler's two kernels (``specsplit/kernels/triton_rejection.py``).

A launch shape says how each kernel cuts a vocabulary row into programs: ``chunk`` ids per program,
tiles of ``block_v`` ids, ``warps`` per program. The stats kernel and the race kernel choose theirs
independently. The shape changes speed, not tokens: every argmax keeps the lowest id among equal
scores whatever the chunking. Only the softmax sum's rounding depends on the stats chunking, so a
token could change only where an acceptance test or a residual race ties to the last bit (the same
caveat as between the kernels and the reference; ``benchmarks/rejection_tuning.py sweep`` checks it).

``default_launch`` picks the GPU shape per call from ``LAUNCH_TABLE``; ``benchmarks/rejection_tuning.py sweep``
times the candidates and prints a table in this format.
"""

import sys
from dataclasses import dataclass, replace

MODES = ("greedy", "one_hot", "dense", "sparse")


@dataclass(frozen=True)
class Launch:
    stats_chunk: int  # vocabulary ids per stats program (a power of 2)
    stats_block_v: int  # ids per tile (a power of 2, <= stats_chunk)
    stats_warps: int
    race_chunk: int  # the same for the race kernel
    race_block_v: int
    race_warps: int
    # One-hot / sparse q: the stats kernel's last program per request also races the stop row: one launch, but
    # the race's registers slow the stats pass, which pays only while the logits are few (`default_launch`).
    race_in_stats: bool = False

    def __post_init__(self) -> None:
        for kernel in ("stats", "race"):
            chunk, block_v = getattr(self, f"{kernel}_chunk"), getattr(self, f"{kernel}_block_v")
            if not (_power_of_2(chunk) and _power_of_2(block_v) and block_v <= chunk):
                raise ValueError(f"{kernel}: chunk and block_v must be powers of 2 with block_v <= chunk, got {self}")
            if not _power_of_2(getattr(self, f"{kernel}_warps")):
                raise ValueError(f"{kernel}_warps must be a power of 2, got {self}")

    def fit(self, vocab_size: int) -> "Launch":
        """No program wider than the vocabulary (rounded up to a power of 2)."""
        width = 1 << max(vocab_size - 1, 0).bit_length()
        if self.stats_chunk <= width and self.race_chunk <= width:
            return self
        stats_chunk, race_chunk = min(self.stats_chunk, width), min(self.race_chunk, width)
        return replace(
            self, stats_chunk=stats_chunk, stats_block_v=min(self.stats_block_v, stats_chunk),
            race_chunk=race_chunk, race_block_v=min(self.race_block_v, race_chunk),
        )  # fmt: skip


def _power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


# The interpreter (TRITON_INTERPRET, CPU tensors) runs few, large programs fastest.
INTERPRETER_LAUNCH = Launch(32768, 16384, 4, 32768, 16384, 4)
GPU_LAUNCH = Launch(8192, 1024, 4, 8192, 1024, 4)
# Mode class ("greedy" or "random") -> ((largest num_reqs, launch), ...) in increasing num_reqs; random batches of
# more than SMALL_BATCH requests take LARGE_BATCH_TABLE instead.
# Chosen by measurement (docs/performance.md, "Rejection sampler against vLLM"). Batches of 1 and 8, where smaller
# programs win: `cd benchmarks && python3 rejection_tuning.py sweep --quick [--batch 8 --vocab 32000 151936]`.
# Greedy batches of 64 and 256: `rejection_tuning.py sweep --vocab 32000 151936 --batch 64 256`.
LAUNCH_TABLE: dict[str, tuple[tuple[int, Launch], ...]] = {
    "greedy": (
        (1, Launch(2048, 512, 4, 8192, 1024, 4)),
        (8, Launch(8192, 1024, 8, 8192, 1024, 4)),
        (sys.maxsize, Launch(16384, 1024, 4, 8192, 1024, 4)),
    ),
    "random": (
        (1, Launch(2048, 1024, 8, 2048, 1024, 4)),
        (8, Launch(2048, 512, 4, 1024, 256, 2)),
    ),
}
SMALL_BATCH = 8
# Random batches of more than SMALL_BATCH requests: mode -> ((largest num_logits * vocab, launch), ...). The grid has
# (rows x chunks per row) stats programs. One-hot rows are mostly rejected early, and the early exit pays only
# for programs that start after a rejection: small chunks (several waves) up to 64M logits, where the programs
# grow too many. Dense and sparse rows are read whole: 16,384-id chunks, halved while that leaves fewer than 512
# programs (8M logits). Chosen by `cd benchmarks && python3 rejection_tuning.py grid` (vocab 32,000 and 151,936,
# batch 64 and 256, k 1-5): the best candidate or close to it on every shape but two, both one-hot at vocab 32,000,
# batch 64, where 16,384 / 2,048 is faster (benchmarks/results/rejection_sampler_h200.md, "Launch grid").
LARGE_BATCH_TABLE: dict[str, tuple[tuple[int, Launch], ...]] = {
    "one_hot": (
        (64_000_000, Launch(4096, 1024, 4, 4096, 512, 4, race_in_stats=True)),
        (sys.maxsize, Launch(16384, 1024, 4, 8192, 1024, 4, race_in_stats=True)),
    ),
    "dense": (
        (8_000_000, Launch(8192, 1024, 4, 4096, 512, 4)),
        (sys.maxsize, Launch(16384, 1024, 4, 8192, 1024, 4)),
    ),
    "sparse": (
        (8_000_000, Launch(8192, 1024, 4, 4096, 512, 4)),
        (sys.maxsize, Launch(16384, 1024, 4, 8192, 1024, 4)),
    ),
}


# Sparse calls (and one-hot ones of at most SMALL_BATCH requests) race in the stats kernel when they have at most
# this many logits (num_logits * vocab), or rows of at most RACE_IN_STATS_MAX_VOCAB ids and at most
# RACE_IN_STATS_MAX_ROWS of them; larger one-hot batches always do (LARGE_BATCH_TABLE). One launch wins while
# the logits are few; the limits are where it stopped winning in measurements (one-hot at batch 1, and sparse
# batches of 64 and 256 in `rejection_tuning.py grid`: docs/performance.md, "Rejection sampler against vLLM").
RACE_IN_STATS_MAX_LOGITS = 2_500_000
RACE_IN_STATS_MAX_VOCAB = 65_536
RACE_IN_STATS_MAX_ROWS = 1024


def default_launch(num_reqs: int, num_logits: int, vocab_size: int, mode: str) -> Launch:
    """The GPU launch shape for a call; ``mode`` is one of ``MODES`` ("greedy": every request is)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode != "greedy" and num_reqs > SMALL_BATCH:
        table, size = LARGE_BATCH_TABLE[mode], num_logits * vocab_size
    else:
        table, size = LAUNCH_TABLE["greedy" if mode == "greedy" else "random"], num_reqs
    launch = next((row_launch for limit, row_launch in table if size <= limit), GPU_LAUNCH)
    few_logits = num_logits * vocab_size <= RACE_IN_STATS_MAX_LOGITS
    few_short_rows = vocab_size <= RACE_IN_STATS_MAX_VOCAB and num_logits <= RACE_IN_STATS_MAX_ROWS
    if mode in ("one_hot", "sparse") and (few_logits or few_short_rows):
        launch = replace(launch, race_in_stats=True)
    return launch
