"""Public entry point of the rejection sampler: validation and backend choice.

See ``kernels/reference.py`` for the terms (accepted / recovered / bonus) and the algorithm, and
``kernels/rng.py`` for the randomness. Both backends compute the same function of their inputs:
the same tokens for the same seeds and positions.
"""

import os

import torch

from kernels.reference import densify, rejection_sample_reference
from kernels.types import RejectionOutput, SparseDraftProbs

BACKENDS = ("auto", "reference", "triton")


def rejection_sample(
    target_logits: torch.Tensor,  # [num_logits, V] float32 (bf16/fp16 are upcast)
    draft_token_ids: torch.Tensor,  # [num_draft_total] int64, ragged by cu_num_draft; -1 = padded
    cu_num_draft: torch.Tensor,  # [num_reqs + 1] int32 prefix sum of num_draft_tokens_per_req
    temperature: torch.Tensor,  # [num_reqs] float32; 0 = greedy
    top_k: torch.Tensor,  # [num_reqs] int32; 0 = off
    top_p: torch.Tensor,  # [num_reqs] float32; 1 = off
    seeds: torch.Tensor,  # [num_reqs] int64
    positions: torch.Tensor,  # [num_reqs] int64: sequence position of each request's first logits row
    draft_probs: SparseDraftProbs | torch.Tensor | None = None,  # None: one-hot; [num_draft_total, V]
    backend: str = "auto",  # "reference" | "triton" | "auto" (triton on CUDA, else reference)
    max_num_draft: int | None = None,  # known on the host: saves a device sync
) -> RejectionOutput:
    """Verify every request's drafts against the target's logits in one step.

    Request r owns logits rows ``cu_num_draft[r] + r`` .. ``cu_num_draft[r+1] + r`` (its drafts'
    rows, then its bonus row). Returns the tokens to append per request; randomness depends only on
    each request's (seed, position), never on the rest of the batch.
    """
    _validate(
        target_logits, draft_token_ids, cu_num_draft, temperature, top_k, top_p, seeds, positions,
        draft_probs,
    )
    backend = _resolve_backend(backend, target_logits)
    if backend == "reference":
        if isinstance(draft_probs, SparseDraftProbs):
            draft_probs = densify(draft_probs, target_logits.shape[1])
        return rejection_sample_reference(
            target_logits, draft_token_ids, cu_num_draft, temperature, top_k, top_p, seeds, positions,
            draft_probs, max_num_draft,
        )
    from kernels.triton_rejection import rejection_sample_triton

    return rejection_sample_triton(
        target_logits, draft_token_ids, cu_num_draft, temperature, top_k, top_p, seeds, positions,
        draft_probs, max_num_draft,
    )


def _resolve_backend(backend: str, target_logits: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    if backend == "auto":
        return "triton" if target_logits.is_cuda and _triton_available() else "reference"
    if backend == "triton" and not (target_logits.is_cuda or interpreting):
        raise ValueError(
            "backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before kernels are imported"
        )
    if backend == "triton" and not _triton_available():
        raise ValueError("backend='triton' needs the triton package")
    return backend


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _validate(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    cu_num_draft: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    draft_probs: SparseDraftProbs | torch.Tensor | None,
) -> None:
    """Shape, dtype and device checks that need no device sync; ValueError names the culprit."""
    if target_logits.dim() != 2 or not target_logits.is_floating_point():
        raise ValueError(
            f"target_logits must be a float [num_logits, V] tensor, got {target_logits.dtype} "
            f"{tuple(target_logits.shape)}"
        )
    num_logits, vocab_size = target_logits.shape
    _check_int("draft_token_ids", draft_token_ids, 1)
    _check_int("cu_num_draft", cu_num_draft, 1)
    if cu_num_draft.numel() < 1:
        raise ValueError("cu_num_draft must have num_reqs + 1 >= 1 entries")
    num_reqs = cu_num_draft.numel() - 1
    num_draft_total = draft_token_ids.numel()
    if num_logits != num_draft_total + num_reqs:
        raise ValueError(
            f"target_logits has {num_logits} rows but num_draft_total + num_reqs = "
            f"{num_draft_total} + {num_reqs} = {num_draft_total + num_reqs} (one row per draft plus "
            "one bonus row per request)"
        )
    for name, t in (("temperature", temperature), ("top_p", top_p)):
        if t.shape != (num_reqs,) or not t.is_floating_point():
            raise ValueError(f"{name} must be a float [num_reqs={num_reqs}] tensor, got {t.dtype} "
                             f"{tuple(t.shape)}")
    for name, t in (("top_k", top_k), ("seeds", seeds), ("positions", positions)):
        _check_int(name, t, 1)
        if t.shape != (num_reqs,):
            raise ValueError(f"{name} must have shape [num_reqs={num_reqs}], got {tuple(t.shape)}")
    tensors = [draft_token_ids, cu_num_draft, temperature, top_k, top_p, seeds, positions]
    if isinstance(draft_probs, SparseDraftProbs):
        _check_int("draft_probs.ids", draft_probs.ids, 2)
        if draft_probs.ids.shape[0] != num_draft_total or draft_probs.probs.shape != draft_probs.ids.shape:
            raise ValueError(
                f"draft_probs.ids and .probs must both be [num_draft_total={num_draft_total}, K], got "
                f"{tuple(draft_probs.ids.shape)} and {tuple(draft_probs.probs.shape)}"
            )
        if not draft_probs.probs.is_floating_point():
            raise ValueError(f"draft_probs.probs must be float, got {draft_probs.probs.dtype}")
        tensors += [draft_probs.ids, draft_probs.probs]
    elif isinstance(draft_probs, torch.Tensor):
        if draft_probs.shape != (num_draft_total, vocab_size) or not draft_probs.is_floating_point():
            raise ValueError(
                f"dense draft_probs must be a float [num_draft_total={num_draft_total}, V={vocab_size}] "
                f"tensor, got {draft_probs.dtype} {tuple(draft_probs.shape)}"
            )
        tensors.append(draft_probs)
    elif draft_probs is not None:
        raise ValueError(f"draft_probs must be None, a tensor or SparseDraftProbs, got {type(draft_probs)}")
    for t in tensors:
        if t.device != target_logits.device:
            raise ValueError(f"all tensors must be on {target_logits.device}, found one on {t.device}")
    if not cu_num_draft.is_cuda and num_reqs and int(cu_num_draft[-1]) != num_draft_total:
        raise ValueError(
            f"cu_num_draft[-1] = {int(cu_num_draft[-1])} but draft_token_ids has {num_draft_total} entries"
        )


def _check_int(name: str, t: torch.Tensor, dim: int) -> None:
    if t.dim() != dim or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must be a {dim}-d integer tensor, got {t.dtype} {tuple(t.shape)}")
