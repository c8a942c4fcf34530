"""A steady-state decode window on the in-process engine (the coordinator's loop, `Engine.step`, over the verifier's
step in this process), what benchmarks/adaptive.py times.

B requests (one per slot) are prefilled together (untimed), run `warm` decode iterations (untimed), then exactly
`timed` decode iterations are timed: the tokens they emitted over their wall time. Every request has more tokens
left than the window can emit (`horizon`), so none finishes and no prefill runs inside it: the window is the batch's
steady state, what adaptive speculation's rate is about, with no prefill chunk, no slot refilled and no tail of a
batch emptying. The garbage collector is off inside the window (collected just before).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import torch

from benchmarks.lib.forced_acceptance import prompt_request_id
from specsplit.client.results import SpecStats
from specsplit.coordinator.config import SchedulerConfig
from specsplit.coordinator.draft_choice import DraftPolicy
from specsplit.coordinator.engine import Engine
from specsplit.coordinator.request import Request, SamplingParams
from specsplit.coordinator.scheduler import Scheduler
from specsplit.engine.local import LocalVerifier
from specsplit.verifier.step import VerifierStep


@dataclass
class Window:
    tokens: int  # emitted inside the timed window
    seconds: float  # its wall time
    num_iterations: int
    drafts_per_request: float  # drafts verified per request and iteration inside the window
    draft_count_histogram: list[int] = field(default_factory=list)  # [d]: request-iterations that verified d
    outputs: list[list[int]] = field(default_factory=list)  # per request, every token it emitted (lossless check)
    prefill_seconds: float = 0.0
    warm_seconds: float = 0.0
    choose_seconds: float = 0.0  # adaptive: the chooser's host time inside the window, in `schedule` (between steps)
    ahead_seconds: float = 0.0  # adaptive: its host time in `choose_ahead` (while the device runs a step)

    @property
    def choose_ms_per_iteration(self) -> float:
        return 1e3 * self.choose_seconds / self.num_iterations

    @property
    def ahead_ms_per_iteration(self) -> float:
        return 1e3 * self.ahead_seconds / self.num_iterations

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def window_token_budget(max_batch: int, max_k: int) -> int:
    """The scheduler's token budget per step for windows: decode steps of the largest batch fit it twice over, so
    the (untimed) prefill of a window's prompts takes few steps. The budget changes nothing inside a timed window,
    whose decode steps take at most `max_batch` x (`max_k` + 1) tokens. (At the servers' 512, raised to 768 for a
    batch of 128 at 5 drafts, that batch took 56 steps to prefill while its first requests decoded in 55 of them.)"""
    return max(2048, 2 * max_batch * (max_k + 1))


def prefill_iterations(batch: int, prompt_len: int, budget: int, max_k: int) -> int:
    """At most this many steps prefill `batch` prompts of `prompt_len` tokens: in each, the requests already decoding
    take at most `batch` x (`max_k` + 1) tokens of the budget and the prompts the rest."""
    left = budget - batch * (max_k + 1)
    if left <= 0:
        raise ValueError(f"a budget of {budget} tokens does not fit a decode step of {batch} x {max_k + 1}")
    return -(-batch * prompt_len // left) + 1


def horizon(warm: int, timed: int, max_k: int, prefill: int) -> int:
    """max_tokens that no request reaches in `prefill` steps (requests prefilled early decode in the later ones),
    `warm` + `timed` decode iterations and the prefill's sampled token."""
    return (prefill + warm + timed + 1) * (max_k + 1)


def _stats(requests: list[Request]) -> SpecStats:
    total = SpecStats()
    for r in requests:
        total.merge(r.stats)
    return total


async def run_window(
    step: VerifierStep,
    config: SchedulerConfig,
    eos_token_ids: list[int],
    prompts: list[list[int]],
    k: int,
    chooser: DraftPolicy | None,
    warm: int,
    timed: int,
    max_tokens: int,
    sync=None,
    tag: str = "w",
) -> Window:
    """`k`: drafts per request (0: target-only, no drafter expected on `step`); `chooser`: adaptive speculation's
    state (with `config.adaptive`). Frees everything it used."""
    sync = sync or (lambda: None)
    scheduler = Scheduler(config, eos_token_ids, chooser)
    engine = Engine(scheduler, LocalVerifier(step, scheduler.eos_token_ids), None)
    requests = [
        Request(
            prompt_request_id(i, tag),  # so forced acceptance knows its prompt (benchmarks/lib/forced_acceptance.py)
            list(p),
            SamplingParams(max_tokens=max_tokens, ignore_eos=True, num_speculative_tokens=k),
        )
        for i, p in enumerate(prompts)
    ]
    for r in requests:
        engine.add_request(r)

    def decoding() -> bool:
        return all(r.num_computed_tokens == r.num_tokens - 1 for r in requests)

    spent = [0.0, 0.0]  # the chooser's time (adaptive) in choose and in choose_ahead, from the timed window's start
    if chooser is not None:

        def clocked(method, slot: int):
            def call(*args):
                t = time.perf_counter()
                out = method(*args)
                spent[slot] += time.perf_counter() - t
                return out

            return call

        chooser.choose, chooser.choose_ahead = clocked(chooser.choose, 0), clocked(chooser.choose_ahead, 1)

    try:
        t0 = time.perf_counter()
        for _ in range(len(prompts) * max(len(p) for p in prompts) + 1):  # prefill (bounded: a chunk per step)
            if decoding() and scheduler.num_waiting == 0:
                break
            await engine.step()
        else:
            raise RuntimeError("prefill did not finish")
        t1 = time.perf_counter()
        for _ in range(warm):
            await engine.step()
        before = _stats(requests)
        emitted = sum(len(r.output_token_ids) for r in requests)
        gc.collect()
        gc.disable()
        sync()
        spent[:] = [0.0, 0.0]
        t2 = time.perf_counter()
        try:
            for _ in range(timed):
                await engine.step()
            sync()
            t3 = time.perf_counter()
        finally:
            gc.enable()
        if any(r.is_finished for r in requests):
            raise RuntimeError("a request finished inside the window: raise its max_tokens")
        after = _stats(requests)
        num_req_iterations = after.num_iterations - before.num_iterations
        histogram = [
            n - (before.draft_count_histogram[d] if d < len(before.draft_count_histogram) else 0)
            for d, n in enumerate(after.draft_count_histogram)
        ]
        return Window(
            tokens=sum(len(r.output_token_ids) for r in requests) - emitted,
            seconds=t3 - t2,
            num_iterations=timed,
            drafts_per_request=(after.num_draft_tokens - before.num_draft_tokens) / max(1, num_req_iterations),
            draft_count_histogram=histogram,
            outputs=[list(r.output_token_ids) for r in requests],
            prefill_seconds=t1 - t0,
            warm_seconds=t2 - t1,
            choose_seconds=spent[0],
            ahead_seconds=spent[1],
        )
    finally:
        if chooser is not None:
            del chooser.choose, chooser.choose_ahead  # the class's again (a copy of the chooser must not call these)
        for r in requests:
            engine.abort(r.request_id)
        for _ in range(4):  # the iteration that frees them (bounded: one is enough)
            if not scheduler.has_work():
                break
            await engine.step()


def cuda_sync(device: str):
    return torch.cuda.synchronize if device.startswith("cuda") else None
