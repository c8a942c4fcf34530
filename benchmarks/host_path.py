"""Host time of the verifier and the drafter around their GPU work, per phase, on CPU: the services' own code
for one decode iteration at a batch size, the GPU work stubbed out.

What `benchmarks/iteration_profile.py` shows on an H200: in the services the GPU idles while one side's host
works (at batch 32, 5.4 ms of a 12.3 ms iteration). This measures that host work without a GPU: the real
verifier worker and runner, drafter runner and servicer functions, on the demo checkpoint's configuration, with
the target forward, the rejection sampler and the MTP steps replaced by stubs that return tensors of the right
shape at once (every draft accepted, so every iteration runs k drafts per request), and KV caches that hold one
number per token (their contents are never read: the model work is stubbed). Phases, in the order of an
iteration, each a median over the timed iterations:

  verifier  answer read    the previous Propose's answer parsed, its drafts merged and held (`wait`)
            drafts->fwd    held drafts into the early plan, logits plan, input upload, KV upload, up to the
                           target forward's launch
            Propose out    the Propose of the launched step built and serialised (device hand-off; on the host
                           path after the sampled tokens, from the step's output)
            answer         the sampled tokens to the host, the step's output, the VerifyResponse built and
                           serialised
            (plan ahead    the step planned while the drafts are on their way)
  drafter   parse          ProposeRequest parsed and validated
            to step 0      propose() up to the MTP step 0 launch (rollback, KV plan, uploads)
            later steps    steps 1..k-1 planned, uploaded and launched, the drafts to the host, collected
            answer         ProposeResponse built and serialised

Which of them leave the GPU idle depends on what the other side has queued meanwhile: the verifier's answer read
and drafts->fwd always (its forward waits for the drafts, and the drafter's GPU work is done), the drafter's
phases on the host path (it gets the Propose once the verifier's GPU work is done) and its parse, answer and the
end of its later steps on the device hand-off, where it plans step 0 while the verifier's step runs and its later
steps while step 0 runs. `plan ahead` runs while the drafter has the GPU.

`hand-off` is the co-located greedy path (the drafter gets the step's tokens on the device, the Propose goes out
before sampling); `host` is the pooled path (or any sampled batch): the Propose carries the sampled tokens.

    python benchmarks/host_path.py --batches 1 32 128 --k 3 [--paths hand-off host] [--profile]
prints a table of median milliseconds per phase; with $OUT set it also writes host_path.md there.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this tree's specsplit, whichever is installed

import torch  # noqa: E402

import specsplit.verifier.runner as verifier_runner  # noqa: E402
from specsplit.drafter.runner import DrafterRunner  # noqa: E402
from specsplit.drafter.servicer import parse_items, propose_response  # noqa: E402
from specsplit.grpc_server import freeze_start_up_heap  # noqa: E402
from specsplit.models.kv_cache import PagedKVCache  # noqa: E402
from specsplit.models.loader import load_mtp, load_target  # noqa: E402
from specsplit.proto import common_pb2, drafter_pb2, verifier_pb2  # noqa: E402
from specsplit.transport.base import DeviceTokens  # noqa: E402
from specsplit.verifier.drafter_client import DrafterClient, sampling_of  # noqa: E402
from specsplit.verifier.proposal import Proposal, merge_replica_drafts  # noqa: E402
from specsplit.verifier.response import verify_response  # noqa: E402
from specsplit.verifier.runner import VerifierRunner  # noqa: E402
from specsplit.verifier.worker import VerifierWorker  # noqa: E402

CHECKPOINT = ROOT / "checkpoints" / "demo"
BLOCK_SIZE = 16
BONUS = 7  # the stub sampler's bonus token
VERIFIER_PHASES = ["answer read", "drafts->fwd", "Propose out", "answer"]
DRAFTER_PHASES = ["parse", "to step 0", "later steps", "answer"]
OFF_PATH = "plan ahead"
# The thread's CPU time, not the wall clock: on a shared machine, time the thread waits for a core is not counted.
clock = time.thread_time_ns


class Stubs:
    """The GPU work replaced: the target forward, the rejection sampler, the MTP steps and head. Each stub
    stamps when it is called, so the phases around it are timed without it."""

    def __init__(self, hidden_size: int, max_tokens: int):
        # Outputs are views of tensors made once: the stubs cost next to nothing.
        self.hidden = torch.zeros(max_tokens, hidden_size)
        self.logits = torch.zeros(max_tokens, 16)
        self.logits[:, 11] = 1  # every draft is token 11
        self.forward_called = 0
        self.mtp_calls: list[int] = []

    def forward(self, input_ids, positions, attn, logits_indices):
        self.forward_called = clock()
        return self.hidden[: input_ids.shape[0]], self.logits[: logits_indices.shape[0]]

    @staticmethod
    def rejection_sample(logits, draft_token_ids, cu_num_draft, *args, **kwargs):
        """Every draft accepted, then the bonus token (the batch has the same drafts per request here)."""
        n = cu_num_draft.shape[0] - 1
        d = draft_token_ids.shape[0] // n
        sampled = torch.cat([draft_token_ids.view(n, d), torch.full((n, 1), BONUS)], dim=1)
        return SimpleNamespace(sampled=sampled, num_sampled=torch.full((n,), d + 1))

    def mtp_step(self, input_ids, previous_hidden, positions, attn):
        self.mtp_calls.append(clock())
        return self.hidden[: input_ids.shape[0]], None, False  # (MTP output, logits of a graph, whether a graph ran)

    def compute_logits(self, hidden):
        return self.logits[: hidden.shape[0]]


def tiny_cache(num_blocks: int) -> PagedKVCache:
    """A cache whose block accounting is real and whose tensors hold one number per token (never read)."""
    return PagedKVCache(1, 1, 1, num_blocks, BLOCK_SIZE, torch.float32, "cpu")


def decode_message(iteration: int, batch: int, k: int, positions: list[int]) -> verifier_pb2.VerifyRequest:
    """A decode iteration as the coordinator sends it: each request's last token and k held-draft placeholders."""
    msg = verifier_pb2.VerifyRequest(coordinator_id="bench", iteration=iteration)
    for i in range(batch):
        msg.requests.add(
            request_id=f"r{i}",
            token_ids=[BONUS],
            num_computed_tokens=positions[i],
            num_held_drafts=k,
            sample=True,
            num_spec_tokens=k,
            sampling=common_pb2.SamplingParams(top_p=1.0),
        )
    return msg


def prefill_message(batch: int, context: int, k: int) -> verifier_pb2.VerifyRequest:
    msg = verifier_pb2.VerifyRequest(coordinator_id="bench", iteration=1)
    for i in range(batch):
        msg.requests.add(
            request_id=f"r{i}",
            token_ids=[(i * 31 + j) % 4000 + 3 for j in range(context)],
            sample=True,
            num_spec_tokens=k,
            sampling=common_pb2.SamplingParams(top_p=1.0),
        )
    return msg


def on_device_message(plan, msg: drafter_pb2.ProposeRequest) -> None:
    """What the cuda_ipc transport adds to a device hand-off's Propose (the handle; no bytes)."""
    handle = msg.hidden_states_handle
    handle.generation, handle.sequence, handle.num_rows = 1, 1, plan.hidden_states.shape[0]
    handle.hidden_size, handle.tokens_on_device = plan.hidden_states.shape[1], True
    handle.token_width = plan.sampled.shape[1]


def run(batch: int, k: int, context: int, iterations: int, hand_off: bool, models, profiler=None) -> dict:
    """Median ms per phase over `iterations` decode iterations after two warm-up ones."""
    sampler, verifier_runner.rejection_sample = verifier_runner.rejection_sample, Stubs.rejection_sample
    try:
        return _run(batch, k, context, iterations, hand_off, models, profiler)
    finally:
        verifier_runner.rejection_sample = sampler
        models[1].__dict__.pop("compute_logits", None)  # the stub set on the MTP module


def _run(batch: int, k: int, context: int, iterations: int, hand_off: bool, models, profiler) -> dict:
    target, mtp = models
    vocab = target.config.vocab_size
    stubs = Stubs(target.config.hidden_size, batch * max(context, k + 1))
    num_blocks = batch * ((context + (iterations + 4) * (k + 1)) // BLOCK_SIZE + 2)
    runner = VerifierRunner(target, tiny_cache(num_blocks), sampler_backend="reference", attention_kernel=hand_off)
    runner.forward = stubs.forward
    worker = VerifierWorker(runner, vocab_size=vocab, max_model_len=1 << 20, device="cpu")
    drafter = DrafterRunner(mtp, tiny_cache(num_blocks), attention_kernel=hand_off, cuda_graphs=False)
    drafter._mtp_step = stubs.mtp_step
    mtp.compute_logits = stubs.compute_logits
    client = DrafterClient(None)
    client.transport.device_hand_off = hand_off  # what an open cuda_ipc transport to the same GPU says
    client.transport.needs_open = lambda rows: False
    times: dict[str, list[float]] = defaultdict(list)

    def ms(t0: int, t1: int) -> float:
        return (t1 - t0) / 1e6

    def propose(plan, msg_bytes: bytes):
        """The drafter's side of one Propose; returns its answer's bytes."""
        t0 = clock()
        msg = drafter_pb2.ProposeRequest.FromString(msg_bytes)
        items = parse_items(msg, vocab)
        t1 = clock()
        rows = plan.hidden_states
        stubs.mtp_calls.clear()
        if plan.sampled is not None:
            out = drafter.propose(items, rows, DeviceTokens(plan.sampled, plan.num_sampled))
        else:
            out = drafter.propose(items, rows)
        t2 = clock()
        answer = propose_response(items, out, 0).SerializeToString()
        t3 = clock()
        if record:
            times["d:parse"].append(ms(t0, t1))
            step0 = stubs.mtp_calls[0]
            times["d:to step 0"].append(ms(t1, step0))
            times["d:later steps"].append(ms(step0, t2))
            times["d:answer"].append(ms(t2, t3))
        return answer

    # Iteration 1: every prompt prefilled, its Propose answered (not timed).
    record = False
    msg = prefill_message(batch, context, k)
    batch_, launched, _ = worker.launch(msg)
    step = worker.finish(batch_, launched)
    plan = client.build_request(1, batch_, step, sampling_of(msg))
    answer = propose(plan, plan.message(list(range(batch)), []).SerializeToString())
    held_batch, held_step = batch_, step  # its answer's drafts are held at iteration 2
    positions = [context] * batch
    for iteration in range(2, iterations + 4):
        record = iteration >= 4
        if record and profiler is not None:
            profiler.enable()
        msg = decode_message(iteration, batch, k, positions)
        t0 = clock()
        early = worker.plan_early(msg)
        t1 = clock()
        # the previous Propose's answer (its drafts are held now; in the services, `proposer.wait`)
        response = drafter_pb2.ProposeResponse.FromString(answer)
        proposal = Proposal(True, [[] for _ in range(batch)], draft_probs=[None] * batch)
        merge_replica_drafts(proposal, list(range(batch)), response)
        worker.keep(held_batch, held_step, proposal.drafts, proposal.draft_probs)
        t2 = clock()
        batch_, launched, unfilled = worker.launch(msg, early)
        assert early.used and not any(unfilled), "the early plan was not used: the benchmark's batch is off"
        t3 = stubs.forward_called
        t4 = clock()
        plan = client.device_plan(iteration, launched, sampling_of(msg)) if hand_off else None
        if plan is not None:
            propose_msg = plan.message(list(range(batch)), [])
            on_device_message(plan, propose_msg)
            propose_bytes = propose_msg.SerializeToString()
        t5 = clock()
        step = worker.finish(batch_, launched, with_rows=plan is None)
        t6 = clock()
        if plan is None:
            plan = client.build_request(iteration, batch_, step, sampling_of(msg))
            propose_bytes = plan.message(list(range(batch)), []).SerializeToString()
        t7 = clock()
        verify_response(batch_, step, Proposal(True, []), 0, unfilled).SerializeToString()
        t8 = clock()
        if record:
            times[f"v:{OFF_PATH}"].append(ms(t0, t1))
            times["v:answer read"].append(ms(t1, t2))
            times["v:drafts->fwd"].append(ms(t2, t3))
            times["v:Propose out"].append(ms(t4, t5) + ms(t6, t7))
            times["v:answer"].append(ms(t5, t6) + ms(t7, t8))
        assert plan.sampled is not None or not hand_off, "no device hand-off: the benchmark's batch is off"
        answer = propose(plan, propose_bytes)
        if record and profiler is not None:
            profiler.disable()
        held_batch, held_step = batch_, step
        positions = [p + k + 1 for p in positions]
    return {name: statistics.median(values) for name, values in times.items()}


def table(results: dict, batches: list[int], paths: list[str]) -> str:
    columns = [(b, p) for p in paths for b in batches]
    head = "| phase | " + " | ".join(f"b{b} {p}" for b, p in columns) + " |"
    lines = [head, "|---" * (len(columns) + 1) + "|"]
    for side, phases in (("v", VERIFIER_PHASES), ("d", DRAFTER_PHASES)):
        for phase in phases:
            row = [f"{results[c][f'{side}:{phase}']:.3f}" for c in columns]
            lines.append(f"| {'verifier' if side == 'v' else 'drafter'}: {phase} | " + " | ".join(row) + " |")
        total = [f"**{sum(results[c][f'{side}:{p}'] for p in phases):.3f}**" for c in columns]
        lines.append(f"| {'verifier' if side == 'v' else 'drafter'}: all of these | " + " | ".join(total) + " |")
    lines.append(
        f"| verifier: {OFF_PATH} (beside the drafter's GPU work) | "
        + " | ".join(f"{results[c][f'v:{OFF_PATH}']:.3f}" for c in columns)
        + " |"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--paths", nargs="+", choices=["hand-off", "host"], default=["hand-off", "host"])
    parser.add_argument("--profile", action="store_true", help="cProfile the timed iterations (both services)")
    args = parser.parse_args()
    if args.k < 1 or args.iterations < 1 or args.context < 1 or min(args.batches) < 1:
        parser.error("--k, --iterations, --context and every batch must be >= 1")
    torch.set_num_threads(1)
    models = load_target(CHECKPOINT), load_mtp(CHECKPOINT)
    freeze_start_up_heap()  # as each service does once loaded
    profiler = cProfile.Profile() if args.profile else None
    results = {}
    for path in args.paths:
        for b in args.batches:
            results[(b, path)] = run(b, args.k, args.context, args.iterations, path == "hand-off", models, profiler)
    text = (
        f"k {args.k}, context {args.context}, greedy, every draft accepted: host ms per phase "
        f"(median of {args.iterations} iterations)\n\n" + table(results, args.batches, args.paths)
    )
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "host_path.md").write_text(text + "\n")
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
    gc.unfreeze()  # the frozen heap collected at exit (else extension types report leaks)


if __name__ == "__main__":
    main()
