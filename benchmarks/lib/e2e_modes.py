"""The benchmark's ways of running a batch: the engine objects in one process (target-only with
k = 0, or speculative), and the three services over loopback gRPC. Each returns a `RunResult` with
the outputs (for the lossless check), the speculative stats and a per-iteration time breakdown.

Breakdown (milliseconds per iteration; hops are one-way, from wall-clock stamps that the services
of one host share):
    coordinator      schedule() + post_step (+ the engine loop)
    hop_c2v          coordinator → verifier: VerifyRequest serialisation, transport, parsing
    drafts_wait      async scheduling: the Verify waiting for the previous Propose
    prepare          verifier: KV rollback + attention metadata (`StepOutput.prepare_ns`)
    forward          target forward + logits
    sample           rejection sampling (including the host copy of its result)
    verifier_other   input batch, hidden-state rows, ProposeRequest / VerifyResponse building
    hop_v2d          verifier → drafter: ProposeRequest (hidden states) to the drafter's handler
    step0            drafter MTP step 0 over the iteration's hidden states
    later_steps      drafter device time after step 0's forward: step 0's pick (constrained: its masks), steps 1..k-1
    drafter_other    drafter request parsing, hidden-state upload, forced acceptance, response
    hop_d2v          drafter → verifier: ProposeResponse
    hop_v2c          verifier → coordinator: VerifyResponse
    iteration        the whole iteration as the coordinator (or the in-process loop) sees it

With async scheduling (the services' default) the Propose columns (hop_v2d … hop_d2v) describe the
previous iteration's Propose, which overlapped the coordinator's work and hops; an iteration is then
drafts_wait + the verifier's step + the hops and coordinator around it.

With a device hand-off (greedy decode steps with `cuda_ipc`, and (c) alike) the drafter's steps wait for the
verifier's on the GPU: its step0 then includes the verifier's device time, and (c)'s sample column is 0.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from dataclasses import dataclass, field

import grpc
import torch

from benchmarks.lib.forced_acceptance import prompt_request_id
from specsplit import Client
from specsplit.client.results import SpecStats
from specsplit.coordinator.config import SchedulerConfig
from specsplit.engine.llm import LLM
from specsplit.proto import coordinator_pb2, coordinator_pb2_grpc

BREAKDOWN = (
    "coordinator",
    "hop_c2v",
    "drafts_wait",
    "prepare",
    "forward",
    "sample",
    "verifier_other",
    "hop_v2d",
    "step0",
    "later_steps",
    "drafter_other",
    "hop_d2v",
    "hop_v2c",
    "iteration",
)


@dataclass
class RunResult:
    seconds: float
    outputs: list[list[int]]  # per prompt, in order
    stats: SpecStats
    breakdown: list[dict[str, float]] = field(default_factory=list)  # per iteration, ms
    # The run's wall time that no iteration covers, ms.
    outside_iterations_ms: float = 0.0

    @property
    def num_iterations(self) -> int:
        return len(self.breakdown)


def _ms(ns: int) -> float:
    return ns / 1e6


def step_token_budget(max_batch: int, max_k: int) -> int:
    """The scheduler's token budget per step (`--max-num-batched-tokens`) in every mode of a run: the servers'
    default, what `specsplit up` ships (prefill chunks of at most 512 tokens replay CUDA graphs), raised only where
    one decode step of the largest batch would not fit it. (Runs before 2026-12-02 used 2048: the prompts of a
    batch of 32 were one eager step in one process and, arriving over a few iterations, two or three eager steps of
    30-80 ms in the services.)"""
    return max(SchedulerConfig.max_num_batched_tokens, max_batch * (max_k + 1))


class InProcessEngine:
    """`specsplit.LLM`: the services' iteration (their coordinator loop and verifier step) in one process, what
    disaggregation is measured against; k = 0 runs without a drafter (target-only)."""

    def __init__(
        self,
        model: str,
        device: str,
        dtype: torch.dtype,
        load_format: str,
        num_blocks: int,
        max_batch: int,
        max_k: int,
        block_size: int = 16,
        max_num_batched_tokens: int | None = None,  # default: step_token_budget
    ):
        # Built once (CUDA graphs are captured here, like at a server's start); every run frees all it used.
        self.llm = LLM(
            model,
            num_speculative_tokens=max_k,
            device=device,
            dtype=dtype,
            load_format=load_format,
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_batch,
            max_num_batched_tokens=max_num_batched_tokens or step_token_budget(max_batch, max_k),
            adaptive=False,  # every request k drafts (benchmarks/adaptive.py switches per run)
        )
        self.target, self.device = self.llm.target, device
        self.drafter = self.llm.drafter.runner if self.llm.drafter is not None else None
        self.wrap_drafter = lambda runner: runner  # e.g. forced acceptance

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def run(
        self, prompts: list[list[int]], new_tokens: int, k: int, structured_output: dict | None = None
    ) -> RunResult:
        """`structured_output`: what every output must match (`LLM.generate`'s), None for unconstrained runs."""
        if k > 0:
            self.llm.drafter.runner = self.wrap_drafter(self.drafter)
        self.llm.step.use_drafter(self.llm.drafter if k > 0 else None)
        self._sync()
        t_start = time.perf_counter()
        results = self.llm.generate(
            prompts,
            max_tokens=new_tokens,
            ignore_eos=True,
            num_speculative_tokens=k,
            detokenize=False,
            structured_output=structured_output,
        )
        self._sync()
        seconds = time.perf_counter() - t_start
        breakdown = [services_breakdown(t) for t in self.llm.iteration_timings]
        stats = SpecStats()
        for r in results:
            stats.merge(r.stats)
        outside = 1e3 * seconds - sum(row["iteration"] for row in breakdown)
        return RunResult(seconds, [r.token_ids for r in results], stats, breakdown, outside)


def services_breakdown(it: coordinator_pb2.IterationTiming) -> dict[str, float]:
    """One iteration of the services, from the coordinator's stamps and those relayed in VerifyTiming."""
    v = it.verifier
    verify = v.prepare_ns + v.forward_ns + v.sample_ns
    row = dict.fromkeys(BREAKDOWN, 0.0) | {
        "coordinator": _ms(it.verify_sent_ns - it.schedule_start_ns + it.post_step_end_ns - it.verify_received_ns),
        "hop_c2v": _ms(v.received_ns - it.verify_sent_ns),
        "drafts_wait": _ms(v.drafts_wait_ns),
        "prepare": _ms(v.prepare_ns),
        "forward": _ms(v.forward_ns),
        "sample": _ms(v.sample_ns),
        "hop_v2c": _ms(it.verify_received_ns - v.replied_ns),
        "iteration": _ms(it.post_step_end_ns - it.schedule_start_ns),
    }
    held = v.drafts_wait_ns > 0  # async scheduling: the Propose stamps are the previous iteration's
    own_propose = 0 if held else v.propose_received_ns - v.propose_sent_ns
    if v.drafter_received_ns:  # a drafter answered
        drafter = v.drafter_replied_ns - v.drafter_received_ns
        row |= {
            "verifier_other": _ms(v.replied_ns - v.received_ns - verify - v.drafts_wait_ns - own_propose),
            "hop_v2d": _ms(v.drafter_received_ns - v.propose_sent_ns),
            "step0": _ms(v.step0_ns),
            "later_steps": _ms(v.later_steps_ns),
            "drafter_other": _ms(drafter - v.step0_ns - v.later_steps_ns),
            "hop_d2v": _ms(v.propose_received_ns - v.drafter_replied_ns),
        }
    else:
        row["verifier_other"] = _ms(v.replied_ns - v.received_ns - verify - v.drafts_wait_ns)
    return row


def recent_iterations(address: str) -> list[coordinator_pb2.IterationTiming]:
    with grpc.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        return list(stub.GetStats(coordinator_pb2.GetStatsRequest(include_iterations=True), timeout=60).iterations)


_RUNS = itertools.count()


def run_services(
    address: str,
    prompts: list[list[int]],
    new_tokens: int,
    k: int,
    structured_output: dict | None = None,
    first_index: int = 0,
) -> RunResult:
    """B concurrent Generate calls (one thread and client each), then the coordinator's timings of their
    iterations. Each request's id names its prompt (a forced-acceptance drafter matches it by that). The clients
    are connected and their threads started before the run's clock starts, and released together: a server's
    clients hold their channels, and a client's own connection set-up is not the server's time (it spread the
    arrivals of 32 requests over three iterations on the H200). `structured_output`: every request's (the SDK's
    `structured_output=`), None for unconstrained runs. Prompt i's request names oracle sequence first_index + i."""
    tag = f"run{os.getpid()}.{next(_RUNS)}"
    before = max((it.iteration for it in recent_iterations(address)), default=0)
    outputs: list[list[int]] = [[] for _ in prompts]
    per_request = [SpecStats() for _ in prompts]
    errors: list[BaseException] = []
    clients = [Client(address, timeout=900) for _ in prompts]
    start = threading.Barrier(len(prompts) + 1, timeout=120)

    def one(i: int) -> None:
        try:
            start.wait()
            out = clients[i].generate(
                prompt_token_ids=prompts[i],
                max_tokens=new_tokens,
                ignore_eos=True,
                num_speculative_tokens=k,
                temperature=0.0,
                request_id=prompt_request_id(first_index + i, tag),
                structured_output=structured_output,
            )
            outputs[i], per_request[i] = list(out.token_ids), out.stats
        except BaseException as err:  # noqa: BLE001 (re-raised below, in the caller's thread)
            errors.append(err)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    try:
        for client in clients:
            client.model_info()  # the channel connected
        for t in threads:
            t.start()
        start.wait()
        t0, wall0 = time.perf_counter(), time.time_ns()
        for t in threads:
            t.join()
        seconds, wall1 = time.perf_counter() - t0, time.time_ns()
    finally:
        start.abort()  # (a thread still waiting, after a failure above, raises instead of hanging)
        for t in threads:
            if t.is_alive():
                t.join()
        for client in clients:
            client.close()
    if errors:
        raise errors[0]
    stats = SpecStats()
    for s in per_request:
        stats.merge(s)
    # The run's iterations are those that started before its last client returned (the coordinator's
    # stamps share this host's wall clock); the free-only iteration after it is not one of them. Their
    # time is clipped to the run's window, so one still running at its end counts only its part.
    timings = [it for it in recent_iterations(address) if it.iteration > before and it.schedule_start_ns < wall1]
    covered = sum(max(0, min(it.post_step_end_ns, wall1) - max(it.schedule_start_ns, wall0)) for it in timings)
    breakdown = [services_breakdown(it) for it in timings]
    return RunResult(seconds, outputs, stats, breakdown, _ms(wall1 - wall0 - covered))
