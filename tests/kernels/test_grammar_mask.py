"""The grammar-mask kernel (`specsplit/kernels/grammar_mask.py`, run by the Triton interpreter here) sets exactly what
the torch reference sets: -inf where a row's packed mask has a clear bit or no word, the logit elsewhere; rows not
named are left alone; float32 and bfloat16; a vocabulary that is no multiple of 32 or of the kernel's block."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specsplit.kernels.grammar_mask import BLOCK, apply_masks_reference, apply_masks_triton

V = BLOCK + 1000 + 7  # two programs per row, the second partly past the vocabulary; not a multiple of 32


def _packed(rows: list[int], words: np.ndarray) -> torch.Tensor:
    """[R, 1 + W] int32: each mask's logits row, then its words."""
    return torch.cat([torch.tensor(rows, dtype=torch.int32)[:, None], torch.from_numpy(words)], dim=1)


def _words(num_masks: int, num_words: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    words = rng.integers(-(2**31), 2**31, size=(num_masks, num_words), dtype=np.int64).astype(np.int32)
    words[0] = -1  # allows everything its words cover
    words[1, 3:] = 0  # allows only ids 0..95
    return words


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_words", [-(-V // 32), -(-V // 32) - 40])  # all ids covered, or the last 1,280+ not
def test_the_kernel_sets_what_the_reference_sets(dtype, num_words):
    logits = torch.randn(9, V, generator=torch.Generator().manual_seed(0)).to(dtype)
    rows = [7, 0, 3, 4]  # out of order; rows 1, 2, 5, 6 and 8 are not masked
    words = _words(len(rows), num_words, seed=1)
    got, want = logits.clone(), logits.clone()
    apply_masks_triton(got, _packed(rows, words))
    apply_masks_reference(want, _packed(rows, words))
    assert torch.equal(got, want)
    for row in (1, 2, 5, 6, 8):
        assert torch.equal(got[row], logits[row])
    allowed = np.unpackbits(words[0].view(np.uint8), bitorder="little").astype(bool)
    assert torch.isfinite(got[7, : len(allowed)]).all() == allowed.all()
    assert torch.isinf(got[7, len(allowed) :]).all()  # ids past the words are refused
    assert torch.isfinite(got[0, :96]).sum() == int(np.unpackbits(words[1, :3].view(np.uint8)).sum())
    assert torch.isinf(got[0, 96:]).all()


def test_a_logits_view_with_a_row_stride_and_no_masks():
    base = torch.randn(4, V + 64, generator=torch.Generator().manual_seed(2))
    logits = base[:, :V]  # rows V + 64 apart
    words = _words(2, -(-V // 32), seed=3)
    want, tail = logits.clone(), base[:, V:].clone()
    apply_masks_triton(logits, _packed([2, 1], words))
    apply_masks_reference(want, _packed([2, 1], words))
    assert torch.equal(logits, want)
    assert torch.equal(base[:, V:], tail)  # the columns between the view's rows are not written
    before = logits.clone()
    apply_masks_triton(logits, _packed([], words[:0]))
    assert torch.equal(logits, before)


def test_bad_inputs_are_refused():
    logits = torch.randn(4, 64)
    packed = _packed([0], np.full((1, 2), -1, dtype=np.int32))
    with pytest.raises(ValueError, match="unit stride"):
        apply_masks_triton(logits.t(), packed)
    with pytest.raises(ValueError, match="int32"):
        apply_masks_triton(logits, packed.long())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draft_vocabulary_columns_are_masked_by_their_ids(dtype):
    """A draft vocabulary's logits (column c scores id `column_ids[c]`, `specsplit/drafter/draft_vocab.py`): the
    kernel and the reference mask column c by bit column_ids[c] of the mask, and an id past the mask's words is
    refused; the same as the full vocabulary's logits masked, then gathered at those ids."""
    num_words = -(-V // 32) - 40  # the last 1,280+ ids have no word
    words = _words(3, num_words, seed=4)
    column_ids = torch.cat(
        [torch.randperm(V - 1, generator=torch.Generator().manual_seed(5))[: BLOCK + 99], torch.tensor([V - 1])]
    )
    full = torch.randn(5, V, generator=torch.Generator().manual_seed(6)).to(dtype)
    logits = full[:, column_ids].contiguous()
    rows = [4, 0, 2]
    got, want, masked_full = logits.clone(), logits.clone(), full.clone()
    apply_masks_triton(got, _packed(rows, words), column_ids)
    apply_masks_reference(want, _packed(rows, words), column_ids)
    apply_masks_reference(masked_full, _packed(rows, words))
    assert torch.equal(got, want)
    assert torch.equal(got, masked_full[:, column_ids])
    assert torch.isinf(got[4, -1])  # id V - 1: past the words
    assert torch.isfinite(got[1]).all() and torch.isfinite(got[3]).all()  # rows not named


def test_column_ids_of_the_wrong_shape_or_type_are_refused():
    logits = torch.zeros(2, 64)
    packed = _packed([0], _words(2, 2, seed=7)[:1])
    for bad in (torch.arange(63), torch.arange(64, dtype=torch.int32)):
        for apply in (apply_masks_triton, apply_masks_reference):
            with pytest.raises(ValueError, match="column ids"):
                apply(logits, packed, bad)
