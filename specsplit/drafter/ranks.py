"""A tensor-parallel drafter's followers (`specsplit.runtime.tensor_parallel` starts and watches them).

Rank 0 (the `serve drafter` process) receives each Propose's hidden states over the hidden-state transport
as a one-device drafter does, then broadcasts the call to its followers (`runner.share_propose`: the items over the
control group, the rows over the device group) before running it; so too each Free (`share_free`) and each
registration of cached blocks (`share_cache_blocks`). A follower runs the same `DrafterRunner` calls in the same
order (`follow`), so its MTP cache, which holds its KV heads, has the blocks (and the cached blocks) rank 0's has;
its forwards take part in the all-reduces and the logits gather, and it takes each step's drafts, which rank 0
picks, from a broadcast (`DrafterRunner._pick`).

A device hand-off (the verifier's tokens still on the device) is waited for on rank 0 before the broadcast:
a tensor-parallel drafter proposes from host tokens.
"""

from __future__ import annotations

import torch


def follow(runner) -> int:
    """A follower's loop over rank 0's runner calls, until rank 0 broadcasts the end (None); returns the
    proposes run."""
    from specsplit.models.parallel import broadcast_from_first, broadcast_tensor_from_first

    param = runner.mtp.embed_tokens.weight  # never FP8: the hidden states' dtype
    hidden_size = runner.mtp.config.hidden_size
    steps = 0
    while (call := broadcast_from_first()) is not None:
        if call.cache_blocks is not None:
            runner.cache_blocks(call.cache_blocks)
            continue
        if call.items is None:
            runner.free(call.free)
            continue
        hidden = torch.empty(call.num_rows, hidden_size, dtype=param.dtype, device=param.device)
        runner.propose(call.items, broadcast_tensor_from_first(hidden))
        steps += 1
    return steps


def follower_main(config, rank: int, address: str) -> None:
    """A follower process: `config` is rank 0's DrafterConfig; loaded and sized as rank 0 is, in step with it
    (the warm-up's collectives, one block count)."""
    from specsplit.drafter.loading import load_and_size
    from specsplit.runtime.serve_options import apply_eager_option
    from specsplit.runtime.tensor_parallel import run_follower

    def load(device: str):
        return load_and_size(config, apply_eager_option(config.model.eager), rank)[1]

    run_follower(config, rank, address, "drafter", load, follow)
