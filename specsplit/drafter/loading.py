"""A drafter rank's MTP module on its device: loaded, its KV cache sized and its runner built (rank 0 in
`server.py`, the tensor-parallel followers in `ranks.py`)."""

from __future__ import annotations

import torch

from specsplit.drafter.draft_vocab import draft_vocabulary
from specsplit.drafter.runner import DrafterRunner
from specsplit.models.loader import load_mtp
from specsplit.models.parallel import min_over_ranks
from specsplit.runtime.memory_profile import size_kv_cache
from specsplit.runtime.tensor_parallel import rank_load


def load_and_size(config, step_path: dict, rank: int = 0):
    """`config`: the server's `DrafterConfig`. On the device's thread: the MTP module loaded, then its KV cache
    sized (`--num-blocks`, or on CUDA from `--gpu-memory-utilization`: room for one request of the model's context
    length at least) and its runner built on it. Returns (module, runner). Tensor-parallel: every rank runs it on
    its own device (`rank`; the followers from `ranks.follower_main`), in step, as the verifier's ranks do
    (`specsplit.verifier.loading`)."""
    options = config.model
    # A co-located verifier shares rank 0's device only.
    with rank_load(options.device, config.num_blocks, config.socket_dir, rank) as (device, num_blocks, baseline):
        dtype = getattr(torch, options.dtype)
        mtp = load_mtp(options.checkpoint, dtype=dtype, device=device, load_format=options.load_format)
        vocab = draft_vocabulary(mtp, config.draft_vocab_size, options.checkpoint, config.draft_vocab_file)
        _, runner, _ = size_kv_cache(
            lambda n: mtp.make_kv_cache(n, config.block_size),
            lambda cache: DrafterRunner(
                mtp, cache, config.draft_top_k, tokenizer_dir=options.checkpoint, draft_vocab=vocab, **step_path
            ),
            block_size=config.block_size,
            num_blocks=num_blocks,
            fraction=options.gpu_memory_utilization,
            max_model_len=mtp.config.max_position_embeddings,
            baseline=baseline,
            max_model_len_flag=None,  # the model's context length: the drafter has no flag for it
            agree=min_over_ranks,
        )
    return mtp, runner
