"""The rejection sampler's limits, and its inputs and outputs that are more than one tensor."""

from dataclasses import dataclass

import torch

# The Triton backend keeps a request's rows as bits of one state word (``triton_rejection_common.ROW_BITS``); the
# verifier holds both backends to this limit.
MAX_DRAFTS_PER_REQUEST = 31


@dataclass(frozen=True)
class SparseDraftProbs:
    """The exact top-K-truncated draft distribution q each draft was sampled from.

    q(v) = probs[i, j] where ids[i, j] == v, and 0 for every id not listed. Ids are unique within a
    row; -1 marks an unused slot (its prob is ignored).
    """

    ids: torch.Tensor  # [num_draft_total, K] int64
    probs: torch.Tensor  # [num_draft_total, K] float32


@dataclass(frozen=True)
class RejectionOutput:
    """One verification step's result per request.

    ``sampled[r]`` holds the request's accepted drafts, then one recovered or bonus token, then -1.
    """

    sampled: torch.Tensor  # [num_reqs, max_num_draft + 1] int64; -1 after num_sampled
    num_sampled: torch.Tensor  # [num_reqs] int32 = accepted + 1
    num_rejected: torch.Tensor  # [num_reqs] int32 = num_draft - accepted
