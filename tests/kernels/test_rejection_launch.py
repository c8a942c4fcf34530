"""The launch shape (chunk, tile and warps of each kernel) changes speed, never tokens."""

import pytest

from kernels.triton_rejection_launch import (
    GPU_LAUNCH,
    LAUNCH_TABLE,
    MODES,
    RACE_IN_STATS_MAX_LOGITS,
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
    for mode in MODES:
        for num_reqs in (1, 8, 64, 256, 4096):
            assert isinstance(default_launch(num_reqs, num_reqs * 4, 151_936, mode), Launch)
    with pytest.raises(ValueError):
        default_launch(1, 4, 151_936, "top_k")


def test_small_one_hot_and_sparse_calls_race_in_the_stats_kernel():
    # (num_reqs, vocab, one launch?) at 4 rows per request: few logits, or at most 384 rows of a short vocabulary.
    cases = ((1, 151_936, True), (4, 151_936, True), (5, 151_936, False), (64, 151_936, False), (16, 32_000, True),
             (64, 32_000, True), (96, 32_000, True), (97, 32_000, False), (256, 32_000, False))  # fmt: skip
    assert 4 * 4 * 151_936 <= RACE_IN_STATS_MAX_LOGITS < 5 * 4 * 151_936
    for mode in MODES:
        for num_reqs, vocab_size, one_launch in cases:
            launch = default_launch(num_reqs, num_reqs * 4, vocab_size, mode)
            assert launch.race_in_stats == (one_launch and mode in ("one_hot", "sparse")), (mode, num_reqs, vocab_size)
