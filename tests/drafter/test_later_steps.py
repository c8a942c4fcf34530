"""The later steps of an unconstrained propose as one graph (`specsplit/drafter/later_steps.py`), run eagerly on the CPU
(`capture=False`: the same static-buffer code the CUDA graph records): the drafts and the MTP cache equal the
step-by-step path's, iteration after iteration, with requests wanting different numbers of drafts, a cache that caps
them, a draft vocabulary, the device hand-off and sampled drafts (their q rows too)."""

import gc
import weakref

import llguidance
import pytest
import torch
from transformers import AutoTokenizer

from specsplit.drafter.draft_vocab import draft_vocabulary
from specsplit.drafter.later_steps import LaterStepsGraphs
from specsplit.drafter.runner import DrafterRunner, ProposeItem
from specsplit.models.loader import load_mtp
from specsplit.runtime.cuda_graphs import CudaGraphRunner
from specsplit.runtime.grammar import Grammars
from specsplit.transport.base import DeviceTokens
from tests.fixtures.tiny_deepseek_v3 import write_tiny_deepseek_checkpoint

PADDING = -1


def runner_for(mtp, chained: bool, num_blocks: int = 64, draft_vocab=None) -> DrafterRunner:
    """The graph runner's static-buffer path (eager), with or without the later steps' graph."""
    cache = mtp.make_kv_cache(num_blocks, 4)
    runner = DrafterRunner(mtp, cache, attention_kernel=True, cuda_graphs=False, draft_vocab=draft_vocab)
    runner.graphs = CudaGraphRunner(mtp, cache, max_model_len=128, max_num_tokens=8, capture=False)
    if chained:
        runner.later_steps = LaterStepsGraphs(mtp, cache, runner.graphs, runner._column_ids, runner.draft_top_k)
    return runner


def counting(runner: DrafterRunner) -> list[int]:
    """Counts the later steps' graph runs of `runner`, one entry per run: its S."""
    runs, start = [], runner.later_steps.start

    def counted(*args, **kwargs):
        runs.append(args[9])
        return start(*args, **kwargs)

    runner.later_steps.start = counted
    return runs


def cache_tensors(runner):
    cache = runner.kv_cache
    return [getattr(cache, n) for n in (("latent",) if hasattr(cache, "latent") else ("k", "v"))]


def decode(mtp, runners, ks: dict[str, int], iterations: int = 4, seed: int = 0):
    """Feeds every runner the same prompt, then decode iterations accepting a varying number of drafts; returns each
    runner's drafts per iteration."""
    g = torch.Generator().manual_seed(seed)
    hidden_size, vocab = mtp.config.hidden_size, mtp.config.vocab_size
    prompts = {r: torch.randint(3, vocab, (5 + i,), generator=g).tolist() for i, r in enumerate(ks)}
    items = [ProposeItem(r, 0, prompts[r][1:], k) for r, k in ks.items()]
    rows = torch.randn(sum(len(i.next_token_ids) for i in items), hidden_size, generator=g)
    got = [[r.propose(items, rows).drafts] for r in runners]
    start = {r: len(prompts[r]) - 1 for r in ks}
    for it in range(iterations):
        counts = {r: 1 + (it + j) % (k + 1) for j, (r, k) in enumerate(ks.items())}
        items = [
            ProposeItem(r, start[r], torch.randint(3, vocab, (counts[r],), generator=g).tolist(), k)
            for r, k in ks.items()
        ]
        rows = torch.randn(sum(counts.values()), hidden_size, generator=g)
        for r, out in zip(runners, got):
            out.append(r.propose(items, rows).drafts)
        for r in ks:
            start[r] += counts[r]
    return got


@pytest.mark.parametrize(
    "ks", [{"a": 3}, {"a": 3, "b": 2, "c": 0, "d": 1}, {"a": 4, "b": 4, "c": 4}], ids=["one", "ragged", "three"]
)
def test_one_graph_drafts_as_the_steps_one_by_one(mtp, ks):
    chained, stepwise = runner_for(mtp, True), runner_for(mtp, False)
    runs = counting(chained)
    got, expected = decode(mtp, [chained, stepwise], ks)
    assert got == expected
    for drafts in got:  # each request got the drafts it asked for
        assert [len(d) for d in drafts] == list(ks.values())
    assert runs and all(s == max(ks.values()) - 1 for s in runs)  # every propose took the graph, S its most steps
    for a, b in zip(cache_tensors(chained), cache_tensors(stepwise)):  # rows past their steps wrote nothing
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)  # rows batched otherwise


def test_deepseek_mla_later_steps_in_one_graph(tmp_path):
    mla = load_mtp(write_tiny_deepseek_checkpoint(tmp_path / "dsv3", seed=5))
    chained, stepwise = runner_for(mla, True), runner_for(mla, False)
    got, expected = decode(mla, [chained, stepwise], {"a": 3, "b": 1}, iterations=3)
    assert got == expected


def test_a_cache_that_caps_the_drafts_gives_the_same_prefix(mtp):
    """8 slots: 7 pairs and 1 later step of the 5 asked for; the graph's steps past the cap write nothing."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(7, mtp.config.hidden_size, generator=g)
    item = ProposeItem("r", 0, list(range(20, 27)), 6)
    roomy = runner_for(mtp, True).propose([item], hidden).drafts[0]
    tight, tight_stepwise = runner_for(mtp, True, num_blocks=2), runner_for(mtp, False, num_blocks=2)
    got = tight.propose([item], hidden).drafts[0]
    assert got == tight_stepwise.propose([item], hidden).drafts[0] == roomy[: len(got)]
    assert len(got) == 2


def test_a_draft_vocabulary_maps_the_graphs_drafts_to_its_ids(tiny_dir):
    runners = []
    for chained in (True, False):  # each runner its own module: the draft vocabulary attaches its head to it
        module = load_mtp(tiny_dir)
        runners.append(runner_for(module, chained, draft_vocab=draft_vocabulary(module, 40, tiny_dir)))
    got, expected = decode(module, runners, {"a": 3, "b": 2}, iterations=2)
    assert got == expected
    ids = set(runners[0].draft_vocab.ids.tolist())
    assert all(set(d) <= ids for iteration in got for d in iteration)


def test_device_hand_off_through_the_graph_equals_the_host_path(mtp):
    """Rejected rows hold padding; the graph's steps move back by num_sampled on the device."""
    g = torch.Generator().manual_seed(1)
    ks = {"a": 3, "b": 2}
    hidden_size, vocab = mtp.config.hidden_size, mtp.config.vocab_size
    device, host = runner_for(mtp, True), runner_for(mtp, False)
    runs = counting(device)
    prompt = {"a": [5, 6, 7, 8, 9, 10], "b": [11, 12, 13, 14]}
    items = [ProposeItem(r, 0, prompt[r][1:], k) for r, k in ks.items()]
    rows = torch.randn(sum(len(i.next_token_ids) for i in items), hidden_size, generator=g)
    assert device.propose(items, rows).drafts == host.propose(items, rows).drafts
    start = {r: len(prompt[r]) - 1 for r in ks}
    for accepted in [(0, 0), (3, 2), (1, 2), (2, 1), (3, 0)]:
        num_sampled = [min(a, k) + 1 for a, k in zip(accepted, ks.values())]
        tokens = torch.full((len(ks), max(ks.values()) + 1), PADDING, dtype=torch.int64)
        for r, n in enumerate(num_sampled):
            tokens[r, :n] = torch.randint(3, vocab, (n,), generator=g)
        hidden = {r: torch.randn(k + 1, hidden_size, generator=g) for r, k in ks.items()}
        dev_items = [ProposeItem(r, start[r], [], k, num_rows=k + 1) for r, k in ks.items()]
        got = device.propose(
            dev_items, torch.cat([hidden[r] for r in ks]), DeviceTokens(tokens, torch.tensor(num_sampled))
        )
        host_items = [
            ProposeItem(r, start[r], tokens[i, :n].tolist(), ks[r]) for i, (r, n) in enumerate(zip(ks, num_sampled))
        ]
        expected = host.propose(host_items, torch.cat([hidden[r][:n] for r, n in zip(ks, num_sampled)]))
        assert got.drafts == expected.drafts
        for r, n in zip(ks, num_sampled):
            start[r] += n
    assert len(runs) == 6


def test_sampled_drafts_through_the_graph_equal_the_steps_one_by_one(tiny_dir):
    """Sampled requests (their own noise, and coupled) beside a greedy one, k 4, 3 and 2: the same drafts and the same
    q rows, with the full vocabulary and a draft vocabulary's ids; a k 1 propose has no later step to run."""
    for size in (None, 40):
        runners = []
        for chained in (True, False):
            module = load_mtp(tiny_dir)
            vocab = None if size is None else draft_vocabulary(module, size, tiny_dir)
            runners.append(runner_for(module, chained, draft_vocab=vocab))
        runs = counting(runners[0])
        hidden = torch.randn(9, module.config.hidden_size, generator=torch.Generator().manual_seed(2))
        items = [
            ProposeItem("g", 0, [20, 21, 22], 4),
            ProposeItem("s", 0, [30, 31, 32], 3, temperature=0.7, seed=1),
            ProposeItem("c", 0, [40, 41, 42], 2, temperature=1.3, seed=5, coupled=True),
        ]
        got, expected = (r.propose(items, hidden) for r in runners)
        assert got.drafts == expected.drafts and [len(d) for d in got.drafts] == [4, 3, 2]
        assert got.draft_probs[0] is None and expected.draft_probs[0] is None
        for a, b in zip(got.draft_probs[1:], expected.draft_probs[1:]):
            torch.testing.assert_close(a[1], b[1], atol=1e-6, rtol=1e-5)
            assert torch.equal(a[0], b[0])
        assert [d.shape[0] for d, _ in got.draft_probs[1:]] == [3, 2]
        assert runs == [3]
        runners[0].propose([ProposeItem("k1", 0, [50, 51], 1, temperature=0.5, seed=2)], hidden[:2])
        assert runs == [3]


def test_a_dropped_runner_is_freed_at_once(mtp):
    """Nothing refers back from the later steps' graphs to their runner: a runner dropped (the memory probe's, at a
    drafter's start) is freed by reference counting, not by a cyclic collection that could come mid-capture."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        runner = runner_for(mtp, True)
        freed = weakref.ref(runner), weakref.ref(runner.later_steps)
        del runner
        assert [ref() for ref in freed] == [None, None]
    finally:
        if enabled:
            gc.enable()


def test_a_constrained_propose_through_the_graphs_parts_drafts_as_the_steps_one_by_one(tiny_dir):
    """Constrained requests (a narrow grammar greedy and sampled, a grammar allowing any text, one refusing the output
    it is given) beside unconstrained ones, k 4, 3, 3, 2 and 3: the later steps' parts with each step's masks filled
    between them (`DrafterRunner._masked_later_steps`) draft as the step-by-step path, q rows too, iteration after
    iteration, and the narrow rows' drafts are ones their grammar allows; the matchers are left at the outputs."""
    narrow = llguidance.LLMatcher.grammar_from_regex("[a-m]+")
    wide = llguidance.grammar_from("grammar", "start: /(?s:.)*/")
    module = load_mtp(tiny_dir)
    runners = [runner_for(module, chained) for chained in (True, False)]
    for runner in runners:
        runner.grammars = Grammars(tiny_dir)
    runs = counting(runners[0])
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    letters = set("abcdefghijklm")
    refused = tok.encode("xyz", add_special_tokens=False)
    options = {
        "n": dict(grammar=narrow, output=[]),
        "s": dict(grammar=narrow, output=[], temperature=0.9, seed=3),
        "w": dict(grammar=wide, output=[]),
        "x": dict(grammar=narrow, output=refused),
        "f": {},
        "t": dict(temperature=0.7, seed=8),
    }
    ks = {"n": 4, "s": 3, "w": 3, "x": 2, "f": 3, "t": 1}
    g = torch.Generator().manual_seed(4)
    hidden_size, vocab = module.config.hidden_size, module.config.vocab_size
    start = dict.fromkeys(ks, 0)
    for it in range(3):
        items = [
            ProposeItem(r, start[r], torch.randint(3, vocab, (3,), generator=g).tolist(), k, **options[r])
            for r, k in ks.items()
        ]
        rows = torch.randn(3 * len(ks), hidden_size, generator=g)
        got, expected = (runner.propose(items, rows) for runner in runners)
        assert got.drafts == expected.drafts, f"iteration {it}"
        assert [len(d) for d in got.drafts] == list(ks.values())
        for a, b in zip(got.draft_probs, expected.draft_probs):
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a[0], b[0])
                torch.testing.assert_close(a[1], b[1], atol=1e-6, rtol=1e-5)
        for r in ("n", "s"):
            drafts = got.drafts[list(ks).index(r)]
            assert all(t == tok.eos_token_id or set(tok.convert_ids_to_tokens(t)) <= letters for t in drafts), drafts
        for r in ks:
            start[r] += 3
    assert runs == [3] * 3
    for runner in runners:  # every draft rolled back: each matcher has consumed its output, no more
        for r in ("n", "s", "w"):
            matcher = runner.grammars._matchers[r].matcher
            assert matcher.try_consume_tokens(refused) == 0 or r == "w"
