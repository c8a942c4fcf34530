"""Input checks for the rejection sampler: shapes, dtypes, devices; no device sync.

Each failure raises ValueError naming the argument, what was expected and what came.
"""

import torch

from specsplit.kernels.types import SparseDraftProbs


def validate_inputs(
    target_logits: torch.Tensor,  # [num_logits, V]
    draft_token_ids: torch.Tensor,  # [num_draft_total]
    cu_num_draft: torch.Tensor,  # [num_reqs + 1]
    temperature: torch.Tensor,  # [num_reqs]
    top_k: torch.Tensor | None,  # [num_reqs]
    top_p: torch.Tensor | None,  # [num_reqs]
    seeds: torch.Tensor,  # [num_reqs]
    positions: torch.Tensor,  # [num_reqs]
    draft_probs: SparseDraftProbs | torch.Tensor | None,  # [num_draft_total, V] or [num_draft_total, K]
    coupled: torch.Tensor | None = None,  # [num_reqs] bool or integer
) -> None:
    _check("target_logits", target_logits, (None, None), float)
    num_logits, vocab_size = target_logits.shape
    _check("draft_token_ids", draft_token_ids, (None,), int)
    _check("cu_num_draft", cu_num_draft, (None,), int)
    if cu_num_draft.numel() == 0:
        raise ValueError("cu_num_draft must have num_reqs + 1 >= 1 entries, got an empty tensor")
    num_reqs = cu_num_draft.numel() - 1
    num_draft_total = draft_token_ids.numel()
    if num_logits != num_draft_total + num_reqs:
        raise ValueError(
            f"target_logits has {num_logits} rows, expected num_draft_total + num_reqs = "
            f"{num_draft_total} + {num_reqs} (one row per draft plus one bonus row per request)"
        )
    per_request = {"temperature": (temperature, float), "top_k": (top_k, int), "top_p": (top_p, float)}
    per_request |= {"seeds": (seeds, int), "positions": (positions, int), "coupled": (coupled, bool)}
    checked = [target_logits, draft_token_ids, cu_num_draft]
    for name, (t, kind) in per_request.items():
        if t is not None:
            _check(name, t, (num_reqs,), kind)
            checked.append(t)
    if isinstance(draft_probs, SparseDraftProbs):
        _check("draft_probs.ids", draft_probs.ids, (num_draft_total, None), int)
        _check("draft_probs.probs", draft_probs.probs, tuple(draft_probs.ids.shape), float)
        checked += [draft_probs.ids, draft_probs.probs]
    elif isinstance(draft_probs, torch.Tensor):
        _check("draft_probs", draft_probs, (num_draft_total, vocab_size), float)
        checked.append(draft_probs)
    elif draft_probs is not None:
        raise ValueError(f"draft_probs must be None, a tensor or SparseDraftProbs, got {type(draft_probs)}")
    devices = {t.device for t in checked}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if not cu_num_draft.is_cuda and num_reqs and int(cu_num_draft[-1]) != num_draft_total:
        raise ValueError(
            f"cu_num_draft[-1] = {int(cu_num_draft[-1])} but draft_token_ids has {num_draft_total} entries"
        )


def _check(name: str, t: torch.Tensor, shape: tuple[int | None, ...], kind: type) -> None:
    """``shape``: expected sizes, None = any; ``kind``: int, float, or bool (a bool or an integer tensor)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    is_int = not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)
    dims_ok = t.dim() == len(shape) and all(e is None or e == s for e, s in zip(shape, t.shape))
    kind_ok = {float: t.is_floating_point(), int: is_int, bool: is_int or t.dtype == torch.bool}[kind]
    if not dims_ok or not kind_ok:
        expected = ", ".join("*" if e is None else str(e) for e in shape)
        what = {float: "a float", int: "an integer", bool: "a bool or integer"}[kind]
        raise ValueError(f"{name} must be {what} tensor of shape [{expected}], got {t.dtype} {list(t.shape)}")
