"""On a CUDA GPU, the drafter's later steps captured as one graph (`specsplit/drafter/later_steps.py`) give the drafts
of the step-by-step graphs, iteration after iteration: batches of 1, 3 (a padded bucket) and 32 requests at k 3 (graphs
captured with the runner) and 3 requests at k 5 (captured on first use), on the host path and on the device hand-off,
with the full vocabulary and with a draft vocabulary swapped under the graph.

    SPECSPLIT_GPU_TESTS=1 python -m pytest -m gpu tests/gpu
"""

from __future__ import annotations

import llguidance
import pytest
import torch

from specsplit.drafter.draft_vocab import draft_vocabulary
from specsplit.drafter.runner import DrafterRunner, ProposeItem
from specsplit.models.loader import load_mtp
from specsplit.runtime.grammar import Grammars
from specsplit.transport.base import DeviceTokens
from tests.fixtures.tiny import write_tiny_checkpoint

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ls") / "m", architecture="qwen2", seed=3)


def runners(checkpoint, vocab_size: int | None):
    """(with the later steps' graph, without it, the S of each of the first's later-steps graph runs): each runner its
    own module, cache and step graphs."""
    made = []
    for chained in (True, False):
        mtp = load_mtp(checkpoint, device=torch.device("cuda"))
        vocab = None if vocab_size is None else draft_vocabulary(mtp, vocab_size, checkpoint)
        runner = DrafterRunner(mtp, mtp.make_kv_cache(256, 16), max_graph_tokens=128, draft_vocab=vocab)
        assert runner.graphs is not None and runner.later_steps is not None
        if not chained:
            runner.later_steps = None
        made.append(runner)
    runs, start = [], made[0].later_steps.start
    made[0].later_steps.start = lambda *args, **kw: runs.append(args[9]) or start(*args, **kw)  # S
    return *made, runs


@pytest.mark.parametrize("batch, k", [(1, 3), (3, 3), (32, 3), (3, 5)])  # k 5: its graphs captured on first use
@pytest.mark.parametrize("hand_off", [False, True], ids=["host", "hand-off"])
@pytest.mark.parametrize("vocab_size", [None, 48], ids=["full", "draft-vocab"])
def test_later_steps_graph_drafts_as_the_step_graphs(checkpoint, batch, k, hand_off, vocab_size):
    chained, stepwise, runs = runners(checkpoint, vocab_size)
    g = torch.Generator().manual_seed(batch)
    dev = torch.device("cuda")
    hidden_size, vocab = chained.mtp.config.hidden_size, chained.mtp.config.vocab_size
    ids = [f"r{i}" for i in range(batch)]
    prompts = {r: torch.randint(3, vocab, (6 + i % 5,), generator=g).tolist() for i, r in enumerate(ids)}
    items = [ProposeItem(r, 0, prompts[r][1:], k) for r in ids]
    rows = torch.randn(sum(len(i.next_token_ids) for i in items), hidden_size, generator=g).to(dev)
    assert chained.propose(items, rows).drafts == stepwise.propose(items, rows).drafts
    start = {r: len(prompts[r]) - 1 for r in ids}
    for it in range(6):
        if it == 3 and vocab_size is not None:  # a new set of ids under the captured graph
            for runner in (chained, stepwise):
                before = runner.draft_vocab.ids.clone()
                runner.draft_vocab.observe(list(range(200, 248)) * 2)
                runner.draft_vocab.swap(wait=True)
                assert not torch.equal(runner.draft_vocab.ids, before)
        num_sampled = [1 + (it + j) % (k + 1) for j in range(batch)]
        tokens = torch.full((batch, k + 1), -1, dtype=torch.int64)
        for r, n in enumerate(num_sampled):
            tokens[r, :n] = torch.randint(3, vocab, (n,), generator=g)
        hidden = torch.randn(batch * (k + 1), hidden_size, generator=g).to(dev)
        if hand_off:  # both runners on the device path
            tokens_dev, sampled_dev = tokens.to(dev), torch.tensor(num_sampled, device=dev)
            got, expected = (
                runner.propose(
                    [ProposeItem(r, start[r], [], k, num_rows=k + 1) for r in ids],
                    hidden,
                    DeviceTokens(tokens_dev, sampled_dev),
                )
                for runner in (chained, stepwise)
            )
        else:
            host_items = [
                ProposeItem(r, start[r], tokens[i, :n].tolist(), k) for i, (r, n) in enumerate(zip(ids, num_sampled))
            ]
            valid = torch.cat([hidden[i * (k + 1) : i * (k + 1) + n] for i, n in enumerate(num_sampled)])
            got, expected = (runner.propose(host_items, valid) for runner in (chained, stepwise))
        assert got.drafts == expected.drafts, f"iteration {it}"
        assert all(len(d) == k for d in got.drafts)
        if vocab_size is not None:  # the set in place (after the swap: the counts of every request's tokens too)
            assert all(set(d) <= set(chained.draft_vocab.ids.tolist()) for d in got.drafts)
        for r, n in zip(ids, num_sampled):
            start[r] += n
    assert runs == [k - 1] * 7  # every propose's later steps ran as one graph


@pytest.mark.parametrize("k", [3, 5])
@pytest.mark.parametrize("vocab_size", [None, 48], ids=["full", "draft-vocab"])
def test_sampled_later_steps_graph_drafts_and_q_as_the_step_graphs(checkpoint, k, vocab_size):
    """A greedy, a sampled and a coupled request: the same drafts and q rows, iteration after iteration."""
    chained, stepwise, runs = runners(checkpoint, vocab_size)
    g = torch.Generator().manual_seed(k)
    dev = torch.device("cuda")
    hidden_size, vocab = chained.mtp.config.hidden_size, chained.mtp.config.vocab_size
    sampling = {"g": {}, "s": {"temperature": 0.8, "seed": 3}, "c": {"temperature": 1.2, "seed": 9, "coupled": True}}
    start = dict.fromkeys(sampling, 0)
    counts = dict.fromkeys(sampling, 7)
    for it in range(5):
        items = [
            ProposeItem(r, start[r], torch.randint(3, vocab, (counts[r],), generator=g).tolist(), k, **options)
            for r, options in sampling.items()
        ]
        rows = torch.randn(sum(counts.values()), hidden_size, generator=g).to(dev)
        got, expected = (runner.propose(items, rows) for runner in (chained, stepwise))
        assert got.drafts == expected.drafts, f"iteration {it}"
        assert got.draft_probs[0] is None
        for a, b in zip(got.draft_probs[1:], expected.draft_probs[1:]):
            assert torch.equal(a[0], b[0]) and a[0].shape[0] == k
            torch.testing.assert_close(a[1], b[1], atol=1e-6, rtol=1e-5)
        for j, r in enumerate(sampling):
            start[r] += counts[r]
            counts[r] = 1 + (it + j) % (k + 1)
    assert runs == [k - 1] * 5


@pytest.mark.parametrize("narrow", [False, True], ids=["all-wide", "one-narrow"])
@pytest.mark.parametrize("batch", [4, 32])
def test_a_constrained_propose_runs_the_later_steps_graphs_and_drafts_as_the_step_graphs(checkpoint, narrow, batch):
    """A constrained propose replays the later steps' graphs: as one graph where no row needs a later mask (every
    row's grammar allows most tokens, `DrafterRunner._mask_grammars`), else a graph per part with the masks filled
    between (`_masked_later_steps`), a greedy and a sampled narrow row among them. The drafts (and q rows) equal the
    step-by-step runner's, iteration after iteration, and every narrow row's drafts are ones its grammar allows."""
    wide = llguidance.grammar_from("grammar", "start: /(?s:.)*/")
    narrow_grammar = llguidance.LLMatcher.grammar_from_regex("[a-m]+")
    chained, stepwise, runs = runners(checkpoint, None)
    for runner in (chained, stepwise):
        runner.grammars = Grammars(checkpoint)
    tok = chained.grammars.tokenizer
    g = torch.Generator().manual_seed(7)
    vocab, hidden_size = chained.mtp.config.vocab_size, chained.mtp.config.hidden_size
    grammars = [wide] * batch
    sampled = {}
    if narrow:
        grammars[1] = grammars[batch - 1] = narrow_grammar
        sampled = {batch - 1: {"temperature": 0.8, "seed": 4}}
    start = [0] * batch
    for it in range(3):
        items = [
            ProposeItem(
                f"r{i}",
                start[i],
                torch.randint(3, vocab, (5,), generator=g).tolist(),
                3,
                grammar=gr,
                output=[],
                **sampled.get(i, {}),
            )
            for i, gr in enumerate(grammars)
        ]
        rows = torch.randn(5 * batch, hidden_size, generator=g).to("cuda")
        got, expected = chained.propose(items, rows), stepwise.propose(items, rows)
        assert got.drafts == expected.drafts, f"iteration {it}"
        for a, b in zip(got.draft_probs, expected.draft_probs):
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a[0], b[0])
                torch.testing.assert_close(a[1], b[1], atol=1e-6, rtol=1e-5)
        for i in [1, batch - 1] if narrow else []:
            text = tok.decode_bytes(got.drafts[i]).decode("utf-8", "replace")
            assert set(text) <= set("abcdefghijklm"), text
        start = [s + 5 for s in start]
    assert runs == [2] * 3
