"""Launch configurations of the Triton GEMV (`specsplit/kernels/gemv.py`).

`CONFIGS` is measured on a GPU by `benchmarks/gemv.py`, which prints the entries to paste here. It
is keyed by (out_features N, in_features K, M bucket), the bucket being M (rows of x) rounded up to a
power of two; an entry of None means cuBLAS (`F.linear`) was faster for that shape (FMA entries
serve buckets <= MAX_FMA_M only). Shapes missing from the table take `default_config`.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_M = 32  # rows of x the GEMV takes; more rows are a GEMM (F.linear)
MAX_FMA_M = 4  # the FMA path keeps one [BLOCK_N, BLOCK_K] fp32 accumulator per row of x in registers
DEFAULT_NUM_SMS = 132  # the SMs of the GPU `CONFIGS` was measured on; for a device without an SM count (interpreter)


@dataclass(frozen=True)
class GemvConfig:
    dot: bool  # tl.dot on tensor cores (x's rows padded to >= 16), else fp32 FMAs (M <= MAX_FMA_M)
    block_n: int  # output features per program
    block_k: int  # in_features per loop step
    split_k: int  # K slices, one program each per block of outputs; > 1 adds a reduction launch
    num_warps: int = 4
    num_stages: int = 1


# Chosen by benchmarks/gemv.py (docs/performance.md, "Decode step and kernels"): the Qwen2-7B shapes.
CONFIGS: dict[tuple[int, int, int], GemvConfig | None] = {
    # qkv
    (4608, 3584, 1): GemvConfig(dot=False, block_n=8, block_k=512, split_k=1, num_warps=4, num_stages=1),
    # qkv
    (4608, 3584, 2): None,
    # qkv
    (4608, 3584, 4): None,
    # qkv
    (4608, 3584, 8): None,
    # qkv
    (4608, 3584, 16): None,
    # qkv
    (4608, 3584, 32): None,
    # o_proj
    (3584, 3584, 1): GemvConfig(dot=False, block_n=16, block_k=512, split_k=1, num_warps=8, num_stages=1),
    # o_proj
    (3584, 3584, 2): GemvConfig(dot=True, block_n=32, block_k=256, split_k=3, num_warps=4, num_stages=3),
    # o_proj
    (3584, 3584, 4): GemvConfig(dot=True, block_n=32, block_k=256, split_k=3, num_warps=4, num_stages=3),
    # o_proj
    (3584, 3584, 8): GemvConfig(dot=True, block_n=16, block_k=256, split_k=1, num_warps=4, num_stages=4),
    # o_proj
    (3584, 3584, 16): GemvConfig(dot=True, block_n=16, block_k=256, split_k=1, num_warps=4, num_stages=4),
    # o_proj
    (3584, 3584, 32): GemvConfig(dot=True, block_n=64, block_k=128, split_k=5, num_warps=4, num_stages=4),
    # gate_up
    (37888, 3584, 1): GemvConfig(dot=False, block_n=32, block_k=256, split_k=1, num_warps=8, num_stages=1),
    # gate_up
    (37888, 3584, 2): GemvConfig(dot=True, block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4),
    # gate_up
    (37888, 3584, 4): GemvConfig(dot=True, block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4),
    # gate_up
    (37888, 3584, 8): GemvConfig(dot=True, block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4),
    # gate_up
    (37888, 3584, 16): GemvConfig(dot=True, block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4),
    # gate_up
    (37888, 3584, 32): GemvConfig(dot=True, block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4),
    # down
    (3584, 18944, 1): GemvConfig(dot=False, block_n=32, block_k=256, split_k=3, num_warps=8, num_stages=1),
    # down
    (3584, 18944, 2): GemvConfig(dot=True, block_n=32, block_k=256, split_k=3, num_warps=4, num_stages=3),
    # down
    (3584, 18944, 4): GemvConfig(dot=True, block_n=32, block_k=256, split_k=3, num_warps=4, num_stages=3),
    # down
    (3584, 18944, 8): GemvConfig(dot=True, block_n=32, block_k=256, split_k=3, num_warps=4, num_stages=3),
    # down
    (3584, 18944, 16): GemvConfig(dot=True, block_n=32, block_k=256, split_k=3, num_warps=4, num_stages=3),
    # down
    (3584, 18944, 32): None,
    # lm_head
    (152064, 3584, 1): GemvConfig(dot=True, block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4),
    # lm_head
    (152064, 3584, 2): GemvConfig(dot=True, block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4),
    # lm_head
    (152064, 3584, 4): GemvConfig(dot=True, block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4),
    # lm_head
    (152064, 3584, 8): GemvConfig(dot=True, block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4),
    # lm_head
    (152064, 3584, 16): GemvConfig(dot=True, block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4),
    # lm_head
    (152064, 3584, 32): GemvConfig(dot=True, block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=4),
}


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


def config_for(n: int, k: int, m: int, num_sms: int, measured_only: bool = False) -> GemvConfig | None:
    """The table's entry for (n, k, bucket of m), else `default_config` (`measured_only`: else None);
    None: use F.linear."""
    key = (n, k, m_bucket(m))
    if key in CONFIGS:
        return CONFIGS[key]
    return None if measured_only else default_config(n, k, m, num_sms)
