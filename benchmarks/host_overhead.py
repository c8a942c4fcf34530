"""Host (pure Python) time per iteration of the three services at one batch size, on CPU, without a
model: what the services add to an iteration besides GPU work and the network.

Each part runs the services' own code on fake data of the benchmark's shape (every request decodes
with k drafts, all accepted):
    coordinator   the engine loop's iteration: schedule, VerifyRequest building and serialisation,
                  VerifyResponse parsing, post_step, metrics, detokenization (a fake verifier answers)
    verifier      VerifyRequest parsing, input batch, the step's host bookkeeping after sampling,
                  ProposeRequest building, ProposeResponse parsing and merge, VerifyResponse building
    drafter       ProposeRequest parsing and validation, ProposeResponse building
(The hidden states' bytes are left out: they are the transport's cost, `benchmarks/two_gpu.py`.)

    python benchmarks/host_overhead.py --batch 64 --k 3 [--sampled] [--profile verifier]
prints the median milliseconds per iteration of each part.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import statistics
import time
import types
from pathlib import Path

import torch
from opentelemetry import trace

from specsplit.coordinator.config import SchedulerConfig
from specsplit.coordinator.engine import Engine
from specsplit.coordinator.request import Request, SamplingParams
from specsplit.coordinator.scheduler import Scheduler
from specsplit.drafter.runner import ProposeOutput
from specsplit.drafter.servicer import parse_items, propose_response
from specsplit.proto import drafter_pb2, verifier_pb2
from specsplit.transport.wire import tensor_to_proto
from specsplit.verifier.drafter_client import DrafterClient, sampling_of
from specsplit.verifier.input_batch import build_input_batch
from specsplit.verifier.proposal import Proposal, merge_replica_drafts
from specsplit.verifier.response import verify_response
from specsplit.verifier.runner import step_output

VOCAB = 151_936
HIDDEN = 64  # the rows' bytes are not timed; a small hidden size keeps the fake tensors cheap
PROMPT_LEN = 128
TOP_K = 16


def accept_all(request: verifier_pb2.VerifyRequest) -> verifier_pb2.VerifyResponse:
    """The fake verifier: every held draft there and accepted, a bonus token (built outside the timing)."""
    response = verifier_pb2.VerifyResponse(drafter_ok=True)
    for r in request.requests:
        last, n = r.token_ids[-1], r.num_held_drafts
        response.results.add(
            request_id=r.request_id,
            sampled_token_ids=[(last + 1 + j) % VOCAB for j in range(n + 1)],
            num_draft_tokens=n,
        )
    return response


def fill_held_drafts(msg: verifier_pb2.VerifyRequest, sampled: bool) -> None:
    """The verifier's held drafts put into their placeholders, as `HeldDrafts.fill` does (with q when sampled)."""
    for r in msg.requests:
        n = r.num_held_drafts
        if n:
            r.token_ids.extend((r.token_ids[-1] + 1 + j) % VOCAB for j in range(n))
            r.num_draft_tokens, r.num_held_drafts = n, 0
            if sampled:
                r.draft_probs.token_ids.CopyFrom(tensor_to_proto(torch.zeros(n, TOP_K, dtype=torch.int32)))
                r.draft_probs.probs.CopyFrom(tensor_to_proto(torch.full((n, TOP_K), 1 / TOP_K)))


class FakeStream:
    def __init__(self):
        self.requests = []

    async def send(self, request):
        self.requests.append(request.SerializeToString())  # serialisation is the coordinator's cost
        self._last = request

    async def receive(self):
        return accept_all(self._last)

    def close(self):
        pass


def coordinator_times(batch: int, k: int, sampled: bool, iterations: int, tokenizer) -> tuple[list[float], list]:
    """Runs the engine's iterations; returns ms per iteration without the fake verifier's time, and the
    serialised VerifyRequests (the verifier's input)."""

    async def run():
        config = SchedulerConfig(  # the whole batch prefills in the first iteration
            max_model_len=4096,
            block_size=16,
            num_blocks=100_000,
            num_speculative_tokens=k,
            adaptive=False,  # every request k drafts, as the fake verifier answers (the choice: draft_choice tests)
            max_num_seqs=batch,
            max_num_batched_tokens=batch * PROMPT_LEN,
        )
        engine = Engine(
            Scheduler(config, [tokenizer.eos_token_id or 0]), types.SimpleNamespace(VerifyStream=None), tokenizer
        )
        stream = FakeStream()
        engine._verify_stream = stream
        params = SamplingParams(max_tokens=100_000, ignore_eos=True, temperature=0.7 if sampled else 0.0)
        for i in range(batch):
            engine.add_request(Request(f"r{i}", [(i * 7919 + j) % 30_000 for j in range(PROMPT_LEN)], params))
        times = []
        fake_ns = 0
        original = stream.receive

        async def timed_receive():
            nonlocal fake_ns
            t = time.perf_counter_ns()
            response = await original()
            fake_ns += time.perf_counter_ns() - t
            return response

        stream.receive = timed_receive
        sched = engine.scheduler
        pending = []  # the previous iteration's outputs, streamed during this one (as the engine loop does)
        for _ in range(iterations + 2):  # prefill, the first decode, then the timed iterations
            fake_ns = 0
            t0 = time.perf_counter_ns()
            output = sched.schedule()
            pending = await engine._iteration(output, trace.INVALID_SPAN, time.time_ns(), pending)
            times.append((time.perf_counter_ns() - t0 - fake_ns) / 1e6)
        return times[2:], stream.requests[2:]

    return asyncio.run(run())


def verifier_times(requests: list[bytes], k: int, sampled: bool) -> list[float]:
    client = DrafterClient(None)
    times = []
    for iteration, data in enumerate(requests, start=1):
        t0 = time.perf_counter_ns()
        msg = verifier_pb2.VerifyRequest.FromString(data)
        fill_held_drafts(msg, sampled)
        batch = build_input_batch(msg, vocab_size=VOCAB, max_model_len=4096, num_cached_tokens=lambda rid: 10**6)
        sampled_ids = [[(i + j) % VOCAB for j in range(k + 1)] for i in range(len(batch.sampling_indices))]
        num_sampled = [k + 1] * len(batch.sampling_indices)
        step = step_output(batch, sampled_ids, num_sampled, torch.zeros(batch.query_start[-1], HIDDEN), (0, 0, 0, 0))
        plan = client.build_request(iteration, batch, step, sampling_of(msg))
        propose_msg = plan.message(list(range(batch.num_reqs)), [])
        propose_msg.SerializeToString()
        t1 = time.perf_counter_ns()
        reply = drafter_pb2.ProposeResponse.FromString(drafter_reply(propose_msg, k, sampled))
        t2 = time.perf_counter_ns()
        proposal = Proposal(True, [[] for _ in batch.req_ids], draft_probs=[None] * batch.num_reqs)
        merge_replica_drafts(proposal, list(range(batch.num_reqs)), reply)
        verify_response(batch, step, proposal, 0).SerializeToString()
        times.append((time.perf_counter_ns() - t0 - (t2 - t1)) / 1e6)
    return times


def drafter_reply(propose_msg, k: int, sampled: bool) -> bytes:
    return drafter_response(propose_msg, k, sampled).SerializeToString()


def fake_propose_output(items, k: int) -> ProposeOutput:
    drafts = [[(t + j) % VOCAB for j in range(k)] for t in range(len(items))]
    probs = [
        (torch.zeros(k, TOP_K, dtype=torch.int64), torch.full((k, TOP_K), 1 / TOP_K)) if it.temperature > 0 else None
        for it in items
    ]
    return ProposeOutput(drafts, (0, 0, 0), probs)


def drafter_response(propose_msg, k: int, sampled: bool) -> drafter_pb2.ProposeResponse:
    items = parse_items(propose_msg, VOCAB)
    return propose_response(items, fake_propose_output(items, k), 0)


def drafter_times(requests: list[bytes], k: int, sampled: bool) -> list[float]:
    client = DrafterClient(None)
    messages = []
    for iteration, data in enumerate(requests, start=1):  # the verifier's ProposeRequests, built untimed
        msg = verifier_pb2.VerifyRequest.FromString(data)
        fill_held_drafts(msg, sampled)
        batch = build_input_batch(msg, vocab_size=VOCAB, max_model_len=4096, num_cached_tokens=lambda rid: 10**6)
        sampled_ids = [[(i + j) % VOCAB for j in range(k + 1)] for i in range(len(batch.sampling_indices))]
        num_sampled = [k + 1] * len(batch.sampling_indices)
        step = step_output(batch, sampled_ids, num_sampled, torch.zeros(batch.query_start[-1], HIDDEN), (0,) * 4)
        plan = client.build_request(iteration, batch, step, sampling_of(msg))
        messages.append(plan.message(list(range(batch.num_reqs)), []).SerializeToString())
    times = []
    for data in messages:
        t0 = time.perf_counter_ns()
        msg = drafter_pb2.ProposeRequest.FromString(data)
        items = parse_items(msg, VOCAB)
        t1 = time.perf_counter_ns()
        out = fake_propose_output(items, k)  # stands for propose(): not timed
        t2 = time.perf_counter_ns()
        propose_response(items, out, 0).SerializeToString()
        times.append((time.perf_counter_ns() - t2 + t1 - t0) / 1e6)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--sampled", action="store_true", help="temperature 0.7: sampled drafts with sparse q")
    parser.add_argument("--tokenizer", default=str(Path(__file__).parent.parent / "checkpoints" / "demo"))
    parser.add_argument("--profile", choices=["coordinator", "verifier", "drafter"], help="cProfile one part")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    profiler = cProfile.Profile() if args.profile else None
    parts = {}
    for name in ("coordinator", "verifier", "drafter"):
        if profiler is not None and name == args.profile:
            profiler.enable()
        if name == "coordinator":
            times, requests = coordinator_times(args.batch, args.k, args.sampled, args.iterations, tokenizer)
        elif name == "verifier":
            times = verifier_times(requests, args.k, args.sampled)
        else:
            times = drafter_times(requests, args.k, args.sampled)
        if profiler is not None and name == args.profile:
            profiler.disable()
        parts[name] = statistics.median(times)
    mode = "sampled" if args.sampled else "greedy"
    print(f"batch {args.batch}, k {args.k}, {mode}: host ms per iteration (median of {args.iterations})")
    for name, ms in parts.items():
        print(f"  {name:12s} {ms:7.3f}")
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
