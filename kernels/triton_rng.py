"""Triton twin of ``kernels/rng.py``: the same bits from the same (seed, counter, index).

All hashing is in uint32, whose multiply and shifts wrap and shift logically, exactly like the masked
int64 arithmetic of the torch version.
"""

import triton
import triton.language as tl

ONE_MINUS_HALF_ULP = tl.constexpr(0.999999940395355224609375)  # 1 - 2**-24, exact in float32


@triton.jit
def fmix32(h):
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def row_key(seed, counter):
    """seed, counter: int64 scalars -> uint32 key of one logits row."""
    seed_lo = seed.to(tl.uint32)  # truncation keeps the low 32 bits
    seed_hi = (seed >> 32).to(tl.uint32)
    key = fmix32(fmix32(seed_hi ^ 0x9E3779B9) ^ seed_lo)
    return fmix32(key ^ counter.to(tl.uint32))


@triton.jit
def uniform(key, index):
    """key: uint32 scalar; index: uint32 (vocabulary ids or ACCEPT_INDEX) -> float32 in (0, 1).

    bits = fmix32(fmix32(index + GOLDEN) ^ key); u = (2 * (bits >> 9) + 1) * 2**-24, odd multiples of
    2**-24, exact in float32. Computed without an int-to-float conversion (a quarter-rate instruction
    on the GPU): the float with exponent 0 and mantissa bits >> 9 is 1 + (bits >> 9) * 2**-23, and
    subtracting 1 - 2**-24 from it is exact (Sterbenz), so the result is u to the last bit.
    """
    bits = fmix32(fmix32(index + 0x9E3779B9) ^ key)
    return ((bits >> 9) | 0x3F800000).to(tl.float32, bitcast=True) - ONE_MINUS_HALF_ULP


@triton.jit
def accept_uniform(key):
    return uniform(key, tl.full([], 0xFFFFFFFF, tl.uint32))


@triton.jit
def log2(x, FAST: tl.constexpr):
    """log2 of a normal float32 ``x`` > 0 (the race clocks lie in [8.6e-8, 24]). FAST (GPU): the
    hardware's ``lg2.approx`` (absolute error about 2^-22), several times cheaper than the library's
    correctly rounded log2, for results that are added to O(1) scores (never for a value divided by);
    its ``.ftz`` form skips the rescaling of subnormal inputs, and equals it on normal ones. The
    interpreter cannot run PTX."""
    if FAST:
        y = tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        y = tl.log2(x)
    return y


@triton.jit
def vocab_clocks(key, offs):
    """-log2(u): the race clocks (Exp(1) / ln 2) of vocabulary ids ``offs`` (int32) in the row with ``key``.

    Always the correctly rounded log2: for u near 1 the clock is tiny (down to 8.6e-8) and a race
    divides by it, so it needs relative accuracy, which ``lg2.approx`` (absolute error ~2^-22) lacks.
    """
    return -tl.log2(uniform(key, offs.to(tl.uint32)))
