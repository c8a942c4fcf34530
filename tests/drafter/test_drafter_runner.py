"""propose(): incremental MTP steps equal recomputing from scratch; rollback drops the speculative
entries so a drafter fed iteration by iteration equals one fed everything at once."""

import pytest
import torch

from specsplit.drafter.runner import DrafterRunner, ProposeItem, _collect
from specsplit.models.loader import load_mtp, load_target
from specsplit.runtime.cuda_graphs import CudaGraphRunner
from tests.fixtures.tiny import write_tiny_checkpoint
from tests.fixtures.tiny_deepseek_v3 import write_tiny_deepseek_checkpoint

PROMPT = [11, 12, 13, 14, 15, 16, 17]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp("d") / "m", architecture="llama", seed=5)
    return load_target(ckpt), load_mtp(ckpt)


@pytest.fixture(scope="module")
def deepseek_models(tmp_path_factory):
    ckpt = write_tiny_deepseek_checkpoint(tmp_path_factory.mktemp("dsv3"), seed=5)
    return load_target(ckpt), load_mtp(ckpt)


def target_hidden(target, tokens):
    cache = target.make_kv_cache(32, 4)
    attn = cache.prepare_step(["r"], [len(tokens)])
    with torch.inference_mode():
        return target(torch.tensor(tokens), torch.arange(len(tokens)), cache, attn)


def fresh(mtp):
    return DrafterRunner(mtp, mtp.make_kv_cache(32, 4))


def recompute_drafts(mtp, hidden, next_ids, k):
    """Reference: every draft step recomputes the whole MTP sequence with a fresh cache."""
    hs, xs, drafts = list(hidden), list(next_ids), []
    for _ in range(k):
        cache = mtp.make_kv_cache(32, 4)
        attn = cache.prepare_step(["r"], [len(xs)])
        with torch.inference_mode():
            out = mtp(torch.tensor(xs), torch.stack(hs), torch.arange(1, len(xs) + 1), cache, attn)
            tok = int(mtp.compute_logits(out[-1:]).argmax(-1))
        drafts.append(tok)
        hs.append(out[-1])
        xs.append(tok)
    return drafts


def test_propose_equals_recomputing_every_step(models):
    target, mtp = models
    tokens = PROMPT + [20]
    hidden = target_hidden(target, tokens)[: len(PROMPT)]
    out = fresh(mtp).propose([ProposeItem("r", 0, tokens[1:], 3)], hidden)
    assert out.drafts == [recompute_drafts(mtp, hidden, tokens[1:], 3)]


def test_rollback_across_iterations_equals_one_shot(models):
    target, mtp = models
    tokens = PROMPT + [20, 21, 22]
    hidden = target_hidden(target, tokens)
    n = len(PROMPT)
    runner = fresh(mtp)
    # iteration 1: prompt pairs, 3 drafts (writes 2 speculative MTP entries)
    runner.propose([ProposeItem("r", 0, tokens[1 : n + 1], 3)], hidden[:n])
    # iteration 2: 2 positions were valid (one draft accepted + its correction)
    two = runner.propose([ProposeItem("r", n, tokens[n + 1 : n + 3], 3)], hidden[n : n + 2])
    one_shot = fresh(mtp).propose([ProposeItem("r", 0, tokens[1 : n + 3], 3)], hidden[: n + 2])
    assert two.drafts == one_shot.drafts
    assert runner.kv_cache.num_tokens("r") == n + 2 + 2


def test_batch_of_requests_equals_each_alone(models):
    target, mtp = models
    a, b = PROMPT + [20], PROMPT[:4] + [30]
    ha, hb = target_hidden(target, a)[:-1], target_hidden(target, b)[:-1]
    batched = fresh(mtp).propose(
        [ProposeItem("a", 0, a[1:], 3), ProposeItem("b", 0, b[1:], 1), ProposeItem("c", 0, b[1:], 0)],
        torch.cat([ha, hb, hb]),
    )
    alone_a = fresh(mtp).propose([ProposeItem("a", 0, a[1:], 3)], ha).drafts[0]
    alone_b = fresh(mtp).propose([ProposeItem("b", 0, b[1:], 1)], hb).drafts[0]
    assert batched.drafts == [alone_a, alone_b, []]


def test_missing_history_restarts_the_request_instead_of_failing(models):
    target, mtp = models
    tokens = PROMPT + [20]
    hidden = target_hidden(target, tokens)
    runner = fresh(mtp)
    out = runner.propose([ProposeItem("late", 5, tokens[6:8], 2)], hidden[5:7])
    assert len(out.drafts[0]) == 2 and runner.kv_cache.num_tokens("late") == 2 + 1
    runner.free(["late"])
    assert runner.kv_cache.num_free_blocks == runner.kv_cache.num_blocks


@pytest.mark.parametrize("models_of", ["models", "deepseek_models"])
def test_kernel_and_graph_buffer_path_proposes_like_the_sdpa_path(request, models_of):
    """Draft steps through the CUDA-graph runner's static buffers (run eagerly on CPU, buckets 1, 2, 4):
    same greedy drafts and the same sparse q of sampled drafts as the eager SDPA path (DeepSeek-V3: MLA's Triton
    kernel against its eager path)."""
    target, mtp = request.getfixturevalue(models_of)
    a, b = PROMPT + [20, 21, 22], PROMPT[:4] + [30, 31]
    ha, hb = target_hidden(target, a), target_hidden(target, b)
    cache = mtp.make_kv_cache(32, 4)
    graphed = DrafterRunner(mtp, cache, attention_kernel=True, cuda_graphs=False)
    graphed.graphs = CudaGraphRunner(mtp, cache, max_model_len=64, max_num_tokens=4, capture=False)
    plain = fresh(mtp)
    n, m = len(PROMPT), 4
    iterations = [  # step 0 of 11 tokens (eager kernel path), then 3 (padded to 4); later steps 1-2 tokens
        (
            [ProposeItem("a", 0, a[1 : n + 1], 3), ProposeItem("b", 0, b[1 : m + 1], 2, temperature=0.8, seed=7)],
            torch.cat([ha[:n], hb[:m]]),
        ),
        (
            [
                ProposeItem("a", n, a[n + 1 : n + 3], 3),
                ProposeItem("b", m, b[m + 1 : m + 2], 3, temperature=0.8, seed=7),
            ],
            torch.cat([ha[n : n + 2], hb[m : m + 1]]),
        ),
    ]
    for items, hidden in iterations:
        got, expected = graphed.propose(items, hidden), plain.propose(items, hidden)
        assert got.drafts == expected.drafts and all(
            len(d) == item.num_spec_tokens for d, item in zip(got.drafts, items)
        )
        assert got.draft_probs[0] is None and expected.draft_probs[0] is None
        torch.testing.assert_close(got.draft_probs[1], expected.draft_probs[1], atol=1e-5, rtol=1e-5)
    for name in ("latent",) if hasattr(cache, "latent") else ("k", "v"):  # MLA caches latents
        torch.testing.assert_close(getattr(cache, name), getattr(plain.kv_cache, name), atol=1e-5, rtol=1e-5)


def test_mtp_cache_running_out_mid_proposal_keeps_a_prefix_of_the_drafts(models):
    """Later steps are planned before any runs: the step with no room (and every step after it) is
    dropped, the drafts made before it are those a roomy cache makes."""
    target, mtp = models
    tokens = PROMPT + [20]
    hidden = target_hidden(target, tokens)[: len(PROMPT)]
    item = ProposeItem("r", 0, tokens[1:], 6)
    roomy = fresh(mtp).propose([item], hidden).drafts[0]
    tight = DrafterRunner(mtp, mtp.make_kv_cache(3, 4))  # 12 slots: 7 pairs + the 5 later steps, just enough
    tight_one = DrafterRunner(mtp, mtp.make_kv_cache(2, 4))  # 8 slots: 7 pairs + 1 later step, then full
    assert len(roomy) == 6
    assert tight.propose([item], hidden).drafts[0] == roomy
    assert tight_one.propose([item], hidden).drafts[0] == roomy[:2]


def test_collected_q_rows_are_each_sampled_request_s_own_steps():
    """Steps are laid out step after step; each sampled request gets the q rows of its own drafts, in order."""
    items = [
        ProposeItem("greedy", 0, [1], 3),
        ProposeItem("long", 0, [1], 3, temperature=0.5),
        ProposeItem("short", 0, [1], 1, temperature=0.5),
    ]
    actives = [[0, 1, 2], [0, 1], [0, 1]]  # step 0: all three; steps 1 and 2: "greedy" and "long"
    tokens = list(range(7))
    q_ids = torch.arange(7 * 2).view(7, 2)  # a row per draft of every step that sampled
    q_probs = q_ids.float() / 100
    out = _collect(items, actives, tokens, q_ids, q_probs, (0, 1, 2))
    assert out.drafts == [[0, 3, 5], [1, 4, 6], [2]]
    assert out.draft_probs[0] is None
    for j, rows in ((1, [1, 4, 6]), (2, [2])):
        ids, probs = out.draft_probs[j]
        assert torch.equal(ids, q_ids[rows]) and torch.equal(probs, q_probs[rows])
