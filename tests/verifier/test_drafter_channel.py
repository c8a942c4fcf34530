"""specsplit.verifier.drafter_channel: the step thread's Proposes, on a co-located drafter's Unix socket
(SocketChannel) or through the event loop to pooled drafters (PoolChannel). Answers are taken in the
order the Proposes went out, each handed to its `on_answer` (the held drafts) on the step thread with the
drafts merged back; on the socket a drafter error, a drafter gone, no answer in time or a malformed answer
fail every Propose in flight with the status a call would have, and the next Propose reconnects; a pooled
Propose that raises is a failed Propose."""

import asyncio
import os
import threading
import time
import types

import grpc
import pytest
import torch

from specsplit.client.errors import FailedPrecondition
from specsplit.proto import common_pb2, drafter_pb2
from specsplit.rpc.threaded_stream import ThreadedLocalStreamServer
from specsplit.transport.grpc_bytes import GrpcSender
from specsplit.transport.wire import fill_tensor_proto, tensor_from_proto
from specsplit.verifier.drafter_pool import DrafterPool, Replica
from specsplit.verifier.pool_channel import PoolChannel
from specsplit.verifier.proposal import Proposal
from specsplit.verifier.propose_request import ProposeBatch
from specsplit.verifier.socket_channel import SocketChannel

ADDRESS = "127.0.0.1:1"


@pytest.fixture
def socket_path(tmp_path_factory):
    short = tmp_path_factory.getbasetemp() / "d"
    short.mkdir(exist_ok=True)
    return str(short / f"p{os.getpid()}.sock")


class FakeDrafter:
    """Answers each request's items with drafts [iteration, row count]; iteration 13 is refused,
    iteration 7 takes 0.5 s, iteration 9 answers one draft too few, iteration 11 answers a q of float token ids;
    records what it got."""

    def __init__(self):
        self.got: list[tuple[int, list[str], int]] = []

    def handle(self, request: drafter_pb2.ProposeRequest) -> drafter_pb2.ProposeResponse:
        rows = tensor_from_proto(request.hidden_states).shape[0]
        self.got.append((request.iteration, list(request.finished_request_ids), rows))
        if request.iteration == 13:
            raise FailedPrecondition("thirteen is refused")
        if request.iteration == 7:
            time.sleep(0.5)
        items = request.requests[:-1] if request.iteration == 9 else request.requests
        response = drafter_pb2.ProposeResponse(step0_ns=5, received_ns=1)
        for item in items:
            drafts = response.drafts.add(request_id=item.request_id, token_ids=[request.iteration, rows])
            if request.iteration == 11:
                fill_tensor_proto(drafts.draft_probs.token_ids, torch.zeros(2, 1))
                fill_tensor_proto(drafts.draft_probs.probs, torch.ones(2, 1))
        return response


class FakePool:
    """What SocketChannel uses of the DrafterPool: one replica (its stub names the socket), placing requests and
    recording calls."""

    def __init__(self, path: str):
        async def model_info(request, timeout):
            return common_pb2.ModelInfo(propose_socket=path)

        self.targets = [ADDRESS]
        self.replicas = {ADDRESS: Replica(ADDRESS, None, None, types.SimpleNamespace(GetModelInfo=model_info))}
        self.calls: list[tuple[str, int, str | None]] = []  # the record of each call
        self.assigned: list[list[str]] = []

    async def start(self):
        pass

    def assign(self, request_ids):
        self.assigned.append(request_ids)

    def record_call(self, address, num_reqs, error=None):
        self.calls.append((address, num_reqs, error))

    async def close(self):
        pass


def socket_channel(path: str, timeout_s: float = 5.0) -> SocketChannel:
    return SocketChannel(FakePool(path), GrpcSender(), timeout_s)


def plan(iteration: int, request_ids: list[str]) -> ProposeBatch:
    items = [drafter_pb2.ProposeItem(request_id=rid, next_token_ids=[1], num_spec_tokens=2) for rid in request_ids]
    return ProposeBatch(iteration, items, list(range(len(items) + 1)), torch.zeros(len(items), 4))


async def serve(path: str, drafter: FakeDrafter) -> ThreadedLocalStreamServer:
    server = ThreadedLocalStreamServer(
        path, drafter_pb2.ProposeRequest.FromString, drafter.handle, asyncio.Event(), 1 << 20
    )
    await server.start()
    return server


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_answers_come_in_send_order_with_their_drafts_and_frees_travel_along(socket_path):
    drafter, answered = FakeDrafter(), []
    direct = socket_channel(socket_path)

    async def main():
        server = await serve(socket_path, drafter)
        direct.replica.pending_free.extend(["gone"])
        await direct.prepare(["a", "b"])  # the step's requests placed on this drafter: their frees go to it
        a = direct.send(plan(1, ["a", "b"]), "A", answered.append, None)
        free_queue = direct.replica.pending_free
        free_queue.append("late")  # queued after A went out: B carries it
        b = direct.send(plan(2, ["c"]), "B", answered.append, None)  # pipelined: A not read yet
        free_queue.append("later")  # queued after B: no call carried it yet
        assert a.proposal is None  # not read yet
        proposal = await asyncio.to_thread(direct.wait, b)  # reads A's answer first
        done = direct.collect()
        await direct.close()
        await server.close()
        return a, b, proposal, done, free_queue

    a, b, proposal, done, free_queue = run(main())
    assert [p.context for p in answered] == ["A", "B"] and [p.context for p in done] == ["A", "B"]
    assert direct.pool.calls == [(ADDRESS, 2, None), (ADDRESS, 1, None)]  # collect() counts them in the pool
    assert direct.pool.assigned == [["a", "b"]]
    assert a.proposal.ok and a.proposal.drafts == [[1, 2], [1, 2]] and a.finished == ["gone"]
    assert proposal is b.proposal and proposal.ok and proposal.drafts == [[2, 1]]
    assert proposal.step0_ns == 5 and proposal.sent_ns > 0 and proposal.received_ns >= proposal.sent_ns
    assert drafter.got == [(1, ["gone"], 2), (2, ["gone", "late"], 1)]  # B sent again what A had not confirmed
    assert free_queue == ["later"]  # the loop drops answered frees (collect), and only those


@pytest.mark.parametrize(
    "iteration, timeout_s, code",
    [
        (13, 5.0, "FAILED_PRECONDITION: thirteen is refused"),
        (7, 0.1, "DEADLINE_EXCEEDED"),
        (9, 5.0, "returned 1"),
        (11, 5.0, "draft_probs"),
    ],
    ids=["drafter-error", "too-slow", "drafts-missing", "malformed-q"],
)
def test_a_failed_propose_fails_what_is_in_flight_and_the_next_one_reconnects(socket_path, iteration, timeout_s, code):
    drafter, answered = FakeDrafter(), []

    async def main():
        server = await serve(socket_path, drafter)
        direct = socket_channel(socket_path, timeout_s)
        await direct.prepare([])
        bad = direct.send(plan(iteration, ["a", "b"]), "bad", answered.append, None)
        behind = direct.send(plan(3, ["c"]), "behind", answered.append, None)
        await asyncio.to_thread(direct.wait, behind)
        await direct.prepare([])  # reconnects if the failure closed the connection
        after = direct.send(plan(4, ["d"]), "after", answered.append, None)
        await asyncio.to_thread(direct.wait, after)
        await direct.close()
        await server.close()
        return bad, behind, after

    bad, behind, after = run(main())
    assert not bad.proposal.ok and code in bad.proposal.error and bad.proposal.drafts == [[], []]
    if iteration not in (9, 11):  # a malformed answer fails only its own Propose; a broken stream fails all in flight
        assert not behind.proposal.ok and behind.proposal.drafts == [[]]
    else:
        assert behind.proposal.ok
    assert after.proposal.ok and after.proposal.drafts == [[4, 1]]
    assert [p.context for p in answered] == ["bad", "behind", "after"]


def test_no_drafter_is_a_failed_propose_and_a_drafter_back_is_found(socket_path):
    drafter, answered = FakeDrafter(), []

    async def main():
        direct = socket_channel(socket_path)
        await direct.prepare([])  # nobody listens: not connected
        lost = direct.send(plan(1, ["a"]), "lost", answered.append, None)
        server = await serve(socket_path, drafter)
        await direct.prepare([])
        found = direct.send(plan(2, ["a"]), "found", answered.append, None)
        await asyncio.to_thread(direct.wait, found)
        await direct.close()
        await server.close()
        return lost, found

    lost, found = run(main())
    assert not lost.proposal.ok and "UNAVAILABLE" in lost.proposal.error
    assert found.proposal.ok and [p.context for p in answered] == ["lost", "found"]
    assert grpc.StatusCode.UNAVAILABLE.name in lost.proposal.error


def test_a_drafter_the_pool_counts_out_gets_no_connection_until_a_probe_finds_it_back(socket_path):
    """Requests a drafter drafted for while the pool counted it out would have no owner there, and their frees
    would never reach it: its socket is not used until the pool has it healthy again."""
    drafter, answered = FakeDrafter(), []
    direct = socket_channel(socket_path)

    async def main():
        server = await serve(socket_path, drafter)
        direct.replica.healthy = False  # a failed call; the probe has not found it back
        await direct.prepare(["a"])
        out = direct.send(plan(1, ["a"]), "out", answered.append, None)
        direct.replica.healthy = True  # the probe found it SERVING
        await direct.prepare(["a"])
        back = direct.send(plan(2, ["a"]), "back", answered.append, None)
        await asyncio.to_thread(direct.wait, back)
        await direct.close()
        await server.close()
        return out, back

    out, back = run(main())
    assert not out.proposal.ok and "UNAVAILABLE" in out.proposal.error
    assert back.proposal.ok and [iteration for iteration, *_ in drafter.got] == [2]  # the drafter saw only this one


def test_a_send_after_the_drafter_closed_reads_the_answers_before_it_first(socket_path):
    """The drafter refuses a Propose and closes the connection before the next one is sent: that send
    fails (UNAVAILABLE), and the refused Propose still reports the drafter's own status."""
    drafter, answered = FakeDrafter(), []

    async def main():
        server = await serve(socket_path, drafter)
        direct = socket_channel(socket_path)
        await direct.prepare([])
        bad = direct.send(plan(13, ["a"]), "bad", answered.append, None)
        for _ in range(250):  # the drafter has refused it and closed the connection: its thread is gone
            if drafter.got and not server._connections:
                break
            await asyncio.sleep(0.02)
        behind = await asyncio.to_thread(direct.send, plan(3, ["b"]), "behind", answered.append, None)
        await direct.close()
        await server.close()
        return bad, behind

    bad, behind = run(main())
    assert "FAILED_PRECONDITION: thirteen is refused" in bad.proposal.error
    assert not behind.proposal.ok and "UNAVAILABLE" in behind.proposal.error
    assert [p.context for p in answered] == ["bad", "behind"]


class FakePoolChannel(PoolChannel):
    """A PoolChannel whose `propose` on the event loop answers drafts [iteration] per request after a moment,
    staging first; iteration 13 raises."""

    def __init__(self, targets=("dns:///drafters:50053",)):
        super().__init__(DrafterPool(list(targets), resolver=lambda host, port: []), GrpcSender(), 5.0)
        self.threads: list[str] = []

    async def propose(self, plan: ProposeBatch, num_reqs: int, on_staged=None):
        self.threads.append(threading.current_thread().name)
        on_staged()
        await asyncio.sleep(0.05 if plan.iteration == 1 else 0)
        if plan.iteration == 13:
            raise RuntimeError("boom")
        return Proposal(True, [[plan.iteration] for _ in range(num_reqs)], "", plan.hidden_state_bytes)


def test_pooled_proposes_run_on_the_loop_and_are_answered_in_order_on_the_step_thread():
    pooled, answered = FakePoolChannel(), []

    def on_answer(pending):
        answered.append((pending.context, threading.current_thread().name))

    async def main():
        await pooled.prepare([])

        def step_thread():  # as the verifier's step thread: send two, then wait for the second
            a = pooled.send(plan(1, ["a", "b"]), "A", on_answer, None)
            b = pooled.send(plan(2, ["c"]), "B", on_answer, None)
            return a, b, pooled.wait(b)

        a, b, proposal = await asyncio.to_thread(step_thread)
        done = pooled.collect()
        await pooled.close()
        return a, b, proposal, done

    a, b, proposal, done = run(main())
    loop_thread = "MainThread"
    assert pooled.threads == [loop_thread, loop_thread]  # PoolChannel.propose ran on the event loop
    assert [context for context, _ in answered] == ["A", "B"] and [p.context for p in done] == ["A", "B"]
    assert all(thread != loop_thread for _, thread in answered)  # on_answer: on the step thread
    assert a.proposal.drafts == [[1], [1]] and proposal is b.proposal and proposal.drafts == [[2]]


def test_a_pooled_propose_that_raises_is_a_failed_propose_and_no_drafter_fails_at_once():
    answered = []

    async def main():
        pooled = FakePoolChannel()
        await pooled.prepare([])
        broken = await asyncio.to_thread(lambda: pooled.wait(pooled.send(plan(13, ["a"]), "X", answered.append, None)))
        nobody = FakePoolChannel(targets=())
        await nobody.prepare([])
        none = await asyncio.to_thread(lambda: nobody.wait(nobody.send(plan(2, ["a"]), "Y", answered.append, None)))
        await pooled.close()
        await nobody.close()
        return broken, none

    broken, none = run(main())
    assert not broken.ok and "boom" in broken.error and broken.drafts == [[]]
    assert not none.ok and none.error == "no drafter configured" and none.drafts == [[]]
    assert [p.context for p in answered] == ["X", "Y"]
