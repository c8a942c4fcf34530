"""How the drafter picks a draft: argmax for greedy requests; for sampled requests (temperature > 0)
a sample from q = the top-K-truncated, renormalised softmax(logits / T), shipped as sparse
(ids, probs) so the verifier's rejection sampler uses the exact q the draft was drawn from.

The sample is the verifier's two-level exponential race (``specsplit/kernels/reference.py``: first the group of
``GROUP_SIZE`` ids by the groups' masses, then the id within it) run over q, with the counter-based noise of
``specsplit/kernels/rng.py`` keyed by (a seed, the counter of the verifier's row that scores the draft: the
position of the token before it). Which seed (``noise_seed``):

- a **coupled** request (its seed is the user's) uses its plain seed: the verifier's noise at that row. The race
  over q then picks what the target's race over p picks there whenever q is close to p, and the verifier accepts
  a draft iff it is the target's own sample: the output is target-only sampling with that seed, whatever q is.
- any other sampled request uses ``seed XOR DRAFT_SALT``: rejection sampling needs drafts independent of the
  verifier's noise, and drafts correlated with its uniforms would break losslessness.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specsplit.kernels.rng import GOLDEN, GROUP_SIZE, MASK32, fmix32, group_clocks, row_key, uniform_from_bits

DRAFT_SALT = 0x2545F4914F6CDD1D  # < 2**63, so salted seeds stay valid int64


@dataclass
class DraftStep:
    tokens: torch.Tensor  # [n] int64 draft ids
    q_ids: torch.Tensor  # [n, K] int64 support of q (rows of greedy requests unused)
    q_probs: torch.Tensor  # [n, K] float32 q over that support


def noise_seed(seed: int, coupled: bool) -> int:
    """The seed of a sampled draft's noise: the verifier's (coupled) or a stream of the drafter's own."""
    return seed if coupled else seed ^ DRAFT_SALT


def pick_drafts(
    logits: torch.Tensor,  # [n, V] float32
    temperature: torch.Tensor,  # [n] float32; 0 = greedy
    seeds: torch.Tensor,  # [n] int64: `noise_seed` of each row's request
    counters: torch.Tensor,  # [n] int64: the counter of the verifier's row that scores the draft (its position - 1)
    top_k: int,
    *,
    any_sampled: bool | None = None,  # known on the host: skips a device sync; None: read from `temperature`
    column_ids: torch.Tensor | None = None,  # [C] int64: a draft vocabulary's id per logits column (draft_vocab.py)
    vocab_size: int | None = None,  # with column_ids: the full vocabulary's
) -> DraftStep:
    """With `column_ids` the logits score C ids of a draft vocabulary: the drafts and q's support come back as their
    ids, and the race runs over those ids as it would over the full vocabulary's logits."""
    n, columns = logits.shape
    greedy = to_ids(logits.argmax(dim=-1), column_ids)
    sampled = temperature > 0
    k = min(top_k, columns)
    if not (bool(sampled.any()) if any_sampled is None else any_sampled):
        empty = torch.zeros(n, k, dtype=torch.int64, device=logits.device)
        return DraftStep(greedy, empty, empty.to(torch.float32))
    t = torch.where(sampled, temperature, torch.ones_like(temperature))
    probs = torch.softmax(logits / t[:, None], dim=-1)  # [n, V]
    top_p, top_columns = probs.topk(k, dim=-1)  # [n, K]
    top_ids = to_ids(top_columns, column_ids)
    q = top_p / top_p.sum(dim=-1, keepdim=True)
    vocab = columns if column_ids is None else vocab_size  # the race's groups are the full vocabulary's
    choice = race_sparse(q, top_ids, row_key(seeds, counters), vocab)  # P(choice = j) = q_j
    tokens = torch.where(sampled, top_ids.gather(1, choice[:, None]).squeeze(1), greedy)
    return DraftStep(tokens, top_ids, q)


def to_ids(columns: torch.Tensor, column_ids: torch.Tensor | None) -> torch.Tensor:
    """Logits columns as token ids: themselves, or a draft vocabulary's ids (`column_ids`, [C] int64)."""
    return columns if column_ids is None else column_ids[columns]


def race_sparse(
    q: torch.Tensor,  # [n, K] float32, rows summing to 1
    ids: torch.Tensor,  # [n, K] int64 vocabulary ids of q's entries
    key: torch.Tensor,  # [n] int64 from row_key
    vocab_size: int,
) -> torch.Tensor:  # [n] int64: the column of q each row picks
    """The verifier's two-level race (`specsplit/kernels/reference.py`) over a q that lists K ids: the group by the
    groups' masses over their group clocks, then the id within it by q / its clock; with the same key it picks what
    the verifier's race over p picks wherever q equals p."""
    num_groups = -(-vocab_size // GROUP_SIZE)
    group = ids // GROUP_SIZE  # [n, K]
    masses = torch.zeros(q.shape[0], num_groups, dtype=q.dtype, device=q.device).scatter_add_(1, group, q)
    winner = (masses / group_clocks(key, num_groups)).argmax(dim=-1, keepdim=True)  # [n, 1]
    score = torch.where(group == winner, q / race_clocks(key, ids), -1.0)
    return score.argmax(dim=-1)


def race_clocks(
    key: torch.Tensor,  # [n] int64 from row_key
    ids: torch.Tensor,  # [n, K] int64 vocabulary ids
) -> torch.Tensor:  # [n, K] float32
    """`specsplit.kernels.rng.vocab_clocks(key, V).gather(1, ids)` bit for bit, hashing only the K ids of each
    row instead of the whole vocabulary."""
    bits = fmix32(fmix32((ids + GOLDEN) & MASK32) ^ key[:, None])
    return -torch.log2(uniform_from_bits(bits))
