"""A tensor-parallel verifier's followers (`specsplit.runtime.tensor_parallel` starts and watches them): each receives
every step's `ForwardStep` from rank 0 and runs the same forward on its device (a CUDA graph's replay where
rank 0's would), and so takes part in the step's all-reduces and the logits gather. Rejection sampling, the
coordinator's messages and the hidden states for the drafter stay on rank 0, whose hidden states are the
whole model's (every rank's are, after the last all-reduce)."""

from __future__ import annotations

import torch


def follow(runner) -> int:
    """A follower's loop over rank 0's steps, until rank 0 broadcasts the end (None); returns the steps run."""
    from specsplit.models.parallel import broadcast_from_first
    from specsplit.models.step_upload import StepUpload

    cache = runner.kv_cache
    upload = StepUpload(cache.device)
    steps = 0
    while (step := broadcast_from_first()) is not None:
        (ids, positions, rows), _, _ = upload([step.input_ids, step.positions, step.logits_indices])
        attn = cache.upload_step(step.plan, use_kernel=step.use_kernel)
        with torch.inference_mode():
            runner.forward(ids, positions, attn, rows)
        steps += 1
    return steps


def follower_main(config, rank: int, address: str) -> None:
    """A follower process: `config` is rank 0's VerifierConfig; loaded and sized as rank 0 is, in step with it
    (the warm-up's collectives, one block count)."""
    from specsplit.runtime.serve_options import apply_eager_option
    from specsplit.runtime.tensor_parallel import run_follower
    from specsplit.verifier.loading import load_and_size

    def load(device: str):
        return load_and_size(config, apply_eager_option(config.model.eager), rank)[2]

    run_follower(config, rank, address, "verifier", load, follow)
