"""Structured output's grammar masks applied to a step's logits in one launch.

A mask is llguidance's packed bitmask of a row: int32 words, bit i of word w allowing token 32 w + i
(`specsplit/runtime/grammar.py`). Every token a row's mask does not allow, and every id past its words, gets -inf in
that row of the logits; allowed tokens keep their logit. The torch ops that did this unpacked the masks into a
[rows, V] boolean tensor and copied the rows out and back (about ten launches and several passes over the rows);
the kernel reads each packed word once and writes -inf where a bit is clear, nothing else (docs/performance.md,
"Structured output", has the times).

The masks come as they are, 32 ids per word, each behind its logits row: `packed`, [R, 1 + W] int32 (the host puts
them in one pinned buffer copied without a wait, `specsplit/runtime/grammar.py`'s `upload_masks`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BITS = 32
BLOCK = 4096  # ids per program


@triton.jit
def _apply_masks_kernel(
    logits_ptr,
    stride_logits,
    packed_ptr,  # [R, 1 + W] int32: the logits row, then the mask's words
    stride_packed,
    vocab,
    num_words,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    ids = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = ids < vocab
    word_index = ids // 32
    words = tl.load(packed_ptr + r * stride_packed + 1 + word_index, mask=in_vocab & (word_index < num_words), other=0)
    allowed = (words >> (ids % 32)) & 1
    row = tl.load(packed_ptr + r * stride_packed).to(tl.int64)
    minus_inf = tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_logits + ids, minus_inf, mask=in_vocab & (allowed == 0))


def apply_masks_triton(logits: torch.Tensor, packed: torch.Tensor) -> None:
    """-inf in `logits` ([N, V], unit stride along V) wherever the masks of `packed` ([R, 1 + W] int32 on the same
    device: each mask's logits row, then its words) do not allow a token of their rows."""
    if logits.stride(1) != 1:
        raise ValueError(f"logits need unit stride along the vocabulary, got strides {tuple(logits.stride())}")
    if packed.dtype != torch.int32 or packed.dim() != 2 or packed.device != logits.device:
        raise ValueError(f"packed masks must be [R, 1 + W] int32 on {logits.device}, got {packed.dtype} {packed.shape}")
    num_masks, vocab = packed.shape[0], logits.shape[1]
    if num_masks == 0 or vocab == 0:
        return
    grid = (num_masks, triton.cdiv(vocab, BLOCK))
    _apply_masks_kernel[grid](
        logits, logits.stride(0), packed, packed.stride(0), vocab, packed.shape[1] - 1, BLOCK=BLOCK
    )


def apply_masks_reference(logits: torch.Tensor, packed: torch.Tensor) -> None:
    """The same with torch ops (CPU runs): the masks unpacked on the logits' device and applied row by row."""
    vocab = logits.shape[1]
    rows, words = packed[:, 0].long(), packed[:, 1:]
    bits = (words[:, :, None] >> torch.arange(BITS, dtype=torch.int32, device=packed.device)) & 1  # [R, W, 32]
    allowed = bits.reshape(len(rows), -1).bool()
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill(~allowed[:, :vocab], float("-inf")))
