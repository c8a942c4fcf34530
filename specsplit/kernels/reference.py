"""Pure-torch reference for one speculative verification step (lossless rejection sampling).

Terms (used the same way in the Triton kernels):

- request r carries ``num_draft[r] = cu_num_draft[r+1] - cu_num_draft[r]`` draft tokens (0 allowed)
  and owns ``num_draft[r] + 1`` consecutive logits rows: row j < num_draft scores draft j, the last
  row is the **bonus** row. ``cu_num_logits = cu_num_draft + arange(num_reqs + 1)``.
- **accepted**: a leading draft the target keeps. Greedy rows (temperature 0) keep draft d iff
  ``d == argmax(logits)``; random rows keep it iff ``u * q(d) < p(d)`` with ``u ~ U(0, 1)``, i.e.
  with probability ``min(1, p(d) / q(d))``. A padded draft (-1) or one with ``q(d) == 0`` is never
  accepted.
- **recovered**: the token sampled at the first rejected row from ``max(p - q, 0)`` normalised
  (greedy: the argmax). A padded draft's recovered token is sampled from p.
- **bonus**: the token sampled from p at the bonus row when every draft was accepted.
- output per request: accepted drafts, then one recovered-or-bonus token;
  ``num_sampled = accepted + 1``, ``num_rejected = num_draft - accepted``.

``p = softmax(filtered logits / T)``: top-k/top-p filtering as in ``specsplit/kernels/filtering.py``;
``q`` is one-hot on the draft when no draft probabilities are given.

Sampling without a normalisation pass is an exponential race: with independent clocks
``E_i ~ Exp(1)``, ``argmax_i w_i / E_i`` is distributed as ``w / sum(w)``, and so is
``argmax_i w_i / C_i`` with ``C_i = E_i / ln 2 = -log2(u_i)`` (one scale for all clocks; base 2 is
one GPU instruction). The reference runs the race in the form the kernels use:

- from p (bonus rows, padded drafts, one-hot residual): ``argmax_i x_i * log2(e) - log2 C_i`` with
  ``x = filtered logits / T`` (Gumbel-max in base 2; needs neither the max nor the sum of the row).
  The one-hot residual ``max(p - onehot(d), 0)`` is p with d removed, so the draft simply drops out.
- dense or sparse q: ``argmax_i max(p_i - q_i, 0) / C_i``; if the residual is all zero (p == q up to
  rounding) the token comes from p.

The race runs in two levels over fixed groups of ``GROUP_SIZE`` (2,048) consecutive ids. First the group:
``argmax_g W_g / C_g``, where ``W_g`` is the group's sum of the weights above (p without the draft,
``max(p - q, 0)``, or p; the groups' p where no weight is left) and ``C_g`` the group's own clock. Then the
id, by the race above restricted to that group. Since ``P(g) = W_g / sum(W)`` and ``P(i | g) = w_i / W_g``,
the token is distributed as ``w / sum(w)``, as for one race over every id. The kernels read the group
masses from the softmax statistics they already compute, so the per-id noise of a stop row is computed for
one group of 2,048 ids instead of the whole vocabulary.

**Coupled** requests (``coupled[r]``: the request's seed is the user's) are verified by coupled sampling instead:
every row's token is the race from p above with the row's noise (the target's own sample there), a draft is
accepted iff it equals that token, and the stop row emits it. Acceptance then uses no uniform and no q, so the
output is exactly target-only sampling with that seed (the tokens of k = 0), whatever the drafts; a drafter that
samples its draft with the same noise over its own distribution (``specsplit/drafter/sampling.py``) makes the
two agree often.

The clocks and uniforms come from ``specsplit/kernels/rng.py``: a function of (seed, position + row, index),
so a request's output does not depend on the rest of the batch. Ties go to the lowest id.
"""

import torch

from specsplit.kernels.filtering import logit_thresholds
from specsplit.kernels.rng import GROUP_SIZE, accept_uniform, group_clocks, row_key, vocab_clocks
from specsplit.kernels.types import RejectionOutput, SparseDraftProbs

LOG2E = 1.4426950408889634


def densify(
    draft_probs: SparseDraftProbs,
    vocab_size: int,
) -> torch.Tensor:  # [num_draft_total, V] float32
    """The dense q a sparse top-K q stands for."""
    ids, probs = draft_probs.ids.to(torch.int64), draft_probs.probs.float()
    used = ids >= 0
    q = torch.zeros(ids.shape[0], vocab_size, dtype=torch.float32, device=ids.device)
    return q.scatter_add_(1, ids.clamp(min=0), torch.where(used, probs, 0.0))


def rejection_sample_reference(
    target_logits: torch.Tensor,  # [num_logits, V] float32
    draft_token_ids: torch.Tensor,  # [num_draft_total] int64; -1 = padded
    cu_num_draft: torch.Tensor,  # [num_reqs + 1] int32
    temperature: torch.Tensor,  # [num_reqs] float32; 0 = greedy
    top_k: torch.Tensor,  # [num_reqs] int32; 0 = off
    top_p: torch.Tensor,  # [num_reqs] float32; 1 = off
    seeds: torch.Tensor,  # [num_reqs] int64
    positions: torch.Tensor,  # [num_reqs] int64: position of each request's first logits row
    draft_probs: torch.Tensor | None = None,  # [num_draft_total, V] float32 q; None = one-hot
    max_num_draft: int | None = None,
    all_greedy: bool = False,  # known on the host: every temperature is 0 (the random rows' work is skipped)
    coupled: torch.Tensor | None = None,  # [num_reqs] bool: verified by coupled sampling; None: no request is
) -> RejectionOutput:
    device = target_logits.device
    num_logits = target_logits.shape[0]
    num_reqs = cu_num_draft.numel() - 1
    num_draft_total = draft_token_ids.numel()
    logits = target_logits.float()
    arange_reqs = torch.arange(num_reqs + 1, device=device)

    # Layout: each logits row's request, its index in the request, and its draft (-1 on bonus rows).
    cu_num_draft = cu_num_draft.to(torch.int64)
    num_draft = cu_num_draft[1:] - cu_num_draft[:-1]
    cu_num_logits = cu_num_draft + arange_reqs
    req = torch.repeat_interleave(arange_reqs[:-1], num_draft + 1, output_size=num_logits)
    row = torch.arange(num_logits, device=device) - cu_num_logits[req]
    is_bonus = row == num_draft[req]
    draft_index = torch.where(is_bonus, num_draft_total, cu_num_draft[req] + row)
    padded_drafts = torch.cat([draft_token_ids.to(torch.int64), draft_token_ids.new_full((1,), -1)])
    draft = padded_drafts[draft_index]
    has_draft = draft >= 0
    greedy = temperature[req] <= 0

    # Greedy rows: the target's token is its argmax.
    target_argmax = logits.argmax(dim=-1)
    if all_greedy:  # no random row: the rest is the greedy rows' share of the general case below
        accepted, stop_token = has_draft & (draft == target_argmax), target_argmax
    else:
        accepted, stop_token = _random_rows(
            logits, req, row, draft_index, draft, has_draft, greedy, target_argmax,
            temperature, top_k, top_p, seeds, positions, draft_probs, coupled,
        )  # fmt: skip
    return _leading_run(accepted, stop_token, draft, num_draft, cu_num_logits, num_logits, max_num_draft)


def _random_rows(
    logits, req, row, draft_index, draft, has_draft, greedy, target_argmax,
    temperature, top_k, top_p, seeds, positions, draft_probs, coupled,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per logits row of a batch with sampling requests (its greedy rows by argmax): whether its draft is accepted,
    and the token it emits if the request stops there."""
    device = logits.device
    vocab_size = logits.shape[1]
    d = draft.clamp(min=0)[:, None]

    # Random rows: x = filtered logits / T, p = softmax(x).
    threshold = logit_thresholds(logits, temperature[req], top_k[req], top_p[req])
    inv_temperature = torch.where(greedy, 1.0, 1.0 / temperature[req])
    x = (logits * inv_temperature[:, None]).masked_fill(logits < threshold[:, None], float("-inf"))
    e = (x - x.max(dim=-1, keepdim=True).values).exp()
    p = e / e.sum(dim=-1, keepdim=True)

    # Noise: one acceptance uniform per row, one Exp(1) clock per (row, token).
    key = row_key(seeds[req], positions[req] + row)
    u = accept_uniform(key)
    clocks = vocab_clocks(key, vocab_size)

    # Acceptance of each row's own draft.
    p_d = p.gather(1, d).squeeze(1)
    if draft_probs is None:
        q_d = torch.ones_like(p_d)
    else:
        q = torch.cat([draft_probs.float(), draft_probs.new_zeros(1, vocab_size)])[draft_index]
        q_d = q.gather(1, d).squeeze(1)
    accepted_random = (q_d > 0) & (u * q_d < p_d)

    # Coupled rows: the target's own sample, the race from p with nothing excluded, accepted iff it is the draft.
    group_clock = group_clocks(key, _num_groups(vocab_size))
    race_p = x * LOG2E - clocks.log2()
    if coupled is not None:
        p_group = _race_groups(p, p, group_clock)
        in_p_group = (torch.arange(vocab_size, device=device) // GROUP_SIZE)[None, :] == p_group[:, None]
        p_token = _group_argmax(race_p.masked_fill(~in_p_group, float("-inf")), p_group)
        coupled_row = coupled[req].bool() & ~greedy
        accepted_random = torch.where(coupled_row, draft == p_token, accepted_random)
    accepted = has_draft & torch.where(greedy, draft == target_argmax, accepted_random)

    # The token a request emits if it stops at this row: recovered (rejected row) or bonus. Its weights:
    # p without the rejected one-hot draft, max(p - q, 0) at a rejected dense / sparse draft, else p.
    race = race_p
    if draft_probs is None:
        own_draft = torch.zeros_like(race, dtype=torch.bool).scatter_(1, d, has_draft[:, None])
        race = race.masked_fill(own_draft, float("-inf"))
        weights = p.masked_fill(own_draft, 0.0)
    else:
        residual = (p - q).clamp(min=0)
        weights = torch.where(has_draft[:, None], residual, p)
    # First the group of GROUP_SIZE ids, by a race over the groups' masses (their p if no weight is left),
    group = _race_groups(weights, p, group_clock)
    in_group = (torch.arange(vocab_size, device=device) // GROUP_SIZE)[None, :] == group[:, None]
    # then the id within that group, by the race over its ids.
    random_token = _group_argmax(race.masked_fill(~in_group, float("-inf")), group)
    if draft_probs is not None:
        residual_race = (residual / clocks).masked_fill(~in_group, -1.0)
        residual_token = residual_race.argmax(dim=-1)
        has_residual = residual_race.gather(1, residual_token[:, None]).squeeze(1) > 0
        random_token = torch.where(has_draft & has_residual, residual_token, random_token)
    if coupled is not None:
        random_token = torch.where(coupled_row, p_token, random_token)
    return accepted, torch.where(greedy, target_argmax, random_token)


def _leading_run(
    accepted: torch.Tensor,  # [num_logits] bool
    stop_token: torch.Tensor,  # [num_logits] int64
    draft: torch.Tensor,  # [num_logits] int64, -1 on bonus rows
    num_draft: torch.Tensor,  # [num_reqs] int64
    cu_num_logits: torch.Tensor,  # [num_reqs + 1] int64
    num_logits: int,
    max_num_draft: int | None,
) -> RejectionOutput:
    """Per request: accept the leading run of accepted drafts, then emit the stop token."""
    device = accepted.device
    num_reqs = num_draft.numel()
    if max_num_draft is None:
        max_num_draft = int(num_draft.max()) if num_reqs else 0
    col = torch.arange(max_num_draft + 1, device=device)
    in_request = col[None, :] <= num_draft[:, None]
    rows = (cu_num_logits[:-1, None] + col).clamp(max=max(num_logits - 1, 0))
    num_accepted = (accepted[rows] & in_request).to(torch.int64).cumprod(dim=1).sum(dim=1)
    stop = stop_token[cu_num_logits[:-1] + num_accepted]
    sampled = torch.where(col < num_accepted[:, None], draft[rows], -1)
    sampled = torch.where(col == num_accepted[:, None], stop[:, None], sampled)
    return RejectionOutput(
        sampled=sampled,
        num_sampled=(num_accepted + 1).to(torch.int32),
        num_rejected=(num_draft - num_accepted).to(torch.int32),
    )


def _num_groups(vocab_size: int) -> int:
    return -(-vocab_size // GROUP_SIZE)


def group_sums(w: torch.Tensor, num_groups: int) -> torch.Tensor:  # [n, V] -> [n, num_groups]
    padded = torch.nn.functional.pad(w, (0, num_groups * GROUP_SIZE - w.shape[1]))
    return padded.view(w.shape[0], num_groups, GROUP_SIZE).sum(dim=-1)


def _race_groups(weights: torch.Tensor, p: torch.Tensor, clocks: torch.Tensor) -> torch.Tensor:  # [n] int64
    """The exponential race over the groups: argmax mass / clock, with the masses of ``weights``, or of p
    where the weights have no mass at all (rounding aside, only where no draft was rejected)."""
    weight_race = group_sums(weights, clocks.shape[1]) / clocks
    p_race = group_sums(p, clocks.shape[1]) / clocks
    return torch.where(weight_race.max(dim=-1).values > 0, weight_race.argmax(dim=-1), p_race.argmax(dim=-1))


def _group_argmax(scores: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """argmax of rows holding -inf outside their group; the group's first id where nothing in it is finite."""
    token = scores.argmax(dim=-1)
    return torch.where(scores.max(dim=-1).values == float("-inf"), group * GROUP_SIZE, token)
