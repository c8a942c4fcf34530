"""One iteration, written once: the coordinator's loop (`Engine.step`) over the verifier's step makes the same
scheduling and draft-count decisions in one process (`specsplit.engine.local`) as through the services (a verifier
and a drafter process, gRPC between them), given the same step costs: adaptive speculation's choices depend on
measured times, so both runs are fed the same made-up ones."""

import asyncio
import pathlib
import time

import grpc

import specsplit
from specsplit.cli.launcher import LocalCluster
from specsplit.coordinator.config import SchedulerConfig
from specsplit.coordinator.engine import Engine
from specsplit.coordinator.request import Request, SamplingParams
from specsplit.coordinator.scheduler import Scheduler
from specsplit.coordinator.verify_stream import RpcVerifier
from specsplit.engine.local import LocalVerifier
from specsplit.proto import common_pb2, verifier_pb2_grpc

# The trained demo checkpoint: its drafts are often accepted, so acceptance, and the choices made from it, depend
# on the drafts each side really verified.
DEMO = pathlib.Path(__file__).resolve().parents[2] / "checkpoints" / "demo"
K = 3
TEXTS = [
    "def read_lines(path):\n",
    "import os\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "for i in range(10):\n",
    "def add(a, b):\n",
]
MAX_TOKENS = [24, 40, 16, 32, 28]
CONFIG = SchedulerConfig(
    max_model_len=256,
    block_size=16,
    num_blocks=64,
    num_speculative_tokens=K,
    max_num_seqs=4,  # five requests: one waits for a slot
    max_num_batched_tokens=12,  # the long prompt prefills in chunks beside decoding requests
    adaptive=True,
)


def fixed_costs(scheduler: Scheduler) -> None:
    """The scheduler's cost record, fed a time made from the iteration's shape instead of the clock's."""
    record = scheduler.record_iteration

    def made_up(output, seconds, proposed=True, num_later_steps=0, later_steps_s=None, propose_s=None):
        seconds = 1e-3 * (2 + 0.05 * output.num_scheduled_tokens + 0.6 * num_later_steps + 0.4 * proposed)
        later = 0.6e-3 * num_later_steps if later_steps_s is not None else None
        record(output, seconds, proposed, num_later_steps, later, 0.4e-3 if propose_s is not None else None)

    scheduler.record_iteration = made_up


def decision(s) -> tuple:
    """What the scheduler decided for one request in one iteration."""
    return s.request.request_id, s.num_computed_tokens, len(s.token_ids), s.num_draft_tokens, s.num_spec_tokens


async def run_stream(make_verifier, eos_token_ids, prompts) -> tuple[list, list[list[int]]]:
    """The request stream through an engine over `make_verifier(eos)`: each iteration's decisions, each output."""
    scheduler = Scheduler(CONFIG, eos_token_ids)
    fixed_costs(scheduler)
    decisions = []
    schedule = scheduler.schedule

    def recorded():
        output = schedule()
        decisions.append(
            (
                sorted(output.finished_request_ids),
                [
                    (
                        s.request.request_id,
                        s.num_computed_tokens,
                        len(s.token_ids),
                        s.num_draft_tokens,
                        s.num_spec_tokens,
                    )
                    for s in output.scheduled
                ],
            )
        )
        return output

    scheduler.schedule = recorded
    engine = Engine(scheduler, make_verifier(scheduler.eos_token_ids), None)
    requests = [
        Request(f"r{i}", prompt, SamplingParams(max_tokens=n, ignore_eos=True))
        for i, (prompt, n) in enumerate(zip(prompts, MAX_TOKENS))
    ]
    for r in requests:
        engine.add_request(r)
    try:
        for _ in range(400):  # bounded: the stream needs well under a hundred iterations
            if not scheduler.has_work():
                break
            await engine.step()
        assert not scheduler.has_work(), "the request stream did not finish"
    finally:
        engine.verifier.close()
    assert all(r.finish_reason == "length" for r in requests), [(r.request_id, r.finish_reason) for r in requests]
    return decisions, [list(r.output_token_ids) for r in requests]


def through_services(cluster: LocalCluster, eos_token_ids, prompts):
    async def run():
        async with grpc.aio.insecure_channel(cluster.services["verifier"].address) as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            info = await stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=30)
            assert info.block_size == CONFIG.block_size and info.num_blocks >= CONFIG.num_blocks
            return await run_stream(lambda eos: RpcVerifier(stub, eos, timeout_s=60), eos_token_ids, prompts)

    return asyncio.run(run())


def test_one_process_and_the_services_make_the_same_decisions(tmp_path):
    llm = specsplit.LLM(DEMO, num_speculative_tokens=K, num_blocks=CONFIG.num_blocks, max_num_seqs=4)
    eos = llm.eos_token_ids
    prompts = [llm.tokenizer(text)["input_ids"] for text in TEXTS]
    in_process, outputs = asyncio.run(run_stream(lambda eos: LocalVerifier(llm.step, eos), eos, prompts))

    cluster = LocalCluster(DEMO, num_speculative_tokens=K, log_dir=tmp_path)
    try:
        cluster.start_drafter()
        cluster.start_verifier()
        cluster.wait_ready(list(cluster.services.values()), time.monotonic() + 300)
        services, service_outputs = through_services(cluster, eos, prompts)
    finally:
        cluster.stop()

    assert outputs == service_outputs
    assert len(in_process) == len(services)
    for i, (a, b) in enumerate(zip(in_process, services)):
        assert a == b, f"iteration {i + 1}: one process {a}, services {b}"
    # The stream exercised what the decisions are about: chunked prefill beside decoding, a waiting request, drafts
    # accepted (a request advancing by more than one token), adaptive speculation choosing other counts than the cap.
    scheduled = [item for _, items in in_process for item in items]
    advanced = {}
    for rid, computed, *_ in scheduled:
        advanced.setdefault(rid, []).append(computed)
    assert any(b - a > 1 for positions in advanced.values() for a, b in zip(positions[1:], positions[2:]))
    assert {spec for *_, spec in scheduled} - {K}
