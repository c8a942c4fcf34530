"""A verifier rank's model on its device: the target loaded, its KV cache sized and its runner built (rank 0 in
`server.py`, the tensor-parallel followers in `ranks.py`)."""

from __future__ import annotations

import torch

from specsplit.runtime.tensor_parallel import rank_load


def load_and_size(config, step_path: dict, rank: int = 0):
    """`config`: the server's `VerifierConfig`. On the device's thread: the target loaded, then its KV cache sized
    (`--num-blocks`, or on CUDA from `--gpu-memory-utilization`) and its runner built on it. Returns (model, cache,
    runner, max_model_len). Tensor-parallel: every rank runs it on its own device (`rank`; the followers from
    `ranks.follower_main`), in step, since the runners' warm-up forwards take part in collectives; a cache sized
    from memory gets the least of the ranks' block counts (`parallel.min_over_ranks`), as rank 0's block plans
    index every rank's."""
    from specsplit.models.loader import load_target
    from specsplit.models.parallel import min_over_ranks
    from specsplit.runtime.memory_profile import size_kv_cache
    from specsplit.verifier.runner import VerifierRunner

    options = config.model
    # A co-located drafter shares rank 0's device only.
    with rank_load(options.device, config.num_blocks, config.socket_dir, rank) as (device, num_blocks, baseline):
        dtype = getattr(torch, options.dtype)
        model = load_target(options.checkpoint, dtype=dtype, device=device, load_format=options.load_format)
        limit = model.config.max_position_embeddings
        max_model_len = min(limit, config.max_model_len or limit)
        if num_blocks is not None:  # a given count caps the context, as it always has
            max_model_len = min(max_model_len, num_blocks * config.block_size)
        kv_cache, runner, _ = size_kv_cache(
            lambda n: model.make_kv_cache(n, config.block_size),
            lambda cache: VerifierRunner(
                model,
                cache,
                # a follower never samples: no sampler kernels to warm up
                "reference" if options.eager or rank else "auto",
                **step_path,
                max_model_len=max_model_len,
            ),
            block_size=config.block_size,
            num_blocks=num_blocks,
            fraction=options.gpu_memory_utilization,
            max_model_len=max_model_len,
            baseline=baseline,
            agree=min_over_ranks,
        )
    return model, kv_cache, runner, max_model_len
