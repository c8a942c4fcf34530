"""A tensor-parallel target's logits equal the one-device model's within fp32 rounding: TP 2 and 4 over
gloo (spawned CPU ranks), GQA with KV heads split (TP 2) and replicated (TP 4 > 2 KV heads), tied and
untied vocab-parallel embeddings with a vocabulary the ranks do not divide, qkv biases (Qwen2), q/k norms
(Qwen3), checkpoint weights and dummy weights; DeepSeek-V3's MLA and expert-parallel MoE; GLM-4.5's GQA with
partial rotary, qkv biases and q/k norms, beside the same MoE. The MTP module of each (a drafter's
`--tensor-parallel-size`: vocab-parallel embedding and head, its block sharded as the target's layers) too.
Block-scaled FP8 checkpoints of Qwen3, DeepSeek-V3 and GLM-4.5 split along whole scale blocks, dequantized
and (Qwen3) kept in FP8 on the W8A8 reference, each rank quantizing its activations in the checkpoint's
groups; a slice that would cut a block is refused in one line. The ranks agree on the least of their values
(the KV cache's blocks sized from each rank's memory)."""

from __future__ import annotations

import time

import pytest
import torch

from specsplit.models.fp8_linear import tensor_parallel_shards
from specsplit.models.layers import local_heads
from specsplit.models.loader import load_mtp, load_target
from specsplit.models.parallel_layers import Shard
from specsplit.rpc.process import free_port
from tests.fixtures.fp8 import write_fp8_checkpoint
from tests.fixtures.tiny_deepseek_v3 import write_tiny_deepseek_checkpoint
from tests.fixtures.tiny_glm4_moe import write_tiny_glm4_moe_checkpoint
from tests.models.tensor_parallel_ranks import rank_context, run_ranks

# (new tokens of request a, of request b) per step: prefill chunks, then a verify step of 1 + 3 tokens.
STEPS = ((7, 5), (3, 2), (4, 4))


def step_logits(path: str, load_format: str = "auto", keep_fp8: bool | None = None) -> torch.Tensor:
    """Every token's logits over the steps, on this rank ([tokens, vocab] on rank 0, None elsewhere)."""
    torch.manual_seed(0)
    model = load_target(path, load_format=load_format, keep_fp8=keep_fp8)
    cache = model.make_kv_cache(num_blocks=32, block_size=4)
    vocab, out = model.config.vocab_size, []
    with torch.inference_mode():
        for counts in STEPS:
            attn = cache.prepare_step(["a", "b"], list(counts))
            ids = torch.randint(0, vocab, (sum(counts),))
            ends = [cache.num_tokens(r) for r in "ab"]
            positions = torch.cat([torch.arange(end - n, end) for end, n in zip(ends, counts)])
            out.append(model.compute_logits(model(ids, positions, cache, attn)))
    return None if out[0] is None else torch.cat(out).numpy()


def mtp_step_logits(path: str, load_format: str = "auto", keep_fp8: bool | None = None) -> torch.Tensor:
    """The MTP module's logits over the steps (random hidden states in), on this rank ([tokens, vocab] on rank 0,
    None elsewhere)."""
    torch.manual_seed(1)
    mtp = load_mtp(path, load_format=load_format, keep_fp8=keep_fp8)
    cache = mtp.make_kv_cache(num_blocks=32, block_size=4)
    vocab, hidden_size, out = mtp.config.vocab_size, mtp.config.hidden_size, []
    with torch.inference_mode():
        for counts in STEPS:
            attn = cache.prepare_step(["a", "b"], list(counts))
            ids = torch.randint(0, vocab, (sum(counts),))
            previous = torch.randn(sum(counts), hidden_size)
            ends = [cache.num_tokens(r) for r in "ab"]
            positions = torch.cat([torch.arange(end - n, end) for end, n in zip(ends, counts)])
            out.append(mtp.compute_logits(mtp(ids, previous, positions, cache, attn)))
    return None if out[0] is None else torch.cat(out).numpy()


CASES = (  # (architecture, checkpoint options, load format)
    ("llama", {"vocab_size": 322, "tie_word_embeddings": True}, "auto"),
    ("qwen2", {}, "auto"),
    ("qwen3", {"vocab_size": 321}, "auto"),
    ("qwen3", {}, "dummy"),  # random weights: each rank's are the slices of the one-device model's
)


def all_step_logits(cases: list[tuple]) -> list:
    """(target logits, MTP logits) of every case."""
    return [(step_logits(*case), mtp_step_logits(*case)) for case in cases]


@pytest.fixture(scope="module")
def cases(checkpoint_dir, tmp_path_factory) -> list[tuple]:
    """(checkpoint, load format[, keep FP8]) of every case: CASES, DeepSeek-V3 (MLA heads split, 8 experts split
    across the ranks with the router replicated, one dense layer), with and without q_lora, and GLM-4.5 (GQA, one
    dense layer, 8 experts split), from its checkpoint and from dummy weights; FP8 checkpoints (blocks of 8 rows
    by 32 columns: heads of 32 columns, whole at TP 2 and 4) of Qwen3, also kept in FP8, and of DeepSeek-V3 and
    GLM-4.5; Qwen3's MLP (224 wide: 7 blocks) and GLM-4.5's dense one (160: 5) split into whole blocks unevenly."""
    paths = [(str(checkpoint_dir(arch, **kwargs)), load_format) for arch, kwargs, load_format in CASES]
    for q_lora_rank in (32, None):
        path = tmp_path_factory.mktemp(f"tiny-deepseek-{q_lora_rank}")
        paths.append((str(write_tiny_deepseek_checkpoint(path, q_lora_rank=q_lora_rank)), "auto"))
    glm = write_tiny_glm4_moe_checkpoint(tmp_path_factory.mktemp("tiny-glm4-moe"), use_qk_norm=True)
    paths += [(str(glm), "auto"), (str(glm), "dummy")]
    root = tmp_path_factory.mktemp("fp8")
    sources = {
        "qwen3": checkpoint_dir("qwen3", hidden_size=128, intermediate_size=224),
        "deepseek": write_tiny_deepseek_checkpoint(root / "deepseek-src", v_head_dim=32, moe_intermediate_size=128),
        "glm": write_tiny_glm4_moe_checkpoint(
            root / "glm-src", head_dim=32, intermediate_size=160, moe_intermediate_size=128
        ),
    }
    for name, src in sources.items():
        fp8, _ = write_fp8_checkpoint(src, root / name, root / f"{name}-deq", (8, 32))
        paths.append((str(fp8), "auto"))
    paths.append((paths[-3][0], "auto", True))  # Qwen3's in FP8 on each rank: the W8A8 reference
    return paths


def assert_tp_close(got: torch.Tensor, want: torch.Tensor, w8a8: bool, msg: str) -> None:
    """Equal up to float sums in another order; with FP8 activations (W8A8), within their tolerance on average: a
    sum that lands on the other side of an e4m3 rounding boundary moves that activation by a whole e4m3 step (1/8
    of it), which no bound on the largest error survives (on one 2-core machine 319 of 8,000 logits of the Qwen3
    case at TP 2 moved by up to 0.017, on another none)."""
    if not w8a8:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=msg)
        return
    error = (got - want).abs()
    assert error.mean() < 1e-3 * want.std() and error.max() < 0.05 * want.std(), msg
    assert (error <= 1e-4).float().mean() > 0.9, msg  # most logits exact to float sums: the shards are the same


@pytest.mark.parametrize("size", [2, 4])
def test_tp_logits_equal_one_device(cases, size):
    """One group of ranks runs every case (starting ranks costs seconds each)."""
    for case, (logits, mtp_logits) in zip(cases, run_ranks(size, all_step_logits, cases)):
        path, w8a8 = case[0], len(case) > 2 and bool(case[2])
        reference = torch.from_numpy(step_logits(*case))
        assert_tp_close(torch.from_numpy(logits), reference, w8a8, f"{case} TP {size}")
        reference = torch.from_numpy(mtp_step_logits(*case))
        assert_tp_close(torch.from_numpy(mtp_logits), reference, w8a8, f"{path} MTP TP {size}")


def _least_blocks() -> int:
    from specsplit.models.parallel import min_over_ranks, tp_rank

    return min_over_ranks([900, 700, 800, 1000][tp_rank()])


def test_ranks_agree_on_the_least_block_count():
    assert run_ranks(4, _least_blocks) == 700


def test_local_heads_split_and_replicate():
    from specsplit.models import parallel

    for rank, size, heads, kv, want in [
        (1, 2, 8, 4, (4, 2, 2)),  # KV heads split
        (3, 4, 8, 2, (2, 1, 1)),  # replicated: ranks 2 and 3 share KV head 1
        (0, 4, 8, 2, (2, 1, 0)),
        (5, 8, 8, 1, (1, 1, 0)),  # MQA: every rank holds the one KV head
    ]:
        parallel._state = parallel.TensorParallelState(rank, size, None, None)
        try:
            assert local_heads(heads, kv) == want
        finally:
            parallel._state = parallel.TensorParallelState(0, 1, None, None)
    parallel._state = parallel.TensorParallelState(0, 4, None, None)
    try:
        with pytest.raises(ValueError, match="not a multiple of 3 KV heads"):
            local_heads(12, 3)
    finally:
        parallel._state = parallel.TensorParallelState(0, 1, None, None)


def test_fp8_scales_are_sliced_along_whole_blocks_and_a_cut_block_is_refused():
    rows = {"weight": Shard(0, 32, 32, 96), "bias": Shard(0, 32, 32, 96)}  # column-parallel, blocks of 16 rows
    assert tensor_parallel_shards("q_proj", rows, 16, 8)["weight_scale_inv"] == Shard(0, 2, 2, 6)
    last = {"weight": Shard(0, 64, 36, 100)}  # the last rank's rows end the tensor: a partial last block is whole
    assert tensor_parallel_shards("up_proj", last, 16, 8)["weight_scale_inv"] == Shard(0, 4, 3, 7)
    columns = {"weight": Shard(1, 24, 24, 48)}  # row-parallel: groups of 8 input columns
    assert tensor_parallel_shards("o_proj", columns, 16, 8)["weight_scale_inv"] == Shard(1, 3, 3, 6)
    cut = r"down_proj: .* input columns \[24, 48\) of 48 cut its FP8 scale blocks of 16"
    with pytest.raises(ValueError, match=cut):
        tensor_parallel_shards("down_proj", columns, 8, 16)
    with pytest.raises(ValueError, match=r"rows \[32, 64\) of 96 cut its FP8 scale blocks of 64"):
        tensor_parallel_shards("q_proj", rows, 64, 8)


def test_shard_pads_the_vocabulary_past_its_end():
    full = torch.arange(10.0).view(5, 2)
    assert Shard(0, 3, 3, 5).take(full).tolist() == [[6.0, 7.0], [8.0, 9.0], [0.0, 0.0]]
    assert Shard(1, 1, 1, 2).take(full).tolist() == [[1.0], [3.0], [5.0], [7.0], [9.0]]
    assert Shard(0, 0, 5, 5, zero=True).take(full).abs().sum() == 0


def _join_alone(address: str, results) -> None:
    from specsplit.models.parallel import TensorParallelStartError, init_tensor_parallel

    t0 = time.monotonic()
    try:
        init_tensor_parallel(0, 2, address, backend="gloo", timeout_s=2)
        results.put(("joined", 0.0))
    except TensorParallelStartError as err:
        results.put((str(err), time.monotonic() - t0))


def test_a_rank_that_never_joins_fails_start_up_within_the_timeout_with_one_line():
    ctx = rank_context()
    results = ctx.Queue()
    proc = ctx.Process(target=_join_alone, args=(f"127.0.0.1:{free_port()}", results))
    proc.start()
    message, seconds = results.get(timeout=60)
    proc.join(10)
    assert message.startswith("tensor-parallel group of 2 ranks at 127.0.0.1:") and "within 2 s" in message
    assert "\n" not in message and seconds < 10
