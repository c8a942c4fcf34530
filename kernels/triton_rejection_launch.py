"""Launch shapes of the rejection sampler's two kernels (``kernels/triton_rejection.py``).

A launch shape says how each kernel cuts a vocabulary row into programs: ``chunk`` ids per program,
tiles of ``block_v`` ids, ``warps`` per program. The stats kernel and the race kernel choose theirs
independently. The shape changes speed, not tokens: every argmax keeps the lowest id among equal
scores whatever the chunking. Only the softmax sum's rounding depends on the stats chunking, so a
token could change only where an acceptance test or a residual race ties to the last bit (the same
caveat as between the kernels and the reference; ``benchmarks/rejection_sweep.py`` checks it).

``default_launch`` picks the GPU shape per call from ``LAUNCH_TABLE``; ``benchmarks/rejection_sweep.py``
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
    # One-hot q: the stats kernel also runs every random row's race from p (one launch, no second read of
    # the stop row, a hash and two logs per id of every row); the race_* shape is then unused.
    one_hot_race_in_stats: bool = False

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
# Mode class ("greedy" or "random") -> ((largest num_reqs, launch), ...) in increasing num_reqs.
# `cd benchmarks && python3 rejection_sweep.py --quick [--batch 8 --vocab 32000 151936]` on one H200
# (2026-11-29, k 3): smaller programs at batch 1 (7.3 -> 6.3 µs greedy, 13.9 -> 11.1 µs random) and at batch
# 8 (random 1.2x on average), within 2 % of the default at batch 64 and 256.
LAUNCH_TABLE: dict[str, tuple[tuple[int, Launch], ...]] = {
    "greedy": (
        (1, Launch(2048, 512, 4, 8192, 1024, 4)),
        (64, Launch(8192, 1024, 8, 8192, 1024, 4)),
        (sys.maxsize, Launch(16384, 1024, 4, 8192, 1024, 4)),
    ),
    "random": (
        (1, Launch(2048, 1024, 8, 2048, 1024, 4)),
        (8, Launch(2048, 512, 4, 1024, 256, 2)),
        (64, Launch(16384, 1024, 4, 4096, 512, 4)),
        (sys.maxsize, Launch(8192, 1024, 4, 8192, 1024, 4)),
    ),
}


# Small one-hot calls run their races in the stats pass: one launch instead of two. The race's hash and logs on
# every row make that pass compute-bound, so it pays only while the logits are few.
# `cd benchmarks && python3 race_in_stats.py --out race_in_stats.json` on one H200 (2026-11-30): 1.09-1.34x
# faster up to 16 x 151,936 and 32 x 32,000 logits (batch 1, k 3, vocab 151,936: 9.2 -> 7.7 µs), even at
# 48 x 32,000 (10.8 / 11.0 µs), slower from 32 x 151,936 (batch 64, k 3: 69.5 -> 98.6 µs at best).
RACE_IN_STATS_MAX_LOGITS = 2_500_000  # num_logits * vocab_size
RACE_IN_STATS_MAX_PROGRAMS = 640  # the chunk doubles from 1,024 ids until the programs fit


def race_in_stats_launch(num_logits: int, vocab_size: int) -> Launch:
    """The launch of a small one-hot call: chunks as small as keep the programs within ~5 per SM."""
    chunk = 1024
    while num_logits * -(-vocab_size // chunk) > RACE_IN_STATS_MAX_PROGRAMS and chunk < 8192:
        chunk *= 2
    return Launch(chunk, 512, 4, chunk, 512, 4, one_hot_race_in_stats=True)


def default_launch(num_reqs: int, num_logits: int, vocab_size: int, mode: str) -> Launch:
    """The GPU launch shape for a call; ``mode`` is one of ``MODES`` ("greedy": every request is)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "one_hot" and num_logits * vocab_size <= RACE_IN_STATS_MAX_LOGITS:
        return race_in_stats_launch(num_logits, vocab_size)
    return table_launch(num_reqs, mode)


def table_launch(num_reqs: int, mode: str) -> Launch:
    """The two-launch shape `LAUNCH_TABLE` holds for a batch of ``num_reqs``."""
    for max_reqs, launch in LAUNCH_TABLE["greedy" if mode == "greedy" else "random"]:
        if num_reqs <= max_reqs:
            return launch
    return GPU_LAUNCH
