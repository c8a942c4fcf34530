"""On a CUDA GPU, a draft vocabulary (`specsplit/drafter/draft_vocab.py`) where the CPU tests cannot take it: MTP steps
replayed from CUDA graphs project onto its head and give the eager steps' drafts, also after a swap writes new rows
into the head the graphs captured; and the grammar-mask kernel masks its columns by their ids at a 151,936-id
vocabulary as the CPU does.

    SPECSPLIT_GPU_TESTS=1 python -m pytest -m gpu tests/gpu
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specsplit.drafter.draft_vocab import draft_vocabulary
from specsplit.drafter.runner import DrafterRunner, ProposeItem
from specsplit.models.loader import load_mtp, load_target
from specsplit.runtime.grammar import apply_masks
from tests.fixtures.tiny import write_tiny_checkpoint

pytestmark = pytest.mark.gpu
TOKENS = list(range(11, 40))


def test_graphed_steps_draft_from_the_head_after_a_swap_as_eager_steps_do(tmp_path):
    checkpoint = write_tiny_checkpoint(tmp_path / "m", architecture="qwen2", seed=3)
    dev = torch.device("cuda")
    target = load_target(checkpoint, device=dev)
    with torch.inference_mode():
        cache = target.make_kv_cache(16, 16)
        attn = cache.prepare_step(["t"], [len(TOKENS)])
        hidden = target(torch.tensor(TOKENS, device=dev), torch.arange(len(TOKENS), device=dev), cache, attn)
    drafts = {}
    for graphs in (False, True):
        mtp = load_mtp(checkpoint, device=dev)
        vocab = draft_vocabulary(mtp, 48, checkpoint)
        runner = DrafterRunner(
            mtp, mtp.make_kv_cache(32, 16), attention_kernel=graphs, cuda_graphs=graphs, draft_vocab=vocab
        )
        assert (runner.graphs is not None) == graphs
        first = runner.propose([ProposeItem("r", 0, TOKENS[1:20], 3)], hidden[:19]).drafts
        vocab.observe(list(range(200, 248)) * 2)  # a new set: ids the seed order ranks last
        vocab.swap(wait=True)
        second = runner.propose([ProposeItem("r", 19, TOKENS[20:22], 4)], hidden[19:21]).drafts
        assert set(second[0]) <= set(range(200, 248))
        drafts[graphs] = (first, second)
    assert drafts[True] == drafts[False]


def test_masks_of_draft_vocabulary_columns_on_the_gpu_equal_the_cpus():
    vocab, rows_n = 151_936, 128
    rng = np.random.default_rng(0)
    words = rng.integers(-(2**31), 2**31, size=(rows_n - 8, -(-vocab // 32)), dtype=np.int64).astype(np.int32)
    rows = rng.permutation(rows_n)[: rows_n - 8].tolist()
    column_ids = torch.from_numpy(np.sort(rng.permutation(vocab)[:32768]))
    logits = (torch.randn(rows_n, 32768, generator=torch.Generator().manual_seed(1)) * 4).to(torch.bfloat16)
    cpu, gpu = logits.clone(), logits.cuda()
    apply_masks(cpu, rows, words, column_ids)
    apply_masks(gpu, rows, words, column_ids.cuda())
    assert torch.equal(gpu.cpu(), cpu)
    assert torch.isinf(cpu).any() and torch.isfinite(cpu).any()
