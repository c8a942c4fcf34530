"""Hidden-state transports: round trips, handle checks, ring bookkeeping, bounded waits.

nccl runs on its CPU stand-in (backend gloo) with both ranks in this process (sender on the event
loop, receiver on a thread: the same split as verifier and drafter); cuda_ipc needs two CUDA
processes and runs only where CUDA is available.
"""

import asyncio
import concurrent.futures

import grpc
import pytest
import torch

from specsplit.client.errors import FailedPrecondition, InvalidArgument, Unavailable
from specsplit.proto import common_pb2, drafter_pb2
from specsplit.transport import make_receiver, make_sender
from specsplit.transport.base import Transfer, TransportError
from specsplit.transport.handle import OpenState, check_handle
from specsplit.transport.ipc_ring import RingFull, SlotRing

HIDDEN = 24


def _rows(n: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _wire(msg: drafter_pb2.ProposeRequest) -> drafter_pb2.ProposeRequest:
    return drafter_pb2.ProposeRequest.FromString(msg.SerializeToString())


def test_grpc_round_trip_is_exact_and_refuses_handles_and_bad_bytes():
    sender, receiver = make_sender("grpc"), make_receiver("grpc", "cpu", HIDDEN)
    for n, dtype in [(1, torch.float32), (7, torch.bfloat16), (0, torch.float16)]:
        msg = drafter_pb2.ProposeRequest()
        sender.finish(sender.send(_rows(n, n, dtype), msg), ok=True)
        assert torch.equal(receiver.receive(_wire(msg)), _rows(n, n, dtype))
    with pytest.raises(InvalidArgument, match="hidden_states"):
        bad = drafter_pb2.ProposeRequest(hidden_states=common_pb2.Tensor(dtype=1, shape=[2, HIDDEN + 1], data=b""))
        receiver.receive(bad)
    with pytest.raises(FailedPrecondition, match="--hidden-transport grpc"):
        receiver.receive(drafter_pb2.ProposeRequest(hidden_states_handle=drafter_pb2.HiddenStatesHandle(num_rows=1)))
    with pytest.raises(FailedPrecondition, match="same --hidden-transport"):
        receiver.open(drafter_pb2.OpenHiddenTransportRequest(transport="nccl"))


class Pair:
    """An nccl (gloo) sender on the event loop and its receiver on a 'drafter' thread."""

    def __init__(self, timeout_s: float = 10.0):
        self.sender = make_sender("nccl", rendezvous="127.0.0.1:0", backend="gloo", timeout_s=timeout_s)
        self.receiver = make_receiver("nccl", "cpu", HIDDEN)
        self.drafter = concurrent.futures.ThreadPoolExecutor(1)

    async def call_open(self, request):
        return await asyncio.get_running_loop().run_in_executor(self.drafter, self.receiver.open, request)

    async def propose(self, rows: torch.Tensor) -> torch.Tensor:
        """One Propose: send, the drafter receives from the wire copy of the message, finish."""
        if self.sender.needs_open(rows):
            await self.sender.open(rows, self.call_open)
        msg = drafter_pb2.ProposeRequest()
        transfer = self.sender.send(rows, msg)
        try:
            got = await asyncio.get_running_loop().run_in_executor(self.drafter, self.receiver.receive, _wire(msg))
        except BaseException:
            self.sender.finish(transfer, ok=False)
            raise
        self.sender.finish(transfer, ok=True)
        return got

    def close(self):
        self.sender.close()
        self.receiver.close()
        self.drafter.shutdown()


def test_nccl_on_gloo_moves_rows_in_order_and_reopens_after_a_failed_call():
    async def run():
        pair = Pair()
        try:
            for i, n in enumerate([1, 4, 0, 128, 3]):
                assert torch.equal(await pair.propose(_rows(n, i)), _rows(n, i))
            assert pair.sender.generation == 1
            # A failed call resets the sender; the next call opens generation 2 and rows flow again.
            msg = drafter_pb2.ProposeRequest()
            pair.sender.finish(pair.sender.send(_rows(2), msg), ok=False)
            assert pair.sender.needs_open(_rows(2))
            assert torch.equal(await pair.propose(_rows(5, 9)), _rows(5, 9))
            assert pair.sender.generation == 2
            with pytest.raises(FailedPrecondition, match="generation 1"):  # stale handle from before
                pair.receiver.receive(_wire(msg))
        finally:
            pair.close()

    asyncio.run(run())


def test_nccl_send_to_a_drafter_that_went_away_fails_as_a_transport_error_and_reopens():
    """gloo finds a closed peer at the send itself: a TransportError that resets the sender (the replica fails and
    is probed), not a RuntimeError that failed every later Propose the same way on the dead group."""

    async def run():
        pair = Pair(timeout_s=2.0)
        try:
            await pair.propose(_rows(2))
            pair.receiver.close()  # the drafter's end goes away
            pair.receiver = make_receiver("nccl", "cpu", HIDDEN)  # and a restarted one waits to be opened
            for _ in range(50):  # the sender learns of it within a few sends (gloo's socket sees the close)
                msg = drafter_pb2.ProposeRequest()
                try:
                    pair.sender.finish(pair.sender.send(_rows(2), msg), ok=True)
                except TransportError:
                    break
                await asyncio.sleep(0.05)
            else:
                pytest.fail("sends to a closed peer never failed")
            assert pair.sender.needs_open(_rows(2))
            assert torch.equal(await pair.propose(_rows(3, 4)), _rows(3, 4))
            assert pair.sender.generation == 2
        finally:
            pair.close()

    asyncio.run(run())


def test_nccl_handles_are_checked_before_anything_is_received():
    async def run():
        pair = Pair()
        try:
            await pair.propose(_rows(2))
            good = drafter_pb2.HiddenStatesHandle(generation=1, sequence=2, dtype=1, num_rows=3, hidden_size=HIDDEN)
            cases = [
                (dict(hidden_size=HIDDEN + 1), InvalidArgument, "hidden_size"),
                (dict(dtype=common_pb2.DTYPE_BFLOAT16), InvalidArgument, "dtype"),
                (dict(dtype=0), InvalidArgument, "dtype"),
                (dict(num_rows=-1), InvalidArgument, "num_rows"),
                (dict(num_rows=1 << 40), InvalidArgument, "num_rows"),
                (dict(sequence=5), FailedPrecondition, "out of step"),
                (dict(sequence=1), FailedPrecondition, "out of step"),  # a replay
                (dict(generation=7), FailedPrecondition, "generation"),
            ]
            for change, error, words in cases:
                handle = drafter_pb2.HiddenStatesHandle()
                handle.CopyFrom(good)
                for k, v in change.items():
                    setattr(handle, k, v)
                with pytest.raises(error, match=words):
                    pair.receiver.receive(drafter_pb2.ProposeRequest(hidden_states_handle=handle))
            with pytest.raises(FailedPrecondition, match="started with --hidden-transport nccl"):
                pair.receiver.receive(drafter_pb2.ProposeRequest(hidden_states=common_pb2.Tensor(dtype=1)))
            # None of the refused handles consumed a transfer: the stream is still in step.
            assert torch.equal(await pair.propose(_rows(6, 3)), _rows(6, 3))
        finally:
            pair.close()

    asyncio.run(run())


def test_nccl_receive_without_a_matching_send_fails_within_its_timeout():
    async def run():
        pair = Pair(timeout_s=1.0)
        try:
            await pair.propose(_rows(2))
            handle = drafter_pb2.HiddenStatesHandle(generation=1, sequence=2, dtype=1, num_rows=3, hidden_size=HIDDEN)
            receive = pair.receiver.receive
            with pytest.raises(Unavailable, match="receive 2"):  # the verifier never sent: no hang
                await asyncio.get_running_loop().run_in_executor(
                    pair.drafter, receive, drafter_pb2.ProposeRequest(hidden_states_handle=handle)
                )
            with pytest.raises(FailedPrecondition, match="no open nccl transport"):
                receive(drafter_pb2.ProposeRequest(hidden_states_handle=handle))
        finally:
            pair.close()

    asyncio.run(run())


def test_nccl_open_refused_by_the_drafter_fails_the_open_without_hanging():
    async def run():
        sender = make_sender("nccl", rendezvous="127.0.0.1:0", backend="gloo", timeout_s=2.0)
        grpc_drafter = make_receiver("grpc", "cpu", HIDDEN)

        async def call(request):
            grpc_drafter.open(request)  # raises: a drafter started with --hidden-transport grpc

        with pytest.raises(FailedPrecondition, match="started with --hidden-transport grpc"):
            await sender.open(_rows(1), call)
        assert sender.needs_open(_rows(1))
        sender.close()

    asyncio.run(run())


def test_slot_ring_reuses_a_slot_only_after_its_reply_and_never_after_a_failure():
    ring = SlotRing(2)
    a, b = ring.acquire(), ring.acquire()
    assert {a, b} == {0, 1} and ring.in_flight == 2
    with pytest.raises(RingFull):
        ring.acquire()
    ring.release(a)
    assert ring.acquire() == a  # back only after the reply
    ring.lose(b)  # failed call: the drafter may still read b
    ring.release(a)
    assert ring.acquire() == a and ring.lost == {b}
    with pytest.raises(RingFull, match=r"\[1\] lost"):
        ring.acquire()
    with pytest.raises(ValueError, match="not in flight"):
        ring.release(b)
    with pytest.raises(ValueError):
        SlotRing(0)


def test_cuda_ipc_handles_are_checked_against_the_ring():
    state = OpenState(generation=3, dtype=torch.bfloat16, hidden_size=HIDDEN, num_slots=4, slot_rows=8)

    def check(**kw):
        base = dict(generation=3, sequence=1, dtype=common_pb2.DTYPE_BFLOAT16, num_rows=8, hidden_size=HIDDEN)
        h = drafter_pb2.HiddenStatesHandle(**{**base, **kw})
        return check_handle(drafter_pb2.ProposeRequest(hidden_states_handle=h), state, "cuda_ipc")

    assert check(slot=3).slot == 3
    assert check(slot=0, num_rows=4, offset=4 * HIDDEN).offset == 4 * HIDDEN
    for kw, words in [
        (dict(slot=4), "slot 4"),
        (dict(slot=-1), "slot -1"),
        (dict(num_rows=9), "outside the slot"),
        (dict(num_rows=4, offset=4 * HIDDEN + 1), "outside the slot"),
        (dict(offset=-1), "outside the slot"),
    ]:
        with pytest.raises(InvalidArgument, match=words):
            check(**kw)
    with pytest.raises(FailedPrecondition, match="no open cuda_ipc"):
        empty = drafter_pb2.ProposeRequest(hidden_states_handle=drafter_pb2.HiddenStatesHandle())
        check_handle(empty, None, "cuda_ipc")


def test_cuda_ipc_sender_refuses_a_cpu_verifier():
    from specsplit.transport.base import TransportError

    sender = make_sender("cuda_ipc")
    with pytest.raises(TransportError, match="CUDA"):
        asyncio.run(sender.open(_rows(1), None))
    sender.finish(Transfer(), ok=False)  # nothing open: a no-op


def _ipc_drafter(conn, device: str):
    """Child process: the drafter side of cuda_ipc."""
    receiver = make_receiver("cuda_ipc", device, HIDDEN)
    try:
        while True:
            kind, payload = conn.recv()
            if kind == "stop":
                return
            if kind == "open":
                receiver.open(drafter_pb2.OpenHiddenTransportRequest.FromString(payload))
                conn.send(("ok", b""))
            else:
                rows = receiver.receive(drafter_pb2.ProposeRequest.FromString(payload)).clone()  # a "propose"
                receiver.release()  # as the drafter does before it replies
                conn.send(("ok", rows.cpu()))
    except Exception as err:  # reported to the parent
        conn.send(("error", repr(err)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a CUDA device")
def test_cuda_ipc_round_trip_between_two_processes():
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    drafter_device = f"cuda:{torch.cuda.device_count() - 1}"
    proc = ctx.Process(target=_ipc_drafter, args=(child, drafter_device), daemon=True)
    proc.start()

    async def call_open(request):
        parent.send(("open", request.SerializeToString()))
        kind, out = parent.recv()
        assert kind == "ok", out

    async def run():
        sender = make_sender("cuda_ipc", num_slots=2)
        for i, n in enumerate([1, 32 * 4, 64 * 4, 300, 5]):  # 300 rows outgrow the ring: it is opened again
            rows = _rows(n, i, torch.bfloat16).to("cuda:0")
            if sender.needs_open(rows):
                await sender.open(rows, call_open)
            msg = drafter_pb2.ProposeRequest()
            transfer = sender.send(rows, msg)
            parent.send(("receive", msg.SerializeToString()))
            kind, got = parent.recv()
            assert kind == "ok", got
            sender.finish(transfer, ok=True)
            assert torch.equal(got, rows.cpu())
        assert sender.generation == 2
        sender.close()

    try:
        asyncio.run(run())
    finally:
        parent.send(("stop", b""))
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def test_transport_names_are_checked():
    with pytest.raises(ValueError, match="unknown hidden-state transport"):
        make_sender("shm")
    with pytest.raises(ValueError, match="HOST:PORT"):
        make_sender("nccl", rendezvous="nowhere")
    assert grpc.StatusCode.INVALID_ARGUMENT is InvalidArgument.code
