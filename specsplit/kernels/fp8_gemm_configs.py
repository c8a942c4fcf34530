"""Launch configurations of the block-scaled FP8 GEMM (`specsplit/kernels/fp8_gemm.py`).

`CONFIGS` holds what `benchmarks/fp8_gemm.py` measured on a GPU (it prints the entries to paste here),
keyed by (out_features N, in_features K, M bucket: M rounded up to a power of two, at most 256); a shape
missing from it takes `default_config`.
"""

from __future__ import annotations

from dataclasses import dataclass

from specsplit.kernels.gemv_configs import cdiv

MAX_BUCKET = 256  # M buckets of the table; larger M (prefill chunks) take the 256 row or the default


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int  # rows of x per program (>= 16: tl.dot's smallest tile)
    block_n: int  # output features per program
    split_k: int  # K slices (whole scale groups each), one program each; > 1 adds a reduction launch
    num_warps: int = 4
    num_stages: int = 3
    # Quantize x in a launch of its own (once) instead of in every program over N (each re-quantizing its rows):
    # the in-kernel way saves a launch, but its work grows with M x N / BLOCK_N and passes the weight read's time
    # at M of about 64.
    prequantize: bool = False


CONFIGS: dict[tuple[int, int, int], Fp8GemmConfig] = {}


def m_bucket(m: int) -> int:
    return min(MAX_BUCKET, 1 << (max(m, 1) - 1).bit_length())


def effective_split(k: int, group: int, split_k: int) -> tuple[int, int]:
    """(slices, groups per slice) when `split_k` slices of whole `group`-wide K groups cover K."""
    groups = max(1, cdiv(k, group))
    per_split = cdiv(groups, max(1, min(split_k, groups)))
    return cdiv(groups, per_split), per_split


def default_config(n: int, k: int, m: int, num_sms: int) -> Fp8GemmConfig:
    """64-wide tiles of N, M padded to 16..64 rows; K split (in whole groups of 128) until the grid has
    about four programs per SM (a weight read needs many loads in flight: at M <= 32 Triton feeds the MMA
    from registers, so nothing pipelines the loads but the programs resident on an SM); x quantized in its
    own launch above 32 rows."""
    block_m = min(64, max(16, m_bucket(m)))
    block_n = 64
    programs = cdiv(n, block_n) * cdiv(m, block_m)
    split_k = effective_split(k, 128, cdiv(4 * num_sms, programs))[0] if programs < 4 * num_sms else 1
    return Fp8GemmConfig(block_m, block_n, split_k, num_warps=4, num_stages=3, prequantize=m > 32)


def config_for(n: int, k: int, m: int, num_sms: int) -> Fp8GemmConfig:
    return CONFIGS.get((n, k, m_bucket(m))) or default_config(n, k, m, num_sms)
