"""The KV cache sized from `--gpu-memory-utilization` (specsplit/runtime/kv_cache_size.py, memory_profile.py): the
arithmetic on synthetic byte counts (weights, peaks, block bytes, F, two services on one device), the one-line
refusals, `specsplit up`'s split of F between a verifier and a drafter, and the start-up order (probe runner,
then the real cache and runner) with a fake device measurement on the CPU."""

from __future__ import annotations

import pytest
import torch

from specsplit.client.errors import UsageError
from specsplit.models.deepseek_v3.latent_cache import LatentKVCache
from specsplit.models.kv_cache import PagedKVCache
from specsplit.runtime.kv_cache_size import (
    COLOCATED_DRAFTER_SHARE,
    GIB,
    HEADROOM,
    MemoryUse,
    blocks_from_memory,
    check_free,
    given_blocks,
    service_shares,
)
from specsplit.runtime.memory_profile import cache_bytes, probe_blocks, size_kv_cache

MIB = 1 << 20


def test_the_cache_gets_what_the_share_leaves_after_the_peak_without_the_probe_cache():
    use = MemoryUse(total=80 * GIB, weights=16 * GIB, peak=20 * GIB, probe_cache=256 * MIB)
    size = blocks_from_memory(0.9, use, block_bytes=2 * MIB, block_size=16, max_model_len=32768)
    # (0.9 * 80 GiB * (1 - 1/200) - (20 GiB - 256 MiB)) / 2 MiB = (73359.36 - 20224) MiB / 2 MiB
    assert size.num_blocks == int((73728 * 199 / 200 - 20224) // 2) == 26567
    assert size.num_tokens == 26567 * 16
    assert (20 * GIB - 256 * MIB) + size.num_blocks * 2 * MIB <= 0.9 * 80 * GIB * (1 - HEADROOM)


def test_a_partial_block_is_not_given():
    use = MemoryUse(total=1000, weights=100, peak=300, probe_cache=0)
    assert blocks_from_memory(0.5, use, block_bytes=60, block_size=1, max_model_len=1).num_blocks == 3  # 197.5 // 60


def test_weights_alone_past_the_share_are_refused_in_one_line():
    use = MemoryUse(total=80 * GIB, weights=70 * GIB, peak=71 * GIB, probe_cache=0)
    with pytest.raises(UsageError) as refused:
        blocks_from_memory(0.8, use, block_bytes=MIB, block_size=16, max_model_len=16)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("the weights alone take 70.00 GiB, more than --gpu-memory-utilization 0.8 of 80.00 GiB")
    assert "raise --gpu-memory-utilization" in message


def test_a_share_too_small_for_one_max_length_request_is_refused_in_one_line():
    # 10 GiB share (- 1/200) - 9 GiB peak = 972.8 MiB = 972 blocks of 1 MiB x 16 tokens = 15552 tokens < 32768
    use = MemoryUse(total=10 * GIB, weights=8 * GIB, peak=9 * GIB, probe_cache=0)
    with pytest.raises(UsageError) as refused:
        blocks_from_memory(1.0, use, block_bytes=MIB, block_size=16, max_model_len=32768)
    message = str(refused.value)
    assert "\n" not in message
    assert "972 KV cache blocks of 16 tokens, fewer than the 2048 one request of max_model_len 32768 needs" in message
    assert message.endswith("raise --gpu-memory-utilization or lower --max-model-len")
    with pytest.raises(UsageError, match=r"needs; raise --gpu-memory-utilization$"):  # the drafter: no such flag
        blocks_from_memory(1.0, use, block_bytes=MIB, block_size=16, max_model_len=32768, max_model_len_flag=None)
    assert blocks_from_memory(1.0, use, block_bytes=MIB, block_size=16, max_model_len=15552).num_blocks == 972


def test_a_peak_past_the_share_leaves_no_blocks_and_is_refused():
    use = MemoryUse(total=10 * GIB, weights=4 * GIB, peak=9 * GIB, probe_cache=0)
    with pytest.raises(UsageError, match=r"leaves 0.00 GiB after weights and workspace \(9.00 GiB\): 0 KV cache"):
        blocks_from_memory(0.5, use, block_bytes=MIB, block_size=16, max_model_len=16)


def test_two_services_on_one_device_stay_within_their_shares():
    total = 141 * GIB
    shares = service_shares(None, {"verifier": "cuda:0", "drafter": "cuda"})
    assert shares == {"verifier": pytest.approx(0.8), "drafter": COLOCATED_DRAFTER_SHARE}
    verifier = MemoryUse(total, weights=15 * GIB, peak=19 * GIB, probe_cache=300 * MIB)
    drafter = MemoryUse(total, weights=3 * GIB, peak=4 * GIB, probe_cache=10 * MIB)
    v = blocks_from_memory(shares["verifier"], verifier, block_bytes=2304 * 1024, block_size=16, max_model_len=32768)
    d = blocks_from_memory(shares["drafter"], drafter, block_bytes=64 * 1024, block_size=16, max_model_len=32768)
    v_use = verifier.peak - verifier.probe_cache + v.num_blocks * v.block_bytes
    d_use = drafter.peak - drafter.probe_cache + d.num_blocks * d.block_bytes
    assert v_use <= 0.8 * total and d_use <= 0.1 * total
    assert v_use + d_use <= 0.9 * total < total
    assert d.num_tokens >= v.num_tokens  # one MTP layer per token: the drafter holds what the verifier schedules


def test_a_share_larger_than_the_free_memory_at_start_up_is_refused_in_one_line():
    """Two servers on one device whose F's add up past 1: the second finds less than its share free."""
    check_free(0.1, 100 * GIB, free=11 * GIB)  # the drafter after a verifier of 0.8 and two contexts
    with pytest.raises(UsageError) as refused:
        check_free(0.9, 100 * GIB, free=12 * GIB)
    assert str(refused.value) == (
        "--gpu-memory-utilization 0.9 asks for 90.00 GiB of the device, but only 12.00 GiB were free at start-up "
        "(other processes hold the rest); lower it so that the shares of the processes on the device add up below 1"
    )


def test_up_splits_its_share_only_between_services_on_one_cuda_device():
    assert service_shares(None, {"verifier": "cpu", "drafter": "cpu"}) == {}
    assert service_shares(0.95, {"verifier": "cuda:0", "drafter": "cuda:1"}) == {"verifier": 0.95, "drafter": 0.95}
    assert service_shares(0.5, {"verifier": "cuda:0"}) == {"verifier": 0.5}  # no drafter
    assert service_shares(0.7, {"verifier": "cuda", "drafter": "cuda:0"}) == {"verifier": 0.6, "drafter": 0.1}
    # a tensor-parallel verifier on cuda:0 and cuda:1: a drafter on rank 1's device shares it, one on cuda:2 not
    assert service_shares(0.9, {"verifier": "cuda", "drafter": "cuda:1"}, 2) == {"verifier": 0.8, "drafter": 0.1}
    assert service_shares(0.9, {"verifier": "cuda:0", "drafter": "cuda:2"}, 2) == {"verifier": 0.9, "drafter": 0.9}
    # a TP 2 drafter from cuda:1 on: its rank 1 shares cuda:2 with the verifier's rank 2, rank 0 cuda:1 with none
    assert service_shares(0.9, {"verifier": "cuda:2", "drafter": "cuda:1"}, 2, 2) == {"verifier": 0.8, "drafter": 0.1}
    assert service_shares(0.9, {"verifier": "cuda:0", "drafter": "cuda:2"}, 2, 2) == {"verifier": 0.9, "drafter": 0.9}
    with pytest.raises(UsageError, match=r"^--gpu-memory-utilization sizes the KV caches from CUDA .* --device cpu"):
        service_shares(0.5, {"verifier": "cpu", "drafter": "cpu"})
    with pytest.raises(UsageError, match=r"^--gpu-memory-utilization 0.1: a drafter on the verifier's device"):
        service_shares(0.1, {"verifier": "cuda:0", "drafter": "cuda:0"})
    with pytest.raises(UsageError, match="out of range"):
        service_shares(1.5, {"verifier": "cuda:0"})


def test_the_log_line_says_blocks_tokens_and_gib():
    size = given_blocks(1024, 16, 2 * MIB, on_cuda=True)
    assert size.describe() == (
        "KV cache: 1024 blocks × 16 tokens = 16384 tokens (2 GiB), --num-blocks (overrides --gpu-memory-utilization)"
    )
    assert given_blocks(8, 4, 10, on_cuda=False).describe().endswith("= 32 tokens (7.45e-08 GiB), --num-blocks")


def test_block_bytes_count_every_cache_tensor():
    paged = PagedKVCache(3, 2, 8, num_blocks=5, block_size=4, dtype=torch.bfloat16, device="cpu")
    assert cache_bytes(paged) == 2 * 3 * 5 * 4 * 2 * 8 * 2  # K and V
    latent = LatentKVCache(2, 576, num_blocks=5, block_size=4, dtype=torch.float32, device="cpu")
    assert cache_bytes(latent) == 2 * 5 * 4 * 576 * 4
    assert probe_blocks(16, ((16, 128), (1, 1024))) == 128 and probe_blocks(4, ((2, 5),)) == 4


class _FakeBaseline:
    """A device measurement: the peak counts the caches alive when it is read (the probe's)."""

    def __init__(self, total: int, weights: int, workspace: int):
        self.total, self._weights, self._workspace, self.live = total, weights, workspace, []
        self.free = total

    def weights(self) -> int:
        return self._weights

    def forget_loading(self) -> None:
        self.live = []

    def peak(self) -> int:
        return self._weights + self._workspace + sum(cache_bytes(c) for c in self.live)


def test_start_up_sizes_from_a_probe_runner_then_builds_the_runner_on_the_real_cache():
    block_bytes = cache_bytes(PagedKVCache(1, 1, 4, 1, 4, torch.float32, "cpu"))  # 2 x 4 tokens x 4 x 4 B = 128
    baseline = _FakeBaseline(total=100_000, weights=20_000, workspace=10_000)
    events = []

    def make_cache(n):
        cache = PagedKVCache(1, 1, 4, n, 4, torch.float32, "cpu")
        events.append(("cache", n))
        return cache

    def make_runner(cache):
        baseline.live = [cache]  # alive while the runner warms up
        events.append(("runner", cache.num_blocks))
        return ("runner", cache)

    cache, runner, size = size_kv_cache(
        make_cache, make_runner, block_size=4, num_blocks=None, fraction=0.5, max_model_len=64, baseline=baseline
    )
    probe = probe_blocks(4)
    expected = int((50_000 * (1 - HEADROOM) - 30_000) // block_bytes)  # the probe cache is not workspace
    assert events == [("cache", 1), ("cache", probe), ("runner", probe), ("cache", expected), ("runner", expected)]
    assert cache.num_blocks == size.num_blocks == expected and runner == ("runner", cache)
    assert "from --gpu-memory-utilization 0.5" in size.describe()


def test_tensor_parallel_ranks_build_the_cache_of_the_least_count_the_ranks_agree_on():
    def sized(agree, give=None):
        baseline = _FakeBaseline(total=100_000, weights=20_000, workspace=10_000)
        made, asked = [], []

        def make_cache(n):
            made.append(n)
            cache = PagedKVCache(1, 1, 4, n, 4, torch.float32, "cpu")
            baseline.live = [cache]
            return cache

        def agreeing(n):
            asked.append(n)
            return agree(n)

        cache, _, size = size_kv_cache(
            make_cache,
            lambda c: c,
            block_size=4,
            num_blocks=give,
            fraction=0.5,
            max_model_len=64,
            baseline=baseline,
            agree=agreeing,
        )
        return made[-1], cache.num_blocks, size, asked

    own = sized(lambda n: n)[1]
    built, blocks, size, asked = sized(lambda n: n - 10)  # another rank has 10 blocks fewer
    assert asked == [own] and built == blocks == size.num_blocks == own - 10
    assert f"the least over the tensor-parallel ranks (this rank's: {own})" in size.describe()
    built, blocks, size, asked = sized(lambda n: n - 10, give=12)  # --num-blocks: one count everywhere already
    assert asked == [] and built == blocks == 12


def test_a_given_block_count_overrides_without_measuring(caplog):
    made = []
    with caplog.at_level("INFO", logger="specsplit.runtime.memory_profile"):
        cache, runner, size = size_kv_cache(
            lambda n: made.append(n) or PagedKVCache(1, 1, 4, n, 4, torch.float32, "cpu"),
            lambda c: c.num_blocks,
            block_size=4,
            num_blocks=7,
            fraction=None,
            max_model_len=64,
            baseline=None,
        )
    assert made == [1, 7] and runner == 7 and cache.num_blocks == 7
    assert "KV cache: 7 blocks × 4 tokens = 28 tokens" in caplog.text
