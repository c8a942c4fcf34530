"""Adaptive speculation end to end through the scheduler, on a simulated engine: iteration times from a cost with the
shape of a 7B target on one GPU (flat until the step is compute-bound, then linear in tokens; a Propose's fixed cost;
a cost per drafter step) with 3 % noise, and drafts accepted with a forced probability per position (per request in
the mixed batch). Each run decodes WAVES batches' worth of requests through B slots (continuous batching: a finished
request's slot takes the next one), as benchmarks/adaptive.py does on the GPU; the adaptive chooser learns in one run
and is timed in the next."""

import random

import pytest

from specsplit.coordinator.config import SchedulerConfig
from specsplit.coordinator.draft_choice import DraftChooser
from specsplit.coordinator.iteration import VerifyResult
from specsplit.coordinator.request import Request, SamplingParams
from specsplit.coordinator.scheduler import Scheduler

K_MAX, NEW_TOKENS, WAVES, LATER_STEP_S = 5, 32, 4, 0.35e-3


def iteration_s(num_tokens: int, batch: int, proposes: bool, later_steps: int, rng: random.Random) -> float:
    t = 6.5e-3 + max(0, num_tokens - 96) * 0.03e-3 + batch * 0.01e-3
    if proposes:
        t += 0.5e-3 + 0.003e-3 * batch + LATER_STEP_S * later_steps
    return t * rng.uniform(0.97, 1.03)


def tokens_per_s(alphas: list[float], k: int | None, chooser: DraftChooser | None = None, seed: int = 0) -> float:
    """`k` None: adaptive (with `chooser`'s state), else every request k drafts."""
    rng = random.Random(seed)
    batch = len(alphas)
    config = SchedulerConfig(
        max_model_len=4096,
        block_size=16,
        num_blocks=1 << 16,
        num_speculative_tokens=K_MAX,
        max_num_seqs=batch,
        max_num_batched_tokens=4096,
        adaptive=k is None,
    )
    s = Scheduler(config, [1 << 30], chooser)
    for i in range(batch * WAVES):
        params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, num_speculative_tokens=k)
        s.add_request(Request(str(i), [1, 2, 3, 4], params))
    seconds = 0.0
    while s.has_work():
        out = s.schedule()
        t = iteration_s(out.num_scheduled_tokens, len(out.scheduled), out.proposes, out.num_later_steps, rng)
        seconds += t
        results = []
        for item in out.scheduled:
            accepted = 0
            while accepted < item.num_draft_tokens and rng.random() < alphas[int(item.request.request_id) % batch]:
                accepted += 1
            rid, n = item.request.request_id, item.num_draft_tokens
            results.append(VerifyResult(rid, [7] * (accepted + 1), n - accepted, n))
        s.update_from_output(out, results)
        later = out.num_later_steps if out.proposes else 0
        s.record_iteration(out, t, out.proposes, later, LATER_STEP_S * later)
    return batch * WAVES * NEW_TOKENS / seconds


@pytest.mark.parametrize(
    ("name", "alphas", "at_least"),
    [
        ("alpha 0.3, batch 128", [0.3] * 128, 0.98),  # no draft pays: target-only's speed
        ("alpha 0.9, batch 8", [0.9] * 8, 0.97),  # every draft pays
        ("alpha 0.6, batch 32", [0.6] * 32, 0.95),
        ("mixed 0.9 / 0.2, batch 32", [0.9, 0.2] * 16, 0.97),
    ],
)
def test_adaptive_against_every_fixed_k_on_a_simulated_gpu(name, alphas, at_least):
    fixed = {k: tokens_per_s(alphas, k) for k in range(K_MAX + 1)}
    chooser = DraftChooser()
    tokens_per_s(alphas, None, chooser, seed=1)  # learning
    adaptive = tokens_per_s(alphas, None, chooser, seed=0)  # the fixed runs' acceptance draws
    best = max(fixed, key=fixed.get)
    print(f"\n{name}: adaptive {adaptive:.0f} tok/s, best fixed k={best} {fixed[best]:.0f}, k=0 {fixed[0]:.0f}")
    assert adaptive >= at_least * fixed[best]
