"""Triton twin of ``kernels/rng.py``: the same bits from the same (seed, counter, index).

All hashing is in uint32, whose multiply and shifts wrap and shift logically, exactly like the masked
int64 arithmetic of the torch version.
"""

import triton
import triton.language as tl


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

    bits = fmix32(fmix32(index + GOLDEN) ^ key); odd multiples of 2**-24, exact in float32.
    """
    bits = fmix32(fmix32(index + 0x9E3779B9) ^ key)
    return (((bits >> 9) << 1) | 1).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def accept_uniform(key):
    return uniform(key, tl.full([], 0xFFFFFFFF, tl.uint32))


@triton.jit
def vocab_exponential(key, offs):
    """Exp(1) clocks of vocabulary ids ``offs`` (int32) in the row with ``key``."""
    return -tl.log(uniform(key, offs.to(tl.uint32)))
