"""The launch shape (chunk, tile and warps of each kernel) changes speed, never tokens."""

import pytest

from specsplit.kernels.triton_rejection_launch import (
    GPU_LAUNCH,
    LARGE_BATCH_TABLE,
    LAUNCH_TABLE,
    MODES,
    RACE_IN_STATS_MAX_LOGITS,
    SMALL_BATCH,
    Launch,
    default_launch,
)

# Per vocabulary: several chunks per row in each kernel (a partial last one), the race's chunk smaller
# and larger than the stats', tiles narrower than chunks. (The interpreter runs programs one by one.)
# race_in_stats: one-hot and sparse batches race their stop rows in the stats kernel instead.
LAUNCHES = {
    1000: [Launch(256, 128, 4, 128, 64, 2), Launch(128, 64, 4, 512, 128, 4), Launch(256, 64, 4, 128, 64, 2, True)],
    4099: [
        Launch(1024, 256, 8, 512, 256, 2),
        Launch(512, 512, 4, 1024, 256, 1),
        Launch(4096, 512, 4, 512, 256, 2, True),
    ],
}
# (q mode, which requests are greedy): all greedy, all random per q mode, and a mixed batch.
CASES = {
    "greedy": ("one_hot", [True] * 3),
    "one_hot": ("one_hot", [False] * 3),
    "dense": ("dense", [False] * 3),
    "sparse": ("sparse", [False] * 3),
    "mixed": ("dense", [True, False, False]),
    "mixed_sparse": ("sparse", [False, True, False]),
}


@pytest.mark.parametrize("vocab_size", list(LAUNCHES))
@pytest.mark.parametrize("case", list(CASES))
def test_every_launch_shape_gives_the_default_and_reference_tokens(batch_factory, same_output, vocab_size, case):
    mode, greedy = CASES[case]
    batch = batch_factory(vocab_size + len(case), [3, 0, 2], vocab_size, greedy=greedy, hit_rate=0.7)
    reference, default = batch.sample(mode, "reference"), batch.sample(mode, "triton")
    same_output(default, reference)
    for launch in LAUNCHES[vocab_size]:
        same_output(batch.sample(mode, launch=launch), default)


def test_launch_rejects_shapes_the_kernels_cannot_run():
    for bad in [(1000, 256, 4), (256, 512, 4), (256, 256, 3)]:
        with pytest.raises(ValueError):
            Launch(*bad, 256, 256, 4)
        with pytest.raises(ValueError):
            Launch(256, 256, 4, *bad)


def test_launch_fits_small_vocabularies():
    assert Launch(8192, 1024, 4, 2048, 2048, 8).fit(100) == Launch(128, 128, 4, 128, 128, 8)
    assert GPU_LAUNCH.fit(151_936) == GPU_LAUNCH


def test_default_launch_covers_every_batch_size_and_mode():
    assert set(LAUNCH_TABLE) == {"greedy", "random"}
    assert set(LARGE_BATCH_TABLE) == {"one_hot", "dense", "sparse"}
    for mode in MODES:
        for num_reqs in (1, 8, 64, 256, 4096):
            assert isinstance(default_launch(num_reqs, num_reqs * 4, 151_936, mode), Launch)
    with pytest.raises(ValueError):
        default_launch(1, 4, 151_936, "top_k")


def test_small_sparse_calls_and_large_one_hot_batches_race_in_the_stats_kernel():
    # (num_reqs, vocab, one launch?) at 4 rows per request: few logits, or at most 1,024 rows of a short vocabulary;
    # one-hot batches of more than SMALL_BATCH requests always.
    cases = ((1, 151_936, True), (4, 151_936, True), (5, 151_936, False), (64, 151_936, False), (16, 32_000, True),
             (64, 32_000, True), (256, 32_000, True), (257, 32_000, False))  # fmt: skip
    assert 4 * 4 * 151_936 <= RACE_IN_STATS_MAX_LOGITS < 5 * 4 * 151_936
    for mode in MODES:
        for num_reqs, vocab_size, one_launch in cases:
            launch = default_launch(num_reqs, num_reqs * 4, vocab_size, mode)
            expected = mode == "sparse" and one_launch or mode == "one_hot" and (one_launch or num_reqs > SMALL_BATCH)
            assert launch.race_in_stats == expected, (mode, num_reqs, vocab_size)


def test_large_random_batches_pick_by_logits():
    """Above SMALL_BATCH requests a random batch's launch depends on its logits (rows x vocab), not on how many
    requests carry them: one-hot takes small chunks up to 64M logits, dense and sparse halve theirs below 8M."""
    assert default_launch(64, 256, 32_000, "one_hot").stats_chunk == 4096  # 8.2M logits
    assert default_launch(256, 1024, 151_936, "one_hot").stats_chunk == 16384  # 156M
    assert default_launch(64, 128, 32_000, "dense").stats_chunk == 8192  # 4.1M
    assert default_launch(64, 256, 32_000, "dense").stats_chunk == 16384  # 8.2M
    assert default_launch(16, 256, 32_000, "sparse") == default_launch(64, 256, 32_000, "sparse")
    assert default_launch(8, 256, 32_000, "dense") == LAUNCH_TABLE["random"][-1][1]  # a small batch of long rows
