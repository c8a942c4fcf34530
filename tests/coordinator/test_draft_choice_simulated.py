"""Adaptive speculation end to end through the scheduler, on a simulated engine shaped after the H200 runs of the 7B
shape (benchmarks/results/adaptive_h200.md): the verifier's step is a staircase in the tokens it runs (flat within a
CUDA graph size, 1, 2, 4 ... 512, then eager; the sizes' times fitted to the fixed-k cells of the 2026-12-02 run),
plus host time per request, a Propose's fixed cost and a cost per later drafter step, all with 3 % noise; the drafter
reports a tenth of its later steps' time (the chooser must not rely on that report: on the H200 it chose, at alpha
0.9 and batch 64, half the requests 1 draft and half 5 over 3 each, which pays only if a later step is nearly free,
and ran at 0.68x k 3); drafts are accepted with a forced probability, one coin per request and position (as
benchmarks/lib/forced_acceptance.py: every mode meets the same positions). Each run is a steady-state window as
benchmarks/adaptive.py times it: B requests prefilled, WARM decode iterations, then TIMED ones timed, three rounds
per mode (median); the adaptive chooser learns in a run of its own first. The issue's targets: adaptive >= 0.97x the
best fixed k in {0..5} and >= 0.98x target-only in every cell, and the mixed batch faster than every fixed k."""

import dataclasses
import random
import statistics
from collections.abc import Callable

import pytest

from specsplit.coordinator.config import SchedulerConfig
from specsplit.coordinator.draft_choice import AdaptiveDraftCount, DraftPolicy
from specsplit.coordinator.iteration import VerifyResult
from specsplit.coordinator.request import Request, SamplingParams
from specsplit.coordinator.scheduler import Scheduler

K_MAX, WARM, TIMED, LEARN, PROMPT = 5, 8, 40, 64, 64
ROUND_SEEDS = (0, 2, 3)  # the rounds' noise
REPORTED = 0.1  # of the later steps' time, what the drafter reports
GRAPH_MS = {1: 4.3, 2: 4.35, 4: 4.4, 8: 4.8, 16: 4.9, 32: 5.1, 64: 5.6, 128: 6.0, 256: 8.2, 512: 14.5}
_coins = random.Random(1234)
COINS = [[_coins.random() for _ in range(2048)] for _ in range(128)]  # [request][position]


def later_step_s(batch: int) -> float:
    return (0.35 + 0.004 * batch) * 1e-3


def iteration_s(num_tokens: int, batch: int, proposes: bool, later_steps: int, rng: random.Random) -> float:
    """The iteration's time; `num_tokens` the tokens the verifier's step costs as."""
    ms = next((t for size, t in GRAPH_MS.items() if num_tokens <= size), 22.0 + 0.03 * (num_tokens - 512))
    ms += 0.3 + 0.015 * batch
    if proposes:
        ms += 0.6 + 0.01 * batch
    return (ms * 1e-3 + later_steps * later_step_s(batch)) * rng.uniform(0.97, 1.03)


def server_config(batch: int, max_num_batched_tokens: int, adaptive: bool) -> SchedulerConfig:
    """A server of `batch` slots, k up to K_MAX, KV for every request."""
    return SchedulerConfig(
        max_model_len=4096,
        block_size=16,
        num_blocks=1 << 16,
        num_speculative_tokens=K_MAX,
        max_num_seqs=batch,
        max_num_batched_tokens=max_num_batched_tokens,
        adaptive=adaptive,
    )


def tokens_per_s(
    alphas: list[float],
    k: int | None,
    chooser: DraftPolicy | None,
    timed: int,
    seed: int = 0,
    ragged_cost=False,
    slow_iterations: int = 0,
    pace: Callable[[], float] | None = None,
) -> float:
    """A steady-state window; `k` None: adaptive (with `chooser`'s state), else every request k drafts. `ragged_cost`:
    the verifier's step costs as if every request verified as many drafts as the one with the most (a cost the
    drafter's report of its later steps does not show; the H200 runs of benchmarks/adaptive.py had one of that
    shape: a batch where half the requests verified 1 draft and half 5 took as long as one where all verified 5).
    `slow_iterations`: the window's first iterations take 1.3x as long (a slow moment: clocks coming up). `pace`: the
    machine's speed, called once per iteration (docs/design.md §9's drift): the chooser sees every time scaled by it
    (the drafter's report too), the window is scored at the unscaled times (how well it chose, not how fast the
    machine was meanwhile)."""
    rng, batch = random.Random(seed), len(alphas)
    config = server_config(batch, batch * (PROMPT + K_MAX + 1), adaptive=k is None)  # the prefill in one iteration
    s = Scheduler(config, [1 << 30], chooser)
    horizon = (WARM + max(timed, LEARN) + 2) * (K_MAX + 1)  # benchmarks/adaptive.py's: the tokens left weigh as there
    for i in range(batch):
        params = SamplingParams(max_tokens=horizon, ignore_eos=True, num_speculative_tokens=k)
        s.add_request(Request(str(i), list(range(1, PROMPT + 1)), params))
    seconds, tokens = 0.0, 0
    for step in range(1 + WARM + timed):
        out = s.schedule()
        s.choose_ahead(out)  # as the engines do, once the step is on its way: the next choice one iteration behind
        cost_tokens = out.num_scheduled_tokens
        if ragged_cost:
            cost_tokens = len(out.scheduled) * (1 + max(item.num_draft_tokens for item in out.scheduled))
        t = iteration_s(cost_tokens, len(out.scheduled), out.proposes, out.num_later_steps, rng)
        if step < slow_iterations:
            t *= 1.3
        seen = 1.0 if pace is None else pace()
        results = verify(out, alphas)
        s.update_from_output(out, results)
        later = out.num_later_steps if out.proposes else 0
        reported = later_step_s(len(out.scheduled)) * later * REPORTED
        s.record_iteration(out, t * seen, out.proposes, later, reported * seen)
        if step > WARM:
            seconds += t
            tokens += sum(len(res.sampled_token_ids) for res in results)
    return tokens / seconds


def verify(out, alphas: list[float]) -> list[VerifyResult]:
    """The step's results: each request's drafts accepted while its coins at their positions fall below its alpha (the
    request's index ends its id); a prefill chunk short of its prompt's end samples nothing."""
    results = []
    for item in out.scheduled:
        if not item.sample:
            results.append(VerifyResult(item.request.request_id, [], 0, 0))
            continue
        r, position, accepted = int(item.request.request_id.rsplit("-", 1)[-1]), len(item.request.output_token_ids), 0
        while accepted < item.num_draft_tokens and COINS[r][position + accepted] < alphas[r]:
            accepted += 1
        n = item.num_draft_tokens
        results.append(VerifyResult(item.request.request_id, [7] * (accepted + 1), n - accepted, n))
    return results


def median_over_rounds(alphas: list[float], k: int | None, chooser: DraftPolicy | None, timed: int, ragged_cost: bool):
    """A mode's tokens/s: the median of its windows, one per seed of ROUND_SEEDS (`chooser` goes on learning)."""
    return statistics.median(tokens_per_s(alphas, k, chooser, timed, seed, ragged_cost) for seed in ROUND_SEEDS)


# The grid with a mixed batch costing as its deepest request (as the H200 run showed), then cells of the cost as
# the sum says (the drafter's later steps still under-reported).
GRID = [(f"alpha {a}, batch {b}", [a] * b, True) for a in (0.3, 0.6, 0.9) for b in (1, 8, 32, 64, 128)]
SUM_CELLS = [
    ("alpha 0.3, batch 1, the sum's cost", [0.3], False),  # one draft pays a little
    ("alpha 0.3, batch 128, the sum's cost", [0.3] * 128, False),  # no draft pays: target-only's speed
    ("alpha 0.6, batch 32, the sum's cost", [0.6] * 32, False),
    ("alpha 0.9, batch 64, the sum's cost", [0.9] * 64, False),
    ("alpha 0.9, batch 128, the sum's cost", [0.9] * 128, False),  # 3 drafts (512 tokens, a graph), not 5 (eager)
]
MIXED = [
    ("mixed 0.9 / 0.2, batch 32", [0.9, 0.2] * 16, True),
    ("mixed 0.9 / 0.2, batch 32, the sum's cost", [0.9, 0.2] * 16, False),  # drafts for half: beats every fixed k
]


@pytest.mark.parametrize(("name", "alphas", "ragged_cost"), GRID + SUM_CELLS + MIXED)
def test_adaptive_against_every_fixed_k_on_a_simulated_h200(name, alphas, ragged_cost):
    """As benchmarks/adaptive.py measures: each mode's median over ROUNDS windows, adaptive going on learning from one
    to the next (a first-time trial, paid once by a server, lands in one window at most)."""
    timed = max(TIMED, 128 // len(alphas))
    fixed = {k: median_over_rounds(alphas, k, None, timed, ragged_cost) for k in range(K_MAX + 1)}
    chooser = AdaptiveDraftCount()
    tokens_per_s(alphas, None, chooser, LEARN, seed=1, ragged_cost=ragged_cost)  # learning
    adaptive = median_over_rounds(alphas, None, chooser, timed, ragged_cost)
    best = max(fixed, key=fixed.get)
    print(f"\n{name}: adaptive {adaptive:.0f} tok/s, best fixed k={best} {fixed[best]:.0f}, k=0 {fixed[0]:.0f}")
    assert adaptive >= 0.97 * fixed[best] and adaptive >= 0.98 * fixed[0]
    if name.startswith("mixed") and not ragged_cost:  # (with the ragged cost, drafts for half cost as for all)
        assert adaptive > max(fixed.values())


def test_no_drafts_first_timed_in_a_slow_moment_are_timed_again_soon():
    """Alpha 0.2, batch 32, the sum's cost (no draft pays): the learning run's first 12 iterations are 1.3x slow, and
    the sweep times no drafts first. Priced by that moment (a mean of its samples) and timed again only by every third
    shallower exploration, no drafts stayed dearer than 3 drafts each: 0.85x target-only over the first four windows.
    A close alternative timed longer ago than half the server's life is timed again every RETIME_EVERY choices, and
    no drafts cost what their recent steady runs took."""
    alphas = [0.2] * 32
    target_only = median_over_rounds(alphas, 0, None, TIMED, ragged_cost=False)
    chooser = AdaptiveDraftCount()
    tokens_per_s(alphas, None, chooser, LEARN, seed=1, slow_iterations=12)
    rounds = [tokens_per_s(alphas, None, chooser, TIMED, seed) for seed in ROUND_SEEDS]
    print(f"\nslow start at no drafts: rounds {[round(r) for r in rounds]}, target-only {target_only:.0f}")
    assert min(rounds) >= 0.98 * target_only


def test_a_depth_first_measured_in_a_slow_moment_is_chosen_again_once_measured_again(monkeypatch):
    """Alpha 0.6, batch 64, the 256-token step a little dearer than in the grid (k 1 then beats k 3 by 4 %, as on the
    H200's 2026-12-02 runs, where adaptive verified 3 drafts per request at 0.81-0.97x k 1): the learning run's first
    12 iterations are slow, among them the sweep's runs of depth 1. Exploring only deeper, nothing measured depth 1
    again and adaptive stayed at 3 for good (0.957x k 1 over 18 rounds); the shallower exploration measures it again
    and a steady run costs the least of its recent samples, so adaptive comes back to 1 drafts."""
    alphas = [0.6] * 64
    monkeypatch.setitem(GRAPH_MS, 256, 8.6)
    fixed = {k: median_over_rounds(alphas, k, None, TIMED, ragged_cost=True) for k in (1, 3)}
    chooser = AdaptiveDraftCount()
    tokens_per_s(alphas, None, chooser, LEARN, seed=1, ragged_cost=True, slow_iterations=12)
    rounds = [tokens_per_s(alphas, None, chooser, TIMED, seed, True) for seed in ROUND_SEEDS * 3]
    print(f"\nslow start: rounds {[round(r) for r in rounds]}, fixed {fixed}")
    assert fixed[1] > 1.03 * fixed[3]  # (the case: k 1 is the best by 4 %)
    assert statistics.median(rounds[-3:]) >= 0.97 * fixed[1]


@pytest.mark.parametrize("pace", [2.0, 1.3])
def test_a_machine_uniformly_faster_or_slower_changes_no_choice(pace):
    """The chooser compares times with times (rates, ratios, hiccups as multiples), never with a constant: every time it
    sees scaled by one factor, it chooses exactly as before (docs/design.md §9: what a pace that drifts costs)."""
    for alphas in ([0.6] * 8, [0.9, 0.2] * 16, [0.3] * 128):
        runs = []
        for scale in (None, lambda: pace):
            chooser = AdaptiveDraftCount()
            tokens_per_s(alphas, None, chooser, LEARN, seed=1, ragged_cost=True, pace=scale)
            runs.append([tokens_per_s(alphas, None, chooser, TIMED, seed, True, pace=scale) for seed in ROUND_SEEDS])
        assert runs[0] == runs[1]


@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("pace", [0.7, 1.0, 1.3])
def test_a_chooser_that_stopped_drafting_drafts_again_when_drafts_pay(batch, pace):
    """A long-running server whose drafter got better while the machine's speed changed (on a CPU `specsplit up`, every
    batch-1 request got zero drafts for good). The chooser learns with a drafter whose drafts are nearly all rejected
    (alpha 0.02: no draft pays, nobody drafts), then the drafter is good (alpha 0.9) and every time the chooser sees is
    scaled by `pace`. Before, the chooser explored drafts every 512 choices while nobody drafted and believed the few
    they verified against the many rejected before: at pace 0.7 (batch 1 and 32) and at pace 1 (batch 32) windows ran
    at 0.33-0.43x the best fixed k for about 450 iterations, then climbed a depth at a time (at pace 0.7 still
    0.56-0.65x after 14 windows). Now, from the third window (about 100 iterations after the change) every window runs
    at 0.95x the best fixed k or better."""
    good = [0.9] * batch
    best = max(median_over_rounds(good, k, None, TIMED, ragged_cost=False) for k in range(K_MAX + 1))
    chooser = AdaptiveDraftCount()
    tokens_per_s([0.02] * batch, None, chooser, LEARN, seed=1)
    ratios = [tokens_per_s(good, None, chooser, TIMED, seed, pace=lambda: pace) / best for seed in range(8)]
    print(f"\nbatch {batch}, pace {pace}: windows / best fixed k {[round(r, 2) for r in ratios]}")
    assert min(ratios[2:]) >= 0.95


def closed_batch(s: Scheduler, alphas: list[float], k: int | None, new: int, rng: random.Random, tag: str):
    """One closed batch through `s` as the services serve one (`benchmarks/adaptive.py --where services`): B requests
    of `new` tokens arrive together, their prompts prefilled in chunks of the server's token budget, and the batch
    runs until its last request ends (the tail of a shrinking batch included). Returns tokens/s over all of it."""
    for i, _ in enumerate(alphas):
        params = SamplingParams(max_tokens=new, ignore_eos=True, num_speculative_tokens=k)
        s.add_request(Request(f"{tag}-{i}", list(range(1, PROMPT + 1)), params))
    seconds = 0.0
    for _ in range(100 * new):  # (bounded: far more than a batch takes)
        if not s.has_work():
            break
        out = s.schedule()
        s.choose_ahead(out)
        t = iteration_s(out.num_scheduled_tokens, len(out.scheduled), out.proposes, out.num_later_steps, rng)
        s.update_from_output(out, verify(out, alphas))
        later = out.num_later_steps if out.proposes else 0
        s.record_iteration(out, t, out.proposes, later, later_step_s(len(out.scheduled)) * later * REPORTED)
        seconds += t
    assert not s.has_work()
    return len(alphas) * new / seconds


CLOSED_CELLS = [
    ("alpha 0.9, batch 32", [0.9] * 32),
    ("alpha 0.9, batch 128", [0.9] * 128),
    ("alpha 0.6, batch 32", [0.6] * 32),
]


@pytest.mark.parametrize(("name", "alphas"), CLOSED_CELLS)
def test_closed_batches_of_64_tokens_with_chunked_prefill(name, alphas):
    """Closed batches of 64 new tokens through the server's 512-token budget (the services' measurement: the prompts
    prefilled over several steps, the batch's tail shrinking), adaptive learning over two batches and timed over three
    more, against every fixed k (each the median of three batches). Before: at batch 128 the first iterations that
    proposed shared their steps with prefill chunks (not learned from), the Propose's cost stayed unknown and no drafts
    stayed chosen for good (0.84x k 3); at batch 32 the tail of every batch swept the shrinking batch's new token
    counts, mostly at no drafts (0.86x k 3 at alpha 0.9, 0.95x at 0.6; the services on the H100 ran 0.86x k 3 at alpha
    0.9, batch 32)."""
    batch, rng = len(alphas), random.Random(0)
    config = server_config(batch, max(512, batch * (K_MAX + 1)), adaptive=False)
    fixed_server = Scheduler(config, [1 << 30])
    fixed = {
        k: statistics.median(closed_batch(fixed_server, alphas, k, 64, rng, f"k{k}.{r}") for r in range(3))
        for k in range(K_MAX + 1)
    }
    server = Scheduler(dataclasses.replace(config, adaptive=True), [1 << 30], AdaptiveDraftCount())
    for r in range(2):
        closed_batch(server, alphas, None, 64, rng, f"learn{r}")
    adaptive = statistics.median(closed_batch(server, alphas, None, 64, rng, f"timed{r}") for r in range(3))
    best = max(fixed, key=fixed.get)
    print(f"\n{name}, closed batches: adaptive {adaptive:.0f} tok/s, best fixed k={best} {fixed[best]:.0f}")
    assert adaptive >= 0.97 * fixed[best] and adaptive >= 0.98 * fixed[0]
