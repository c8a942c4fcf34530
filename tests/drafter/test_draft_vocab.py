"""The draft vocabulary (`specsplit/drafter/draft_vocab.py`): its seed order (the checkpoint tokenizer's merge ranks, a
file the user passes), its head (the full head's rows at its ids, written in place), the drafts it gives (target ids
of its set; the full vocabulary's drafts where the set holds them), the swap to the most counted ids, sampled drafts
whose q lives on the set (chi-square), and the mistakes refused."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specsplit.client.errors import UsageError
from specsplit.drafter.draft_vocab import DraftVocabulary, checkpoint_order, draft_vocabulary, file_ids, seed_order
from specsplit.drafter.runner import DrafterRunner, ProposeItem
from specsplit.drafter.sampling import pick_drafts
from specsplit.drafter.server import resolve_draft_vocab_size
from specsplit.models.loader import load_mtp, load_target
from tests.fixtures.tiny import write_tiny_checkpoint

DEMO = pathlib.Path(__file__).resolve().parents[2] / "checkpoints" / "demo"
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("dv") / "m", architecture="qwen2", seed=7)


@pytest.fixture(scope="module")
def hidden(checkpoint):
    target = load_target(checkpoint)
    cache = target.make_kv_cache(32, 4)
    with torch.inference_mode():
        return target(torch.tensor(PROMPT), torch.arange(len(PROMPT)), cache, cache.prepare_step(["t"], [len(PROMPT)]))


def drafts_of(mtp, hidden, vocab: DraftVocabulary | None, k: int = 4) -> list[int]:
    runner = DrafterRunner(mtp, mtp.make_kv_cache(32, 4), draft_vocab=vocab)
    return runner.propose([ProposeItem("r", 0, PROMPT[1:], k)], hidden[:-1]).drafts[0]


def test_the_demo_checkpoints_order_is_its_tokenizers_merge_ranks():
    spec = json.loads((DEMO / "tokenizer.json").read_text())
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    order = checkpoint_order(4096, DEMO)
    assert sorted(order.tolist()) == list(range(4096))
    added = [t["id"] for t in spec["added_tokens"]]
    assert order[: len(added)].tolist() == added
    merged = [vocab["".join(m.split(" ", 1) if isinstance(m, str) else m)] for m in merges]
    place = {int(t): i for i, t in enumerate(order)}
    assert [place[t] for t in merged[:200]] == sorted(place[t] for t in merged[:200])  # by merge rank
    alphabet = set(vocab.values()) - set(merged) - set(added)
    assert max(place[t] for t in alphabet) < min(place[t] for t in merged)  # the alphabet before any merge
    assert checkpoint_order(10, None).tolist() == list(range(10))  # no tokenizer: ids ascending
    padded = checkpoint_order(4100, DEMO)  # a vocabulary padded past the tokenizer's: those ids last
    assert padded[-4:].tolist() == [4096, 4097, 4098, 4099]


def test_a_files_ids_come_first_in_its_order(tmp_path):
    listed = tmp_path / "ids.txt"
    listed.write_text("7 3\n7\n100\n")
    order = seed_order(4096, DEMO, listed)
    assert order[:3].tolist() == [7, 3, 100]
    assert sorted(order.tolist()) == list(range(4096))
    rest = [t for t in checkpoint_order(4096, DEMO).tolist() if t not in (7, 3, 100)]
    assert order[3:].tolist() == rest
    as_json = tmp_path / "ids.json"
    as_json.write_text("[5, 2, 5]")
    assert file_ids(as_json, 10).tolist() == [5, 2]


@pytest.mark.parametrize(
    ("text", "message"),
    [("", "lists no id"), ("1 two 3", "not token ids"), ("1 4096", "4096 is not an id"), ("[-1]", "-1 is not an id")],
)
def test_a_bad_file_is_refused_naming_it(tmp_path, text, message):
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(UsageError, match=message) as e:
        file_ids(path, 4096)
    assert str(path) in str(e.value)
    with pytest.raises(UsageError, match="No such file"):
        file_ids(tmp_path / "missing.txt", 4096)


def test_sizes_that_mean_the_full_vocabulary_and_sizes_refused(checkpoint, tmp_path):
    mtp = load_mtp(checkpoint)
    assert draft_vocabulary(mtp, 0, checkpoint) is None
    assert draft_vocabulary(mtp, 320, checkpoint) is None and mtp.draft_head is None
    with pytest.raises(UsageError, match="0 \\(the full vocabulary\\) or more"):
        draft_vocabulary(mtp, -1, checkpoint)
    (tmp_path / "ids.txt").write_text("1 2")
    with pytest.raises(UsageError, match="--draft-vocab-file needs"):
        draft_vocabulary(mtp, 0, checkpoint, tmp_path / "ids.txt")
    # A tensor-parallel drafter keeps the full vocabulary by default and refuses one asked for.
    assert resolve_draft_vocab_size(None, 2) == 0 and resolve_draft_vocab_size(64, 1) == 64
    with pytest.raises(UsageError, match="--tensor-parallel-size 1"):
        resolve_draft_vocab_size(64, 2)


def test_the_heads_logits_are_the_full_heads_at_its_ids(checkpoint):
    mtp = load_mtp(checkpoint)
    vocab = draft_vocabulary(mtp, 40, checkpoint)
    ids = vocab.ids
    assert ids.tolist() == sorted(checkpoint_order(320, checkpoint)[:40].tolist())
    hidden = torch.randn(3, mtp.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        draft = mtp.compute_logits(hidden)
        mtp.draft_head = None
        full = mtp.compute_logits(hidden)
    assert draft.shape == (3, 40) and draft.dtype == torch.float32
    torch.testing.assert_close(draft, full[:, ids], rtol=1e-5, atol=1e-5)


def test_drafts_are_the_full_vocabularys_where_the_set_holds_them_and_ids_of_the_set(checkpoint, hidden):
    mtp = load_mtp(checkpoint)
    full = drafts_of(mtp, hidden, None)
    # A set holding every full draft drafts the same; its drafts are target ids, not columns.
    order = np.concatenate([np.asarray(full), [t for t in range(320) if t not in full]])
    holding = DraftVocabulary(mtp, 64, order)
    assert drafts_of(mtp, hidden, holding) == full
    # A set without the first full draft drafts another id, one of the set.
    without = np.asarray([t for t in range(320) if t != full[0]] + [full[0]])
    lacking = DraftVocabulary(mtp, 64, without)
    got = drafts_of(mtp, hidden, lacking)
    assert got[0] != full[0] and set(got) <= set(lacking.ids.tolist())


def test_a_swap_installs_the_most_counted_ids_in_place(checkpoint, hidden):
    mtp = load_mtp(checkpoint)
    vocab = draft_vocabulary(mtp, 32, checkpoint)
    head, ids = mtp.draft_head.weight, vocab.ids
    pointers = head.data_ptr(), ids.data_ptr()
    assert not vocab.swap(wait=True)  # no ranking yet
    favourites = list(range(288, 320))  # the seed order's last ids
    vocab.observe(favourites * 3 + [999, -1])  # ids past the vocabulary are not counted
    assert vocab.counted == 96 and vocab.covered == 0
    assert vocab.swap(wait=True) and vocab.swaps == 1
    assert ids.tolist() == favourites
    assert (head.data_ptr(), ids.data_ptr()) == pointers  # what captured CUDA graphs read
    torch.testing.assert_close(head, mtp.shared_head.head.weight[favourites])
    assert set(drafts_of(mtp, hidden, vocab)) <= set(favourites)
    # Fewer counted ids than the set's size: the rest by the seed order; an unchanged set is not installed again.
    vocab.observe([5] * 40)
    assert vocab.swap(wait=True)
    assert ids.tolist() == sorted([5, *favourites[:31]])
    vocab.observe([5] * 40)
    assert not vocab.swap(wait=True) and vocab.swaps == 2


def test_the_runner_counts_what_it_is_given_and_swaps_between_proposes(checkpoint, hidden):
    mtp = load_mtp(checkpoint)
    vocab = draft_vocabulary(mtp, 8, checkpoint)
    runner = DrafterRunner(mtp, mtp.make_kv_cache(32, 4), draft_vocab=vocab)
    runner.propose([ProposeItem("r", 0, PROMPT[1:], 2)], hidden[:-1])  # 8 tokens: a ranking starts
    assert vocab.counted == 8 and vocab._ranking is not None
    vocab._ranking.result()
    runner.propose([ProposeItem("s", 0, PROMPT[1:3], 2)], hidden[:2])  # installs it first
    assert vocab.swaps == 1 and vocab.ids.tolist() == sorted(PROMPT[1:])


def test_sampled_drafts_follow_q_over_the_set():
    """q is softmax(logits / T) over the set's columns (top-K covering them all): draws over many noise counters
    follow it (chi-square), and each draft and q's support are the set's ids."""
    n, columns = 4000, 12
    column_ids = torch.tensor([3, 40, 41, 77, 120, 200, 201, 333, 512, 700, 701, 999])
    logits = torch.randn(columns, generator=torch.Generator().manual_seed(1)).repeat(n, 1)
    temperature = torch.full((n,), 0.7)
    step = pick_drafts(
        logits,
        temperature,
        torch.full((n,), 1234, dtype=torch.int64),
        torch.arange(n, dtype=torch.int64),
        16,
        column_ids=column_ids,
        vocab_size=1000,
    )
    assert set(step.tokens.tolist()) <= set(column_ids.tolist())
    assert torch.equal(step.q_ids.sort(dim=1).values, column_ids.repeat(n, 1))
    q = torch.softmax(logits[0].double() / 0.7, dim=0).numpy()
    counts = torch.bincount(torch.searchsorted(column_ids, step.tokens), minlength=columns).numpy()
    assert chisquare(counts, q / q.sum() * n).pvalue > 1e-3
