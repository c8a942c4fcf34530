"""OpenHiddenTransport on a drafter whose step thread was busy: an open the verifier gave up on while it waited its
turn is refused at once, so the verifier's next open is joined within its own timeout (nccl on its CPU stand-in,
gloo, both ranks in this process). Joining the stale one instead (waiting out a rendezvous nobody holds) put every
later open one timeout behind the verifier's: no drafts for minutes after a drafter restarted on a loaded host."""

import asyncio
import threading

import grpc
import pytest
import torch

from specsplit.client.errors import Unavailable
from specsplit.drafter.runner import ProposeOutput
from specsplit.drafter.servicer import DrafterServicer
from specsplit.proto import common_pb2, drafter_pb2
from specsplit.transport import make_receiver, make_sender

HIDDEN = 8
TIMEOUT_S = 4.0  # the verifier's transport timeout: its join and its call give up after it
BUSY_S = 5.0  # the drafter's step thread is busy this long (> TIMEOUT_S: the first open's caller gives up)


class Runner:
    mtp = torch.nn.Linear(HIDDEN, HIDDEN)

    def free(self, request_ids):
        pass

    def propose(self, items, hidden_states):
        return ProposeOutput([[] for _ in items], (0, 0, 0))


class Context:
    """What the servicer reads of a unary call's context: its deadline, and abort."""

    def __init__(self, timeout_s: float):
        self.deadline = asyncio.get_running_loop().time() + timeout_s

    def time_remaining(self) -> float:
        return max(0.0, self.deadline - asyncio.get_running_loop().time())

    def invocation_metadata(self):
        return ()

    async def abort(self, code: grpc.StatusCode, message: str):
        raise Unavailable(f"{code.name}: {message}")


def test_an_open_the_verifier_gave_up_on_is_refused_and_the_next_one_joins():
    async def run():
        servicer = DrafterServicer("cpu")
        servicer.ready(Runner(), common_pb2.ModelInfo(vocab_size=10), make_receiver("nccl", "cpu", HIDDEN))
        sender = make_sender("nccl", rendezvous="127.0.0.1:0", backend="gloo", timeout_s=TIMEOUT_S)
        answers: list[str] = []

        async def call(request):  # the verifier's OpenHiddenTransport call, with its deadline
            try:
                await servicer.OpenHiddenTransport(request, Context(request.timeout_s))
                answers.append(f"{request.generation}: joined")
            except Unavailable as err:
                answers.append(f"{request.generation}: {err.message}")
                raise

        busy = threading.Event()

        def step():  # a step (a Propose, a warm-up) holding the model longer than the verifier waits
            with servicer._model_lock:
                busy.set()
                threading.Event().wait(BUSY_S)

        threading.Thread(target=step, daemon=True).start()
        busy.wait()
        rows = torch.ones(2, HIDDEN)
        try:
            with pytest.raises(RuntimeError):  # generation 1: gloo gave up on the drafter within TIMEOUT_S
                await sender.open(rows, call)
            await sender.open(rows, call)  # generation 2, sent while generation 1 still waits its turn there
            assert sender.generation == 2 and not sender.needs_open(rows)
            # Rows flow on generation 2.
            request = drafter_pb2.ProposeRequest()
            transfer = sender.send(rows * 3, request)
            got = await asyncio.get_running_loop().run_in_executor(None, servicer.receiver.receive, request)
            sender.finish(transfer, ok=True)
            assert torch.equal(got, rows * 3)
        finally:
            sender.close()
            servicer.receiver.close()
        assert answers[0].startswith("1: ") and "past the caller's deadline" in answers[0], answers
        assert answers[1:] == ["2: joined"], answers

    asyncio.run(run())
