"""The drafter's grammar masks (`DrafterRunner._mask_grammars`), step by step: every constrained row is masked at step
0; a row whose grammar allows few tokens is masked at every later step too, after the drafts before it, and one whose
grammar allows most of the vocabulary (`WIDE_MASK`) drafts its later steps unmasked, with no mask filled for them."""

import llguidance
import numpy as np
import torch
from transformers import AutoTokenizer

from specsplit.drafter.runner import WIDE_SAMPLE, DrafterRunner, ProposeItem, _widen

NARROW = llguidance.LLMatcher.grammar_from_regex("[a-m]+")
WIDE = llguidance.grammar_from("grammar", "start: /(?s:.)*/")  # any text


def spied_runner(mtp, tiny_dir) -> tuple[DrafterRunner, list[list[str]]]:
    """A runner whose masks record, per fill (one a step), the requests whose masks it filled."""
    runner = DrafterRunner(mtp, mtp.make_kv_cache(64, 4), tokenizer_dir=tiny_dir)
    masked: list[list[str]] = []
    draft_masks = runner._draft_masks

    def spied(items, active):
        masks = draft_masks(items, active)
        fill = masks.fill
        masks.fill = lambda jobs, out: masked.append([items[key].request_id for _, key, _ in jobs]) or fill(jobs, out)
        return masks

    runner._draft_masks = spied
    return runner, masked


def test_a_wide_row_is_masked_at_step_0_alone_and_a_narrow_one_at_every_step(mtp, tiny_dir):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    letters = set("abcdefghijklm")
    runner, masked = spied_runner(mtp, tiny_dir)
    k = 3
    items = [
        ProposeItem("narrow", 0, [5, 6, 7, 8], k, grammar=NARROW, output=[]),
        ProposeItem("wide", 0, [9, 10, 11], k, grammar=WIDE, output=[]),
        ProposeItem("free", 0, [12, 13], k),
    ]
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(sum(len(i.next_token_ids) for i in items), mtp.config.hidden_size, generator=g)
    out = runner.propose(items, rows)
    assert masked == [["narrow", "wide"], ["narrow"], ["narrow"]]
    assert all(len(d) == k for d in out.drafts)
    for draft in out.drafts[0]:  # every draft of the narrow row is one its grammar allows
        assert draft == tok.eos_token_id or set(tok.convert_ids_to_tokens(draft)) <= letters


def test_a_propose_whose_rows_are_all_wide_fills_masks_for_step_0_alone(mtp, tiny_dir):
    runner, masked = spied_runner(mtp, tiny_dir)
    items = [ProposeItem(f"r{i}", 0, [5 + i, 6, 7], 3, grammar=WIDE, output=[]) for i in range(3)]
    rows = torch.randn(9, mtp.config.hidden_size, generator=torch.Generator().manual_seed(1))
    assert [len(d) for d in runner.propose(items, rows).drafts] == [3, 3, 3]
    assert masked == [["r0", "r1", "r2"]]


def test_a_request_whose_output_the_runner_did_not_follow_is_drafted_unmasked_and_its_output_asked_for(mtp, tiny_dir):
    """A Propose that carries a constrained request's output from an offset its drafter did not follow (it restarted,
    or the request was another replica's) drafts it without its grammar and asks for the whole output
    (`outputs_wanted`), which the next Propose brings: masked again from there."""
    runner, masked = spied_runner(mtp, tiny_dir)
    rows = torch.randn(2, mtp.config.hidden_size, generator=torch.Generator().manual_seed(2))
    lost = ProposeItem("narrow", 5, [5, 6], 3, grammar=NARROW, output=[7], output_offset=4)
    out = runner.propose([lost], rows)
    assert out.outputs_wanted == [0] and len(out.drafts[0]) == 3
    assert masked == [["narrow"]]  # its step-0 row allows everything: wide, its later steps not masked
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    letter = tok.convert_tokens_to_ids("a")
    whole = ProposeItem("narrow", 6, [letter], 3, grammar=NARROW, output=[letter] * 5)
    out = runner.propose([whole], rows[:1])
    assert out.outputs_wanted == [] and masked[1:] == [["narrow"]] * 3
    assert all(
        set(tok.convert_ids_to_tokens(d)) <= set("abcdefghijklm") for d in out.drafts[0] if d != tok.eos_token_id
    )


def test_the_wide_check_counts_a_sample_of_a_large_vocabularys_mask_and_all_of_a_small_ones():
    """`_widen` judges a row by `WIDE_SAMPLE` evenly spaced 64-bit words of its mask: at a 151,936-id vocabulary a
    JSON integer's narrow mask (a few hundred ids in one run), a string's (all but a few ids) and random masks well
    off half the vocabulary are judged as their whole mask is; a 4,096-id mask is counted whole (one id more than
    half is wide, one fewer narrow)."""
    rng = np.random.default_rng(0)
    words = -(-151_936 // 32)
    masks = np.zeros((6, words), dtype=np.int32)
    bits = np.zeros((6, words * 32), dtype=bool)
    bits[0, 150:850] = True  # a JSON integer: digits
    bits[1, :151_936] = True
    bits[1, [0, 10, 220]] = False  # inside a string: all but a few
    bits[2] = rng.random(words * 32) < 0.3
    bits[3] = rng.random(words * 32) < 0.7
    bits[4, : words * 32 // 4] = True  # a quarter, in one run
    bits[5, words * 32 // 8 :] = True  # seven eighths, in one run
    masks[:] = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
    assert masks.view(np.uint64).shape[1] > 4 * WIDE_SAMPLE  # sampled here
    wide: set[int] = set()
    _widen(masks, list(range(6)), ["int", "string", "30%", "70%", "quarter", "7/8"], wide)
    assert wide == {"string", "70%", "7/8"}

    small = np.zeros((2, 128), dtype=np.int32)  # 4,096 ids: every word counted
    half = np.zeros((2, 4096), dtype=bool)
    half[0, :2049] = half[1, :2047] = True
    small[:] = np.packbits(half, axis=1, bitorder="little").view(np.int32)
    wide = set()
    _widen(small, [0, 1], ["over", "under"], wide)
    assert wide == {"over"}
