"""Sparse draft distributions q of a batch's requests → one SparseDraftProbs for the batch, validated.

Each sampled-draft request carries its q as two [num_drafts, K] tensors (token ids, probabilities);
requests with greedy drafts carry none and get one-hot rows at their draft. Shapes are checked per
request as they are decoded; values (ids in the vocabulary or -1, finite non-negative probabilities)
once for the whole batch, which costs a handful of tensor ops instead of a handful per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specsplit.client.errors import InvalidArgument
from specsplit.kernels.types import SparseDraftProbs


@dataclass
class RequestQ:
    request_id: str
    drafts: list[int]  # the request's draft tokens (after trimming)
    ids: torch.Tensor | None  # [len(drafts), K] int64, or None: one-hot at the drafts
    probs: torch.Tensor | None  # [len(drafts), K] float32


def decode_q(r, rid: str, drafts: list[int]) -> RequestQ:
    """The sparse q of `r` (a VerifyItem), first len(drafts) rows (the coordinator may have trimmed its drafts)."""
    d = len(drafts)
    if d == 0 or r.draft_probs is None:
        return RequestQ(rid, drafts, None, None)
    ids, probs = r.draft_probs.token_ids, r.draft_probs.probs
    if ids.dim() != 2 or ids.shape != probs.shape or ids.shape[0] < d or ids.shape[1] < 1:
        raise InvalidArgument(
            f"request {rid!r}: draft_probs must be two [>= {d}, K] tensors, got {tuple(ids.shape)} and "
            f"{tuple(probs.shape)}"
        )
    return RequestQ(rid, drafts, ids[:d].to(torch.int64), probs[:d])


def batch_q(rows: list[RequestQ], vocab_size: int, device) -> SparseDraftProbs | None:
    """One [num_draft_total, K] sparse q for the batch (K = the widest request's; narrower rows are
    padded with id -1, prob 0), or None when no request sent q."""
    if all(q.ids is None for q in rows):
        return None
    k = max(q.ids.shape[1] for q in rows if q.ids is not None)
    all_ids, all_probs = [], []
    for q in rows:
        ids, probs = q.ids, q.probs
        if ids is None:  # one-hot q at the draft itself
            ids = torch.full((len(q.drafts), k), -1, dtype=torch.int64)
            probs = torch.zeros(len(q.drafts), k)
            if q.drafts:
                ids[:, 0] = torch.tensor(q.drafts)
                probs[:, 0] = 1.0
        elif ids.shape[1] < k:
            pad = k - ids.shape[1]
            ids = torch.cat([ids, torch.full((ids.shape[0], pad), -1, dtype=torch.int64)], 1)
            probs = torch.cat([probs, torch.zeros(probs.shape[0], pad)], 1)
        all_ids.append(ids)
        all_probs.append(probs)
    ids, probs = torch.cat(all_ids), torch.cat(all_probs)
    _check_values(ids, probs, vocab_size, rows)
    return SparseDraftProbs(ids.to(device), probs.to(device))


def _check_values(
    ids: torch.Tensor,  # [num_draft_total, K] int64
    probs: torch.Tensor,  # [num_draft_total, K] float32
    vocab_size: int,
    rows: list[RequestQ],
) -> None:
    bad_id = (ids < -1) | (ids >= vocab_size) | ~torch.isfinite(probs)
    negative = probs < 0
    bad = (bad_id | negative).any(dim=1)
    if not bool(bad.any()):
        return
    first = int(bad.nonzero()[0])
    row = first
    for q in rows:  # the request that owns the first bad row
        if row < len(q.drafts):
            break
        row -= len(q.drafts)
    what = "ids outside the vocabulary or non-finite probs" if bool(bad_id[first].any()) else "negative probabilities"
    raise InvalidArgument(f"request {q.request_id!r}: draft_probs has {what}")
