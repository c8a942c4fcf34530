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
    # the in-kernel way saves a launch, but its work grows with M x N / BLOCK_N until it outlasts the weight read.
    prequantize: bool = False
    # W's tile as the MMA's row operand and x's rows as its columns (y computed transposed): a few rows of x make a
    # narrow MMA (16 columns) instead of rows padded to the tensor cores' height (Hopper's wgmma: 64 rows).
    swap_ab: bool = False


CONFIGS: dict[
    tuple[int, int, int], Fp8GemmConfig
] = {  # chosen by benchmarks/fp8_gemm.py's sweep (its timings: benchmarks/results/fp8_gemm_h200.md)
    # glm45air.qkv
    (14336, 4096, 1): Fp8GemmConfig(
        block_m=16, block_n=64, split_k=1, num_warps=4, num_stages=4, prequantize=True, swap_ab=True
    ),
    # glm45air.qkv
    (14336, 4096, 2): Fp8GemmConfig(
        block_m=16, block_n=64, split_k=1, num_warps=4, num_stages=4, prequantize=True, swap_ab=True
    ),
    # glm45air.qkv
    (14336, 4096, 4): Fp8GemmConfig(
        block_m=16, block_n=64, split_k=1, num_warps=4, num_stages=4, prequantize=True, swap_ab=True
    ),
    # glm45air.qkv
    (14336, 4096, 8): Fp8GemmConfig(
        block_m=16, block_n=64, split_k=1, num_warps=4, num_stages=4, prequantize=True, swap_ab=True
    ),
    # glm45air.qkv
    (14336, 4096, 16): Fp8GemmConfig(
        block_m=16, block_n=64, split_k=1, num_warps=4, num_stages=4, prequantize=True, swap_ab=True
    ),
    # glm45air.qkv
    (14336, 4096, 32): Fp8GemmConfig(
        block_m=32, block_n=64, split_k=1, num_warps=4, num_stages=4, prequantize=True, swap_ab=True
    ),
    # glm45air.qkv
    (14336, 4096, 64): Fp8GemmConfig(
        block_m=64, block_n=64, split_k=1, num_warps=4, num_stages=3, prequantize=True, swap_ab=False
    ),
    # glm45air.qkv
    (14336, 4096, 128): Fp8GemmConfig(
        block_m=128, block_n=128, split_k=1, num_warps=8, num_stages=3, prequantize=True, swap_ab=False
    ),
    # glm45air.qkv
    (14336, 4096, 256): Fp8GemmConfig(
        block_m=128, block_n=128, split_k=1, num_warps=8, num_stages=3, prequantize=True, swap_ab=False
    ),
    # glm45air.o_proj
    (4096, 12288, 1): Fp8GemmConfig(
        block_m=16, block_n=64, split_k=9, num_warps=4, num_stages=4, prequantize=True, swap_ab=True
    ),
    # glm45air.o_proj
    (4096, 12288, 2): Fp8GemmConfig(
        block_m=16, block_n=64, split_k=9, num_warps=4, num_stages=4, prequantize=True, swap_ab=True
    ),
    # glm45air.o_proj
    (4096, 12288, 4): Fp8GemmConfig(
        block_m=16, block_n=64, split_k=9, num_warps=4, num_stages=4, prequantize=True, swap_ab=True
    ),
    # glm45air.o_proj
    (4096, 12288, 8): Fp8GemmConfig(
        block_m=16, block_n=64, split_k=9, num_warps=4, num_stages=3, prequantize=True, swap_ab=False
    ),
    # glm45air.o_proj
    (4096, 12288, 16): Fp8GemmConfig(
        block_m=16, block_n=64, split_k=9, num_warps=4, num_stages=3, prequantize=True, swap_ab=False
    ),
    # glm45air.o_proj
    (4096, 12288, 32): Fp8GemmConfig(
        block_m=32, block_n=64, split_k=5, num_warps=4, num_stages=4, prequantize=True, swap_ab=True
    ),
    # glm45air.o_proj
    (4096, 12288, 64): Fp8GemmConfig(
        block_m=64, block_n=64, split_k=5, num_warps=4, num_stages=3, prequantize=True, swap_ab=False
    ),
    # glm45air.o_proj
    (4096, 12288, 128): Fp8GemmConfig(
        block_m=64, block_n=64, split_k=3, num_warps=4, num_stages=3, prequantize=True, swap_ab=False
    ),
    # glm45air.o_proj
    (4096, 12288, 256): Fp8GemmConfig(
        block_m=64, block_n=64, split_k=2, num_warps=4, num_stages=3, prequantize=True, swap_ab=False
    ),
    # glm45air.expert.gate_up
    (2816, 4096, 1): Fp8GemmConfig(
        block_m=16, block_n=64, split_k=11, num_warps=4, num_stages=4, prequantize=False, swap_ab=True
    ),
    # glm45air.expert.gate_up
    (2816, 4096, 2): Fp8GemmConfig(
        block_m=16, block_n=64, split_k=11, num_warps=4, num_stages=4, prequantize=False, swap_ab=True
    ),
    # glm45air.expert.gate_up
    (2816, 4096, 4): Fp8GemmConfig(
        block_m=16, block_n=64, split_k=11, num_warps=4, num_stages=4, prequantize=False, swap_ab=True
    ),
    # glm45air.expert.gate_up
    (2816, 4096, 8): Fp8GemmConfig(
        block_m=16, block_n=64, split_k=11, num_warps=4, num_stages=4, prequantize=False, swap_ab=True
    ),
    # glm45air.expert.gate_up
    (2816, 4096, 16): Fp8GemmConfig(
        block_m=16, block_n=64, split_k=11, num_warps=4, num_stages=4, prequantize=False, swap_ab=True
    ),
    # glm45air.expert.gate_up
    (2816, 4096, 32): Fp8GemmConfig(
        block_m=32, block_n=64, split_k=6, num_warps=4, num_stages=4, prequantize=True, swap_ab=True
    ),
    # glm45air.expert.gate_up
    (2816, 4096, 64): Fp8GemmConfig(
        block_m=64, block_n=64, split_k=6, num_warps=4, num_stages=3, prequantize=True, swap_ab=False
    ),
    # glm45air.expert.gate_up
    (2816, 4096, 128): Fp8GemmConfig(
        block_m=64, block_n=64, split_k=3, num_warps=4, num_stages=3, prequantize=True, swap_ab=False
    ),
    # glm45air.expert.gate_up
    (2816, 4096, 256): Fp8GemmConfig(
        block_m=64, block_n=128, split_k=3, num_warps=4, num_stages=3, prequantize=True, swap_ab=False
    ),
    # glm45air.expert.down
    (4096, 1408, 1): Fp8GemmConfig(
        block_m=16, block_n=64, split_k=6, num_warps=4, num_stages=4, prequantize=False, swap_ab=True
    ),
    # glm45air.expert.down
    (4096, 1408, 2): Fp8GemmConfig(
        block_m=16, block_n=64, split_k=6, num_warps=4, num_stages=4, prequantize=False, swap_ab=True
    ),
    # glm45air.expert.down
    (4096, 1408, 4): Fp8GemmConfig(
        block_m=16, block_n=64, split_k=6, num_warps=4, num_stages=4, prequantize=False, swap_ab=True
    ),
    # glm45air.expert.down
    (4096, 1408, 8): Fp8GemmConfig(
        block_m=16, block_n=64, split_k=6, num_warps=4, num_stages=4, prequantize=False, swap_ab=True
    ),
    # glm45air.expert.down
    (4096, 1408, 16): Fp8GemmConfig(
        block_m=16, block_n=64, split_k=6, num_warps=4, num_stages=4, prequantize=False, swap_ab=True
    ),
    # glm45air.expert.down
    (4096, 1408, 32): Fp8GemmConfig(
        block_m=32, block_n=64, split_k=4, num_warps=4, num_stages=4, prequantize=False, swap_ab=True
    ),
    # glm45air.expert.down
    (4096, 1408, 64): Fp8GemmConfig(
        block_m=64, block_n=64, split_k=4, num_warps=4, num_stages=3, prequantize=True, swap_ab=False
    ),
    # glm45air.expert.down
    (4096, 1408, 128): Fp8GemmConfig(
        block_m=64, block_n=64, split_k=1, num_warps=4, num_stages=3, prequantize=True, swap_ab=False
    ),
    # glm45air.expert.down
    (4096, 1408, 256): Fp8GemmConfig(
        block_m=64, block_n=128, split_k=1, num_warps=8, num_stages=3, prequantize=True, swap_ab=False
    ),
    # dsv3.o_proj
    (7168, 16384, 1): Fp8GemmConfig(
        block_m=16, block_n=64, split_k=5, num_warps=4, num_stages=4, prequantize=True, swap_ab=True
    ),
    # dsv3.o_proj
    (7168, 16384, 2): Fp8GemmConfig(
        block_m=16, block_n=64, split_k=5, num_warps=4, num_stages=4, prequantize=True, swap_ab=True
    ),
    # dsv3.o_proj
    (7168, 16384, 4): Fp8GemmConfig(
        block_m=16, block_n=64, split_k=5, num_warps=4, num_stages=4, prequantize=True, swap_ab=True
    ),
    # dsv3.o_proj
    (7168, 16384, 8): Fp8GemmConfig(
        block_m=16, block_n=64, split_k=5, num_warps=4, num_stages=4, prequantize=True, swap_ab=True
    ),
    # dsv3.o_proj
    (7168, 16384, 16): Fp8GemmConfig(
        block_m=16, block_n=64, split_k=5, num_warps=4, num_stages=3, prequantize=True, swap_ab=False
    ),
    # dsv3.o_proj
    (7168, 16384, 32): Fp8GemmConfig(
        block_m=32, block_n=64, split_k=3, num_warps=4, num_stages=4, prequantize=True, swap_ab=True
    ),
    # dsv3.o_proj
    (7168, 16384, 64): Fp8GemmConfig(
        block_m=64, block_n=64, split_k=3, num_warps=4, num_stages=3, prequantize=True, swap_ab=False
    ),
    # dsv3.o_proj
    (7168, 16384, 128): Fp8GemmConfig(
        block_m=64, block_n=64, split_k=2, num_warps=4, num_stages=3, prequantize=True, swap_ab=False
    ),
    # dsv3.o_proj
    (7168, 16384, 256): Fp8GemmConfig(
        block_m=128, block_n=128, split_k=1, num_warps=8, num_stages=3, prequantize=True, swap_ab=False
    ),
    # dsv3.dense.gate_up
    (36864, 7168, 1): Fp8GemmConfig(
        block_m=16, block_n=64, split_k=1, num_warps=4, num_stages=4, prequantize=True, swap_ab=True
    ),
    # dsv3.dense.gate_up
    (36864, 7168, 2): Fp8GemmConfig(
        block_m=16, block_n=64, split_k=1, num_warps=4, num_stages=4, prequantize=True, swap_ab=True
    ),
    # dsv3.dense.gate_up
    (36864, 7168, 4): Fp8GemmConfig(
        block_m=16, block_n=64, split_k=1, num_warps=4, num_stages=4, prequantize=True, swap_ab=True
    ),
    # dsv3.dense.gate_up
    (36864, 7168, 8): Fp8GemmConfig(
        block_m=16, block_n=64, split_k=1, num_warps=4, num_stages=4, prequantize=True, swap_ab=True
    ),
    # dsv3.dense.gate_up
    (36864, 7168, 16): Fp8GemmConfig(
        block_m=16, block_n=64, split_k=1, num_warps=4, num_stages=4, prequantize=True, swap_ab=True
    ),
    # dsv3.dense.gate_up
    (36864, 7168, 32): Fp8GemmConfig(
        block_m=32, block_n=128, split_k=2, num_warps=4, num_stages=4, prequantize=True, swap_ab=True
    ),
    # dsv3.dense.gate_up
    (36864, 7168, 64): Fp8GemmConfig(
        block_m=64, block_n=64, split_k=1, num_warps=4, num_stages=3, prequantize=True, swap_ab=False
    ),
    # dsv3.dense.gate_up
    (36864, 7168, 128): Fp8GemmConfig(
        block_m=64, block_n=128, split_k=1, num_warps=8, num_stages=3, prequantize=True, swap_ab=False
    ),
    # dsv3.dense.gate_up
    (36864, 7168, 256): Fp8GemmConfig(
        block_m=128, block_n=128, split_k=1, num_warps=8, num_stages=3, prequantize=True, swap_ab=False
    ),
}


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
