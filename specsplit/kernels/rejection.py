"""Public entry point of the rejection sampler: validation and backend choice.

See ``specsplit/kernels/reference.py`` for the terms (accepted / recovered / bonus) and the algorithm, and
``specsplit/kernels/rng.py`` for the randomness. Both backends compute the same function of their inputs:
the same tokens for the same seeds and positions.
"""

import os

import torch

from specsplit.kernels.reference import densify, rejection_sample_reference
from specsplit.kernels.types import RejectionOutput, SparseDraftProbs
from specsplit.kernels.validation import validate_inputs

BACKENDS = ("auto", "reference", "triton")


def rejection_sample(
    target_logits: torch.Tensor,  # [num_logits, V] float32 (bf16/fp16 are upcast)
    draft_token_ids: torch.Tensor,  # [num_draft_total] int64, ragged by cu_num_draft; -1 = padded
    cu_num_draft: torch.Tensor,  # [num_reqs + 1] int32 prefix sum of num_draft_tokens_per_req
    temperature: torch.Tensor,  # [num_reqs] float32; 0 = greedy
    top_k: torch.Tensor | None,  # [num_reqs] int32; 0 = off; None = off for every request
    top_p: torch.Tensor | None,  # [num_reqs] float32; 1 = off; None = off for every request
    seeds: torch.Tensor,  # [num_reqs] int64
    positions: torch.Tensor,  # [num_reqs] int64: sequence position of each request's first logits row
    draft_probs: SparseDraftProbs | torch.Tensor | None = None,  # None: one-hot; [num_draft_total, V]
    backend: str = "auto",  # "reference" | "triton" | "auto" (triton on CUDA, else reference)
    max_num_draft: int | None = None,  # known on the host: saves a device sync
    all_greedy: bool = False,  # known on the host: every temperature is 0 (saves the race launch)
    coupled: torch.Tensor | None = None,  # [num_reqs] bool / int: coupled sampling (seeded); None: no request is
) -> RejectionOutput:
    """Verify every request's drafts against the target's logits in one step.

    Request r owns logits rows ``cu_num_draft[r] + r`` .. ``cu_num_draft[r+1] + r`` (its drafts'
    rows, then its bonus row). Returns the tokens to append per request; randomness depends only on
    each request's (seed, position), never on the rest of the batch. A coupled request's tokens are those of
    target-only sampling with its (seed, position), whatever its drafts (``reference.py``).
    """
    validate_inputs(
        target_logits,
        draft_token_ids,
        cu_num_draft,
        temperature,
        top_k,
        top_p,
        seeds,
        positions,
        draft_probs,
        coupled,
    )
    backend = _resolve_backend(backend, target_logits)
    if backend == "reference":
        if isinstance(draft_probs, SparseDraftProbs):
            draft_probs = densify(draft_probs, target_logits.shape[1])
        if top_k is None:
            top_k = torch.zeros_like(seeds, dtype=torch.int32)
        if top_p is None:
            top_p = torch.ones_like(temperature)
    args = (target_logits, draft_token_ids, cu_num_draft, temperature, top_k, top_p, seeds, positions, draft_probs)
    if backend == "reference":
        return rejection_sample_reference(*args, max_num_draft, all_greedy, coupled)
    from specsplit.kernels.triton_rejection import rejection_sample_triton

    return rejection_sample_triton(*args, max_num_draft, all_greedy, coupled=coupled)


def _resolve_backend(backend: str, target_logits: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    if backend == "auto":
        return "triton" if target_logits.is_cuda and _triton_available() else "reference"
    if backend == "triton" and not (target_logits.is_cuda or interpreting):
        raise ValueError("backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before kernels are imported")
    if backend == "triton" and not _triton_available():
        raise ValueError("backend='triton' needs the triton package")
    return backend


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
