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
    column_ids_ptr,  # [C] int64: each column's token id (HAS_IDS), else the column is the id
    num_columns,
    num_words,
    BLOCK: tl.constexpr,
    HAS_IDS: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = columns < num_columns
    if HAS_IDS:
        ids = tl.load(column_ids_ptr + columns, mask=in_row, other=0).to(tl.int32)
    else:
        ids = columns
    word_index = ids // 32
    words = tl.load(packed_ptr + r * stride_packed + 1 + word_index, mask=in_row & (word_index < num_words), other=0)
    allowed = (words >> (ids % 32)) & 1
    row = tl.load(packed_ptr + r * stride_packed).to(tl.int64)
    minus_inf = tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_logits + columns, minus_inf, mask=in_row & (allowed == 0))


def apply_masks_triton(logits: torch.Tensor, packed: torch.Tensor, column_ids: torch.Tensor | None = None) -> None:
    """-inf in `logits` ([N, C], unit stride along C) wherever the masks of `packed` ([R, 1 + W] int32 on the same
    device: each mask's logits row, then its words) do not allow a token of their rows. Column c is token c, or
    `column_ids[c]` ([C] int64: a draft vocabulary's ids, `specsplit/drafter/draft_vocab.py`)."""
    if logits.stride(1) != 1:
        raise ValueError(f"logits need unit stride along the vocabulary, got strides {tuple(logits.stride())}")
    if packed.dtype != torch.int32 or packed.dim() != 2 or packed.device != logits.device:
        raise ValueError(f"packed masks must be [R, 1 + W] int32 on {logits.device}, got {packed.dtype} {packed.shape}")
    _check_column_ids(logits, column_ids)
    num_masks, columns = packed.shape[0], logits.shape[1]
    if num_masks == 0 or columns == 0:
        return
    grid = (num_masks, triton.cdiv(columns, BLOCK))
    _apply_masks_kernel[grid](
        logits,
        logits.stride(0),
        packed,
        packed.stride(0),
        packed if column_ids is None else column_ids,  # an unread pointer without ids
        columns,
        packed.shape[1] - 1,
        BLOCK=BLOCK,
        HAS_IDS=column_ids is not None,
    )


def apply_masks_reference(logits: torch.Tensor, packed: torch.Tensor, column_ids: torch.Tensor | None = None) -> None:
    """The same with torch ops (CPU runs): the masks unpacked on the logits' device and applied row by row."""
    _check_column_ids(logits, column_ids)
    columns = logits.shape[1]
    rows, words = packed[:, 0].long(), packed[:, 1:]
    bits = (words[:, :, None] >> torch.arange(BITS, dtype=torch.int32, device=packed.device)) & 1  # [R, W, 32]
    allowed = bits.reshape(len(rows), -1).bool()
    ids = torch.arange(columns, device=logits.device) if column_ids is None else column_ids
    width = int(ids.max()) + 1 if columns else 0
    if allowed.shape[1] < width:
        allowed = torch.nn.functional.pad(allowed, (0, width - allowed.shape[1]))
    allowed = allowed[:, ids]  # [R, C]
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill(~allowed, float("-inf")))


def _check_column_ids(logits: torch.Tensor, column_ids: torch.Tensor | None) -> None:
    if column_ids is not None and (
        column_ids.dtype != torch.int64 or column_ids.shape != (logits.shape[1],) or column_ids.device != logits.device
    ):
        raise ValueError(
            f"column ids must be [{logits.shape[1]}] int64 on {logits.device}, got {column_ids.dtype} "
            f"{tuple(column_ids.shape)} on {column_ids.device}"
        )
