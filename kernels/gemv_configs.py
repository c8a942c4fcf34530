"""Launch configurations of the Triton GEMV (`kernels/gemv.py`).

`CONFIGS` is measured on the H200 by `benchmarks/gemv.py`, which prints the entries to paste here. It
is keyed by (out_features N, in_features K, M bucket), the bucket being M (rows of x) rounded up to a
power of two; an entry of None means cuBLAS (`F.linear`) was faster for that shape (FMA entries
serve buckets <= MAX_FMA_M only). Shapes missing from the table take `default_config`.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_M = 32  # rows of x the GEMV takes; more rows are a GEMM (F.linear)
MAX_FMA_M = 4  # the FMA path keeps one [BLOCK_N, BLOCK_K] fp32 accumulator per row of x in registers
DEFAULT_NUM_SMS = 132  # an H200's; used where the device has no SM count (the Triton interpreter)


@dataclass(frozen=True)
class GemvConfig:
    dot: bool  # tl.dot on tensor cores (x's rows padded to >= 16), else fp32 FMAs (M <= MAX_FMA_M)
    block_n: int  # output features per program
    block_k: int  # in_features per loop step
    split_k: int  # K slices, one program each per block of outputs; > 1 adds a reduction launch
    num_warps: int = 4
    num_stages: int = 1


CONFIGS: dict[tuple[int, int, int], GemvConfig | None] = {}


def m_bucket(m: int) -> int:
    """M rounded up to a power of two: the M of the table row that serves it."""
    return 1 << (m - 1).bit_length()


def block_m(m: int, dot: bool) -> int:
    """Rows of x one program holds: M rounded up to a power of two, and to 16 for tl.dot."""
    return max(16 if dot else 1, m_bucket(m))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def effective_split(k: int, block_k: int, split_k: int) -> int:
    """The number of non-empty K slices when `split_k` slices of whole BLOCK_K tiles cover K."""
    k_tiles = max(1, cdiv(k, block_k))
    return cdiv(k_tiles, cdiv(k_tiles, max(1, min(split_k, k_tiles))))


def split_for_programs(n: int, k: int, block_n: int, block_k: int, programs: int) -> int:
    """K slices for about `programs` programs in all (slices hold whole tiles; at most one per tile)."""
    return effective_split(k, block_k, cdiv(programs, cdiv(n, block_n)))


def default_config(n: int, k: int, m: int, num_sms: int) -> GemvConfig:
    """FMAs over 16 x 256 tiles for one row of x, tensor cores over 64 x 128 tiles for more; K split
    until there are four programs per SM."""
    if m == 1:
        dot, block_n, block_k, num_stages = False, 16, 256, 1
    else:
        dot, block_n, block_k, num_stages = True, 64, 128, 4
    split_k = split_for_programs(n, k, block_n, block_k, 4 * num_sms)
    return GemvConfig(dot, block_n, block_k, split_k, num_warps=4, num_stages=num_stages)


def config_for(n: int, k: int, m: int, num_sms: int) -> GemvConfig | None:
    """The table's entry for (n, k, bucket of m), else `default_config`; None: use F.linear."""
    key = (n, k, m_bucket(m))
    return CONFIGS[key] if key in CONFIGS else default_config(n, k, m, num_sms)
