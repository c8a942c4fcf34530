"""Triton twin of ``specsplit/kernels/rng.py``: the same bits from the same (seed, counter, index).

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
def special(x, FUNCTION: tl.constexpr, APPROX: tl.constexpr):
    """log2 (FUNCTION "lg2") or 1 / x ("rcp") of float32 ``x``. APPROX: the GPU's special-function unit
    (``lg2.approx.ftz.f32``: absolute error ~2^-22; ``rcp.approx.ftz.f32``: ~1 ulp); otherwise the
    correctly rounded operation (the interpreter cannot run PTX)."""
    if APPROX:
        y = tl.inline_asm_elementwise(
            FUNCTION + ".approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    elif FUNCTION == "lg2":
        y = tl.log2(x)
    else:
        y = 1.0 / x
    return y


@triton.jit
def log2(x, FAST: tl.constexpr):
    """log2 of a normal float32 ``x`` > 0 (the race clocks lie in [8.6e-8, 24]). FAST (GPU): the
    hardware's ``lg2.approx`` (absolute error about 2^-22), several times cheaper than the library's
    correctly rounded log2, for results that are added to O(1) scores (never for a value divided by);
    its ``.ftz`` form skips the rescaling of subnormal inputs, and equals it on normal ones. The
    interpreter cannot run PTX."""
    return special(x, "lg2", FAST)


@triton.jit
def fast_clock(u, APPROX: tl.constexpr):
    """-log2(u) for u in (0, 1) to about 3 ulp (relative; ``tests/gpu/test_rejection_cuda.py`` checks every
    uniform: benchmarks/results/rejection_sampler_h200.md), cheaper than the correctly rounded log2 (it shortens
    the whole sampler: docs/performance.md, "Rejection sampler against vLLM"). Below 1/2 the clock is >= 1 and
    ``lg2.approx`` (absolute error ~2^-22) is accurate enough. From 1/2 up, where the clock goes to 0 and needs
    relative accuracy, -ln(1 - w) with the exact w = 1 - u is 2 atanh(t), t = w / (2 - w) <= 1/3, summed to t^15
    (truncation < 2e-9). APPROX=False (the interpreter, tests) checks the same algebra with exact log2 and
    reciprocal."""
    far = -special(u, "lg2", APPROX)
    w = 1.0 - u
    t = w * special(2.0 - w, "rcp", APPROX)
    s = t * t
    poly = tl.fma(s, 1.0 / 15.0, 1.0 / 13.0)
    poly = tl.fma(s, poly, 1.0 / 11.0)
    poly = tl.fma(s, poly, 1.0 / 9.0)
    poly = tl.fma(s, poly, 1.0 / 7.0)
    poly = tl.fma(s, poly, 1.0 / 5.0)
    poly = tl.fma(s, poly, 1.0 / 3.0)
    poly = tl.fma(s, poly, 1.0)
    near = t * (2.0 * 1.4426950408889634) * poly
    return tl.where(u < 0.5, far, near)


@triton.jit
def vocab_clocks(key, offs, FAST: tl.constexpr):
    """-log2(u): the race clocks (Exp(1) / ln 2) of vocabulary ids ``offs`` (int32) in the row with ``key``.

    A race divides by the clock, and the winner often has a tiny one (u near 1, down to 8.6e-8), so it
    needs relative accuracy, which ``lg2.approx`` alone (absolute error ~2^-22) lacks. FAST (GPU):
    ``fast_clock`` (~3 ulp); otherwise the correctly rounded log2 (the interpreter cannot run PTX).
    """
    u = uniform(key, offs.to(tl.uint32))
    if FAST:
        clock = fast_clock(u, True)
    else:
        clock = -tl.log2(u)
    return clock
