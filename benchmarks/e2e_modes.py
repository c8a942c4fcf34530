"""The benchmark's ways of running a batch: the engine objects in one process (target-only with
k = 0, or speculative), and the three services over loopback gRPC. Each returns a `RunResult` with
the outputs (for the lossless check), the speculative stats and a per-iteration time breakdown.

Breakdown (milliseconds per iteration; hops are one-way, from wall-clock stamps that the services
of one host share):
    coordinator      schedule() + post_step (+ the engine loop)
    hop_c2v          coordinator → verifier: VerifyRequest serialisation, transport, parsing
    drafts_wait      async scheduling: the Verify waiting for its micro-batch's previous Propose
    prepare          verifier: KV rollback + attention metadata (`StepOutput.prepare_ns`)
    forward          target forward + logits
    sample           rejection sampling (including the host copy of its result)
    verifier_other   input batch, hidden-state rows, ProposeRequest / VerifyResponse building
    hop_v2d          verifier → drafter: ProposeRequest (hidden states) to the drafter's handler
    step0            drafter MTP step 0 over the iteration's hidden states
    later_steps      drafter MTP steps 1..k-1
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

import threading
import time
from dataclasses import dataclass, field

import grpc
import torch

from coordinator.config import SchedulerConfig
from coordinator.iteration import VerifyResult
from coordinator.request import Request, SamplingParams
from coordinator.scheduler import Scheduler
from coordinator.wire import verify_request
from drafter.device_propose import can_propose_on_device
from drafter.runner import DrafterRunner, ProposeItem
from models.loader import load_mtp, load_target
from models.step_upload import StepUpload
from models.transport.base import DeviceTokens
from protos import coordinator_pb2, coordinator_pb2_grpc
from specsplit import Client
from specsplit.results import SpecStats
from verifier.input_batch import build_input_batch
from verifier.runner import VerifierRunner

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
    # The run's wall time that no iteration covers, ms (negative only when micro-batches overlap theirs).
    outside_iterations_ms: float = 0.0

    @property
    def num_iterations(self) -> int:
        return len(self.breakdown)


def _ms(ns: int) -> float:
    return ns / 1e6


class InProcessEngine:
    """The services' objects wired directly: what disaggregation is measured against."""

    def __init__(
        self, model: str, device: str, dtype: torch.dtype, load_format: str, num_blocks: int, block_size: int = 16
    ):
        self.target = load_target(model, dtype=dtype, device=device, load_format=load_format)
        self.mtp = load_mtp(model, dtype=dtype, device=device, load_format=load_format)
        self.device, self.num_blocks, self.block_size = device, num_blocks, block_size
        self.wrap_drafter = lambda runner: runner  # e.g. forced acceptance
        self.device_hand_off = True  # as the services: the drafter's steps queued before the verifier's finish
        # Built once (CUDA graphs are captured here, like at a server's start); every run frees all it used.
        max_model_len = min(self.target.config.max_position_embeddings, 8192)
        self.verifier = VerifierRunner(
            self.target, self.target.make_kv_cache(num_blocks, block_size), max_model_len=max_model_len
        )
        self.drafter = DrafterRunner(self.mtp, self.mtp.make_kv_cache(num_blocks, block_size))
        self.upload = StepUpload(device)

    def _device_items(self, batch, k: int) -> list[ProposeItem] | None:
        """The drafter's items of a device hand-off (`drafter/device_propose.py`) where the services
        would make one (`DrafterClient.device_plan`: greedy decode steps that want drafts), else None."""
        rows = batch.hand_off_rows() if self.device_hand_off and k > 0 else None
        if rows is None:
            return None
        items = [
            ProposeItem(rid, batch.num_computed_tokens[i], [], batch.num_spec_tokens[i], num_rows=rows[i])
            for i, rid in enumerate(batch.req_ids)
        ]
        return items if can_propose_on_device(self.drafter, items) else None

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def run(self, prompts: list[list[int]], new_tokens: int, k: int) -> RunResult:
        cfg = self.target.config
        verifier, drafter = self.verifier, self.wrap_drafter(self.drafter)
        sched = Scheduler(
            SchedulerConfig(
                max_model_len=cfg.max_position_embeddings,
                block_size=self.block_size,
                num_blocks=self.num_blocks,
                num_speculative_tokens=k,
                max_num_seqs=len(prompts),
                max_num_batched_tokens=max(2048, len(prompts) * (k + 1)),
            ),
            eos_token_ids=[],
        )
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        requests = [Request(f"r{i}", p, params) for i, p in enumerate(prompts)]
        for request in requests:
            sched.add_request(request)
        breakdown = []
        self._sync()
        t_start = time.perf_counter()
        while sched.running or sched.waiting:
            t0 = time.time_ns()
            out = sched.schedule()
            t1 = time.time_ns()
            batch = build_input_batch(
                verify_request(out, "bench"),
                vocab_size=cfg.vocab_size,
                max_model_len=cfg.max_position_embeddings,
                num_cached_tokens=verifier.kv_cache.num_tokens,
                device=self.device,
                upload=self.upload,
            )
            verifier.free(out.finished_request_ids)
            drafter.free(out.finished_request_ids)
            drafts = [[] for _ in batch.req_ids]
            step0 = later = 0
            items = self._device_items(batch, k)
            if items is not None:  # the drafter's steps queued behind the verifier's, as the services do
                launched = verifier.launch(batch)
                t2 = time.time_ns()
                dev = DeviceTokens(launched.sampled, launched.num_sampled)
                proposal = drafter.propose(items, launched.hidden[: batch.query_start[-1]], dev)
                step = verifier.finish(launched, with_rows=False)  # done by now: the drafter waited for it
                drafts, step0, later = proposal.drafts, proposal.step0_ns, proposal.later_steps_ns
                sample_ns = 0  # the verifier's device time lands in the drafter's step 0, which waits for it
            else:
                step = verifier.step(batch)
                t2 = time.time_ns()
                sample_ns = step.sample_ns
            if k > 0 and items is None:
                items = [
                    ProposeItem(rid, step.start_positions[i], step.next_token_ids[i], batch.num_spec_tokens[i])
                    for i, rid in enumerate(batch.req_ids)
                ]
                proposal = drafter.propose(items, step.hidden_states)
                drafts, step0, later = proposal.drafts, proposal.step0_ns, proposal.later_steps_ns
            t3 = time.time_ns()
            results = [
                VerifyResult(rid, step.sampled_token_ids[i], step.num_rejected[i], drafts[i])
                for i, rid in enumerate(batch.req_ids)
            ]
            sched.update_from_output(out, results)
            t4 = time.time_ns()
            verify = step.prepare_ns + step.forward_ns + sample_ns
            breakdown.append(
                dict.fromkeys(BREAKDOWN, 0.0)
                | {
                    "coordinator": _ms(t1 - t0 + t4 - t3),
                    "prepare": _ms(step.prepare_ns),
                    "forward": _ms(step.forward_ns),
                    "sample": _ms(sample_ns),
                    "verifier_other": _ms(t2 - t1 - verify),
                    "step0": _ms(step0),
                    "later_steps": _ms(later),
                    "drafter_other": _ms(t3 - t2 - step0 - later),
                    "iteration": _ms(t4 - t0),
                }
            )
        self._sync()
        seconds = time.perf_counter() - t_start
        ids = [f"r{i}" for i in range(len(prompts))]  # the last finished requests were never freed by a schedule
        verifier.free(ids)
        drafter.free(ids)
        stats = SpecStats()
        for request in requests:
            stats.merge(request.stats)
        outside = 1e3 * seconds - sum(row["iteration"] for row in breakdown)
        return RunResult(seconds, [r.output_token_ids for r in requests], stats, breakdown, outside)


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


def run_services(address: str, prompts: list[list[int]], new_tokens: int, k: int) -> RunResult:
    """B concurrent Generate calls (one thread each), then the coordinator's timings of their iterations."""
    before = max((it.iteration for it in recent_iterations(address)), default=0)
    outputs: list[list[int]] = [[] for _ in prompts]
    per_request = [SpecStats() for _ in prompts]
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            with Client(address, timeout=900) as client:
                out = client.generate(
                    prompt_token_ids=prompts[i], max_tokens=new_tokens, ignore_eos=True, num_speculative_tokens=k
                )
            outputs[i], per_request[i] = list(out.token_ids), out.stats
        except BaseException as err:  # noqa: BLE001 (re-raised below, in the caller's thread)
            errors.append(err)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    t0, wall0 = time.perf_counter(), time.time_ns()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds, wall1 = time.perf_counter() - t0, time.time_ns()
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
