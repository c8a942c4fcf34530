"""Top-k / top-p filtering as one logit threshold per row.

Filtering keeps token ``i`` of a row iff ``logits[i] >= threshold``; every other token gets
probability 0 before the softmax. The threshold is

- top-k (``0 < k < V``): the k-th largest logit;
- top-p (``p < 1``): the smallest logit of the shortest prefix of the tokens sorted by probability
  (after top-k) whose mass reaches ``p``, i.e. tokens whose strictly-larger predecessors carry less
  than ``p`` of the mass;
- both: the larger of the two; neither: ``-inf``.

Tokens tied with the threshold are all kept, so a threshold fully describes the filter and the
reference and the Triton kernels apply exactly the same one (both call this function). Plain sampling
uses it unchanged: it is the zero-draft case of the rejection sampler.
"""

import torch


def logit_thresholds(
    logits: torch.Tensor,  # [n, V] float32, raw (not temperature-scaled)
    temperature: torch.Tensor,  # [n] float32; <= 0 rows are greedy and get a threshold anyway
    top_k: torch.Tensor,  # [n] int; 0 (or >= V) = off
    top_p: torch.Tensor,  # [n] float32; >= 1 = off
) -> torch.Tensor:  # [n] float32
    vocab_size = logits.shape[-1]
    sorted_logits = logits.float().sort(dim=-1, descending=True).values
    neg_inf = torch.full_like(sorted_logits[:, 0], float("-inf"))

    k = top_k.to(torch.int64)
    k_on = (k > 0) & (k < vocab_size)
    kth = sorted_logits.gather(1, (k.clamp(1, vocab_size) - 1)[:, None]).squeeze(1)
    threshold_k = torch.where(k_on, kth, neg_inf)

    inv_temperature = torch.where(temperature > 0, 1.0 / temperature, torch.ones_like(temperature))
    scaled = (sorted_logits * inv_temperature[:, None]).masked_fill(sorted_logits < threshold_k[:, None], float("-inf"))
    probs = scaled.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    num_kept = (mass_before < top_p[:, None]).sum(dim=-1).clamp(min=1)
    last_kept = sorted_logits.gather(1, (num_kept - 1)[:, None]).squeeze(1)
    threshold_p = torch.where(top_p < 1, last_kept, neg_inf)
    return torch.maximum(threshold_k, threshold_p)


def row_thresholds(
    logits: torch.Tensor,  # [num_logits, V]: num_draft + 1 rows per request
    cu_num_draft: torch.Tensor,  # [num_reqs + 1] int32
    temperature: torch.Tensor,  # [num_reqs] float32
    top_k: torch.Tensor | None,  # [num_reqs] int; None = off everywhere
    top_p: torch.Tensor | None,  # [num_reqs] float32; None = off everywhere
) -> torch.Tensor:  # [num_logits] float32
    """Thresholds per logits row; -inf on rows of requests that do not filter (or are greedy).

    Only the filtering rows are sorted; finding them costs one device sync (``nonzero``), which
    ``top_k = top_p = None`` skips.
    """
    num_logits, vocab_size = logits.shape
    threshold = torch.full((num_logits,), float("-inf"), dtype=torch.float32, device=logits.device)
    if top_k is None and top_p is None:
        return threshold
    num_reqs = temperature.numel()
    top_k = torch.zeros(num_reqs, dtype=torch.int32, device=logits.device) if top_k is None else top_k
    top_p = torch.ones(num_reqs, device=logits.device) if top_p is None else top_p
    filters = (temperature > 0) & (((top_k > 0) & (top_k < vocab_size)) | (top_p < 1))
    num_rows = (cu_num_draft[1:] - cu_num_draft[:-1]) + 1
    req = torch.repeat_interleave(torch.arange(num_reqs, device=logits.device), num_rows, output_size=num_logits)
    rows = torch.nonzero(filters[req]).squeeze(1)
    if rows.numel():
        req = req[rows]
        threshold[rows] = logit_thresholds(logits[rows], temperature[req], top_k[req], top_p[req])
    return threshold
