"""Counter-based random numbers shared by the reference and the Triton kernels.

Every random number the rejection sampler uses is a pure function of
``(seed, counter, index)``:

- ``seed``    the request's int64 seed,
- ``counter`` ``position + row``: the sequence position of the request's first logits row plus the
  row's index within the request (taken mod 2**32),
- ``index``   a vocabulary id for the per-token noise, ``GROUP_INDEX + g`` for the noise of the group
  of ``GROUP_SIZE`` ids starting at ``g * GROUP_SIZE``, or ``ACCEPT_INDEX`` for the row's acceptance
  uniform.

So a request's randomness never depends on what else is in the batch, and the torch code below and
its Triton twin (``specsplit/kernels/triton_rng.py``) produce the same bits. The hash is MurmurHash3's 32-bit
finaliser ``fmix32`` (a bijection with full avalanche) applied in a chain::

    key(seed, counter) = fmix32(fmix32(fmix32(seed_hi ^ GOLDEN) ^ seed_lo) ^ counter)
    bits(key, index)   = fmix32(fmix32(index + GOLDEN) ^ key)
    uniform            = (2 * (bits >> 9) + 1) / 2**24          # odd multiples of 2**-24: in (0, 1)
    clock              = -log2(uniform)                          # Exp(1) / ln 2: > 0, finite

The uniform has 23 random bits and is exact in float32, so it never is 0 or 1 and the kernel and the
reference round it identically. A drafter that samples its drafts must use a different stream (for
example a different seed): drafts must be independent of the verifier's noise.

torch has no unsigned 32-bit multiply, so values live in int64 tensors in ``[0, 2**32)`` and
``_mul32`` multiplies by 16-bit halves of the constant, which never overflows int64.
"""

import torch

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
FMIX_C1 = 0x85EBCA6B
FMIX_C2 = 0xC2B2AE35
ACCEPT_INDEX = 0xFFFFFFFF  # never a vocabulary id
# The recovered / bonus token's race runs over fixed groups of ids (specsplit/kernels/reference.py); a group's own
# noise index is GROUP_INDEX + its number: above every vocabulary id and below ACCEPT_INDEX.
GROUP_SIZE = 2048
GROUP_INDEX = 0x80000000
UNIFORM_SCALE = 2.0**-24


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in [0, 2**32) and a 32-bit constant ``c``."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding uint32 values."""
    h = h ^ (h >> 16)
    h = _mul32(h, FMIX_C1)
    h = h ^ (h >> 13)
    h = _mul32(h, FMIX_C2)
    return h ^ (h >> 16)


def row_key(
    seed: torch.Tensor,  # [n] int64
    counter: torch.Tensor,  # [n] int64: position + row
) -> torch.Tensor:  # [n] int64 holding uint32
    seed = seed.to(torch.int64)
    seed_lo = seed & MASK32
    seed_hi = (seed >> 32) & MASK32
    key = fmix32(fmix32(seed_hi ^ GOLDEN) ^ seed_lo)
    return fmix32(key ^ (counter.to(torch.int64) & MASK32))


def random_bits(
    key: torch.Tensor,  # [n] int64 from row_key
    index: torch.Tensor | int,  # [V] int64 vocabulary ids, or ACCEPT_INDEX
) -> torch.Tensor:  # [n, V] (or [n] for an int index) int64 holding uint32
    if isinstance(index, int):
        index = torch.tensor(index, dtype=torch.int64, device=key.device)
        return fmix32(fmix32((index + GOLDEN) & MASK32) ^ key)
    return fmix32(fmix32((index + GOLDEN) & MASK32)[None, :] ^ key[:, None])


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """Odd multiples of 2**-24 in (0, 1), float32, exact."""
    return (((bits >> 9) << 1) | 1).to(torch.float32) * UNIFORM_SCALE


def accept_uniform(key: torch.Tensor) -> torch.Tensor:  # [n] float32
    return uniform_from_bits(random_bits(key, ACCEPT_INDEX))


def vocab_clocks(key: torch.Tensor, vocab_size: int, first_index: int = 0) -> torch.Tensor:  # [n, V] float32
    """The exponential race's clock for every (row, vocabulary id): ``-log2(u)``, an Exp(1) variable
    divided by ln 2. A scale common to all clocks never changes a race's winner, and base 2 is what
    the GPU computes fastest (one ``lg2`` instruction). The noise indices start at ``first_index``."""
    index = first_index + torch.arange(vocab_size, dtype=torch.int64, device=key.device)
    return -torch.log2(uniform_from_bits(random_bits(key, index)))


def group_clocks(key: torch.Tensor, num_groups: int) -> torch.Tensor:  # [n, num_groups] float32
    """The race clock of every (row, group of ``GROUP_SIZE`` ids): as ``vocab_clocks``, from the
    group's own index ``GROUP_INDEX + g``."""
    return vocab_clocks(key, num_groups, GROUP_INDEX)
