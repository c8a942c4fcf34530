"""The Triton RNG produces the torch RNG's bits, and those bits look uniform."""

import torch
import triton
import triton.language as tl
from scipy.stats import chisquare

from specsplit.kernels import rng, triton_rng


@triton.jit
def _noise_kernel(
    seeds_ptr,  # [n] int64
    counters_ptr,  # [n] int64
    accept_ptr,  # [n] float32 out
    clocks_ptr,  # [n, V] float32 out
    vocab_size,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    key = triton_rng.row_key(tl.load(seeds_ptr + row), tl.load(counters_ptr + row))
    tl.store(accept_ptr + row, triton_rng.accept_uniform(key))
    offs = tl.arange(0, BLOCK_V)
    clocks = triton_rng.vocab_clocks(key, offs, False)
    tl.store(clocks_ptr + row * vocab_size + offs, clocks, mask=offs < vocab_size)


def test_triton_noise_equals_torch_noise():
    """Uniforms are the same bits; clocks differ at most by the last ulp of the two libraries' log."""
    seeds = torch.tensor([0, 1, -1, 2**62 + 12345, -(2**63), 2**63 - 1, 42, 42])
    counters = torch.tensor([0, 1, 7, 2**31, 2**32 + 5, 123_456, 0, 1])
    vocab_size = 300
    accept = torch.empty(len(seeds))
    clocks = torch.empty(len(seeds), vocab_size)
    _noise_kernel[(len(seeds),)](seeds, counters, accept, clocks, vocab_size, BLOCK_V=512)

    key = rng.row_key(seeds, counters)
    assert torch.equal(accept, rng.accept_uniform(key))
    torch.testing.assert_close(clocks, rng.vocab_clocks(key, vocab_size), rtol=3e-7, atol=0)


def test_uniforms_are_open_interval_and_uniform():
    key = rng.row_key(torch.arange(64), torch.arange(64) * 3)
    u = rng.uniform_from_bits(rng.random_bits(key, torch.arange(4096)))
    assert u.min() > 0 and u.max() < 1
    counts = torch.histc(u, bins=64, min=0, max=1)
    assert chisquare(counts.numpy()).pvalue > 1e-4


def test_noise_depends_on_seed_counter_and_index():
    key = rng.row_key(torch.tensor([5, 5, 6]), torch.tensor([10, 11, 10]))
    clocks = rng.vocab_clocks(key, 50)
    assert len({tuple(row.tolist()) for row in clocks}) == 3
    assert clocks[0].unique().numel() == 50
    assert rng.accept_uniform(key).unique().numel() == 3


@triton.jit
def _fast_clock_kernel(u_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    u = tl.load(u_ptr + offs, mask=offs < n, other=0.5)
    tl.store(out_ptr + offs, triton_rng.fast_clock(u, False), mask=offs < n)


def test_fast_clock_algebra_is_accurate_on_every_uniform():
    """The GPU's clock (kernels/triton_rng.fast_clock: log below 1/2, an atanh series above) with exact
    log2 and reciprocal in place of the hardware's approximations: within 3 ulp of -log2(u) in float64 on
    every value ``uniform`` can produce (odd multiples of 2^-24), the tiny clocks near u = 1 included.
    (On the GPU, tests/gpu/test_rejection_cuda.py measures it with the approximations.)"""
    u64 = (torch.arange(2**23, dtype=torch.float64) * 2 + 1) * 2.0**-24
    u = u64.float()
    assert torch.equal(u.double(), u64)  # every uniform is exact in float32
    out = torch.empty_like(u)
    block = 1 << 20
    _fast_clock_kernel[(triton.cdiv(u.numel(), block),)](u, out, u.numel(), BLOCK=block)
    truth = -torch.log2(u64)
    relative = ((out.double() - truth).abs() / truth).max().item()
    assert relative < 3 * 2.0**-23, relative
    assert out.min() > 0 and out[-1] < 1e-7  # u = 1 - 2^-24: the smallest clock, still accurate
