"""A tensor-parallel drafter's runner (`specsplit.drafter.ranks`: rank 0 broadcasts each propose and free, its
followers run them): over two Proposes and a Free, with greedy and sampled requests of up to 3 drafts, TP 2's
drafts and sampled q equal one device's, for a Llama MTP module and DeepSeek-V3's (MLA, expert-parallel MoE).
CPU ranks over gloo (`run_ranks`)."""

from __future__ import annotations

import torch

from specsplit.drafter.runner import DrafterRunner, ProposeItem
from specsplit.models.loader import load_mtp
from tests.fixtures.tiny import write_tiny_checkpoint
from tests.fixtures.tiny_deepseek_v3 import write_tiny_deepseek_checkpoint
from tests.models.tensor_parallel_ranks import run_ranks


def calls() -> list:
    """(items, hidden states) of two Proposes, a Free between them: "a" greedy, "b" sampled, "c" greedy."""
    g = torch.Generator().manual_seed(0)
    first = [
        ProposeItem("a", 0, [5, 6, 7, 8], 3),
        ProposeItem("b", 0, [9, 10, 11], 3, temperature=0.7, seed=42),
        ProposeItem("c", 0, [12, 13], 1),
    ]
    second = [  # "a" rolled back past its drafts, "b" goes on; "c" was freed
        ProposeItem("a", 5, [20, 21], 2),
        ProposeItem("b", 3, [22], 3, temperature=0.7, seed=42),
    ]
    return [(first, torch.randn(9, 64, generator=g)), ["c"], (second, torch.randn(3, 64, generator=g))]


def drafts(path: str) -> list | None:
    """Rank 0: each Propose's drafts and q rows; a follower follows (None)."""
    from specsplit.drafter.ranks import follow
    from specsplit.models.parallel import tp_rank, tp_size
    from specsplit.runtime.tensor_parallel import end_followers

    mtp = load_mtp(path)
    runner = DrafterRunner(mtp, mtp.make_kv_cache(64, 4))
    if tp_rank() != 0:
        follow(runner)
        return None
    out = []
    for call in calls():
        if isinstance(call, list):
            runner.free(call)
            continue
        result = runner.propose(*call)
        q = [None if p is None else (p[0].tolist(), p[1].numpy()) for p in result.draft_probs]
        out.append((result.drafts, q))
    if tp_size() > 1:
        end_followers()
    return out


def test_tp2_drafts_equal_one_device(tmp_path):
    paths = [
        str(write_tiny_checkpoint(tmp_path / "llama", architecture="llama", seed=5)),
        str(write_tiny_deepseek_checkpoint(tmp_path / "dsv3", seed=1, num_hidden_layers=1, first_k_dense_replace=0)),
    ]
    for path in paths:
        want = drafts(path)
        got = run_ranks(2, drafts, path)
        assert [d for d, _ in got] == [d for d, _ in want], path
        assert any(any(d) for d, _ in want)  # drafts were made
        for (_, q_got), (_, q_want) in zip(got, want):
            for a, b in zip(q_got, q_want):
                assert (a is None) == (b is None)
                if a is not None:  # the sampled request's q: same support, same probabilities
                    assert a[0] == b[0]
                    torch.testing.assert_close(torch.from_numpy(a[1]), torch.from_numpy(b[1]), rtol=1e-5, atol=1e-6)
        assert any(q is not None for _, qs in want for q in qs)  # a sampled request drafted
