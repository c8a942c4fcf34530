"""benchmarks/lib/adaptive_window.py's bound on a window's prefill steps, against the real scheduler: requests prefilled
early decode in the later prefill steps, so `max_tokens` must count those steps (a batch of 128 at the servers'
768-token budget took 56 of them on the H200 and its first requests ran past `max_tokens`)."""

import pytest

from benchmarks.lib.adaptive_window import horizon, prefill_iterations, window_token_budget
from specsplit.coordinator.config import SchedulerConfig
from specsplit.coordinator.iteration import VerifyResult
from specsplit.coordinator.request import Request, SamplingParams
from specsplit.coordinator.scheduler import Scheduler


def prefill_steps(batch: int, prompt_len: int, budget: int, k: int) -> tuple[int, int]:
    """Steps until every request is decoding, each verifying every draft it is given (the most tokens a request can
    emit), and the most tokens any request emitted by then."""
    config = SchedulerConfig(
        max_model_len=4096,
        block_size=16,
        num_blocks=4096,
        num_speculative_tokens=k,
        max_num_seqs=batch,
        max_num_batched_tokens=budget,
        adaptive=False,
    )
    scheduler = Scheduler(config, [0])
    requests = [
        # prompts of their own, as the benchmark's: none starts on another's cached blocks
        Request(f"r{i}", [1000 + i, *range(2, prompt_len + 1)], SamplingParams(max_tokens=10_000, ignore_eos=True))
        for i in range(batch)
    ]
    for r in requests:
        scheduler.add_request(r)
    steps = 0
    while not all(r.num_computed_tokens == r.num_tokens - 1 for r in requests) or scheduler.num_waiting:
        out = scheduler.schedule()
        results = [
            VerifyResult(
                item.request.request_id,
                [7] * (item.num_draft_tokens + 1) if item.sample else [],
                0,
                item.num_draft_tokens,
            )
            for item in out.scheduled
        ]
        scheduler.update_from_output(out, results)
        steps += 1
        assert steps < 10_000
    return steps, max(len(r.output_token_ids) for r in requests)


@pytest.mark.parametrize("batch, prompt_len, k", [(24, 64, 5), (12, 64, 3), (8, 16, 1)])
def test_the_prefill_takes_at_most_the_bound_and_emits_what_the_horizon_allows(batch, prompt_len, k):
    budget = 2 * batch * (k + 1)  # what window_token_budget gives above 2048 tokens, scaled down
    steps, emitted = prefill_steps(batch, prompt_len, budget, k)
    bound = prefill_iterations(batch, prompt_len, budget, k)
    assert 1 < steps <= bound
    assert emitted <= horizon(0, 0, k, bound)


def test_at_a_budget_of_one_decode_step_the_prefill_drags_on():
    """What the bound guards against: at batch x (k + 1) tokens, the servers' budget raised only for a decode step,
    the first requests decode through most of the prefill."""
    steps, emitted = prefill_steps(24, 64, 24 * 6, 5)
    assert steps > 3 * prefill_iterations(24, 64, 2 * 24 * 6, 5)
    assert emitted > horizon(0, 0, 5, 4)
    with pytest.raises(ValueError):
        prefill_iterations(24, 64, 24 * 6, 5)


def test_window_budget_fits_two_decode_steps_of_the_largest_batch():
    assert window_token_budget(8, 5) == 2048
    assert window_token_budget(256, 5) == 2 * 256 * 6
