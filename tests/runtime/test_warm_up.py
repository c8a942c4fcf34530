"""specsplit.runtime.warm_up: the runners' start-up eager steps run through the given step function with the
planned shapes and leave the KV cache as they found it; a step without room is skipped; nothing runs
on a CPU cache unless asked."""

import torch

from specsplit.models.loader import load_target
from specsplit.runtime.warm_up import warm_up_eager
from tests.fixtures.tiny import write_tiny_checkpoint


def test_eager_warm_up_steps_run_and_free_their_requests(tmp_path):
    model = load_target(write_tiny_checkpoint(tmp_path / "tiny-qwen2", architecture="qwen2"))
    cache = model.make_kv_cache(num_blocks=20, block_size=4)
    seen = []

    def run(ids, positions, attn):
        seen.append((ids.numel(), attn.num_tokens, positions[:3].tolist()))
        return model.compute_logits(model(ids, positions, cache, attn)[-1:])

    assert warm_up_eager(cache, run) == (0, 0.0)  # a CPU cache: nothing, unless forced
    steps, seconds = warm_up_eager(cache, run, steps=((3, 8), (1, 12), (2, 64)), force=True)
    assert steps == 2 and seconds > 0  # 2 x 64 tokens need 32 blocks of 20: skipped
    assert seen == [(24, 24, [0, 1, 2]), (12, 12, [0, 1, 2])]
    assert cache.num_free_blocks == cache.num_blocks
    assert torch.all(torch.isfinite(cache.k))
