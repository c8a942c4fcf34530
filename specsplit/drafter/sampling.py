"""How the drafter picks a draft: argmax for greedy requests; for sampled requests (temperature > 0)
a sample from q = the top-K-truncated, renormalised softmax(logits / T), shipped as sparse
(ids, probs) so the verifier's rejection sampler uses the exact q the draft was drawn from.

The draft's randomness is a counter-based hash of (seed XOR DRAFT_SALT, position), so it is
reproducible per request and independent of the verifier's noise (which uses the plain seed):
drafts correlated with the verifier's uniforms would break losslessness.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specsplit.kernels.rng import GOLDEN, MASK32, fmix32, row_key, uniform_from_bits

DRAFT_SALT = 0x2545F4914F6CDD1D  # < 2**63, so salted seeds stay valid int64


@dataclass
class DraftStep:
    tokens: torch.Tensor  # [n] int64 draft ids
    q_ids: torch.Tensor  # [n, K] int64 support of q (rows of greedy requests unused)
    q_probs: torch.Tensor  # [n, K] float32 q over that support


def pick_drafts(
    logits: torch.Tensor,  # [n, V] float32
    temperature: torch.Tensor,  # [n] float32; 0 = greedy
    seeds: torch.Tensor,  # [n] int64
    positions: torch.Tensor,  # [n] int64: position of the token being drafted
    top_k: int,
    *,
    any_sampled: bool | None = None,  # known on the host: skips a device sync; None: read from `temperature`
) -> DraftStep:
    greedy = logits.argmax(dim=-1)
    sampled = temperature > 0
    n, vocab = logits.shape
    k = min(top_k, vocab)
    if not (bool(sampled.any()) if any_sampled is None else any_sampled):
        empty = torch.zeros(n, k, dtype=torch.int64, device=logits.device)
        return DraftStep(greedy, empty, empty.to(torch.float32))
    t = torch.where(sampled, temperature, torch.ones_like(temperature))
    probs = torch.softmax(logits / t[:, None], dim=-1)  # [n, V]
    top_p, top_ids = probs.topk(k, dim=-1)  # [n, K]
    q = top_p / top_p.sum(dim=-1, keepdim=True)
    clocks = race_clocks(row_key(seeds ^ DRAFT_SALT, positions), top_ids)  # [n, K]
    choice = (q / clocks).argmax(dim=-1, keepdim=True)  # exponential race: P(choice = j) = q_j
    tokens = torch.where(sampled, top_ids.gather(1, choice).squeeze(1), greedy)
    return DraftStep(tokens, top_ids, q)


def race_clocks(
    key: torch.Tensor,  # [n] int64 from row_key
    ids: torch.Tensor,  # [n, K] int64 vocabulary ids
) -> torch.Tensor:  # [n, K] float32
    """`specsplit.kernels.rng.vocab_clocks(key, V).gather(1, ids)` bit for bit, hashing only the K ids of each
    row instead of the whole vocabulary."""
    bits = fmix32(fmix32((ids + GOLDEN) & MASK32) ^ key[:, None])
    return -torch.log2(uniform_from_bits(bits))
