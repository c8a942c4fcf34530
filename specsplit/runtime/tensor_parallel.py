"""A tensor-parallel model server's ranks, one process per device: the verifier's and the drafter's alike.

`serve verifier|drafter --tensor-parallel-size N` is rank 0: it alone speaks gRPC, and it starts ranks
1 .. N-1, the *followers*, as spawned processes (`start_ranks`), joins them in one torch.distributed group
(`specsplit.models.parallel`), and every rank loads its shard of the model. A follower (`run_follower`)
then loops over what rank 0 broadcasts it, running the same forwards on its device and so taking part in
their collectives; what it loops over is the service's own (`specsplit.verifier.ranks`: each verify step's
forward; `specsplit.drafter.ranks`: each Propose and Free).

Faults: a follower that exits makes rank 0 report NOT_SERVING, stop its other ranks and exit 1 (the
supervisor or Kubernetes restarts it); a rank 0 that exits ends its followers (their wait for the next step
fails, and each also watches its parent). A rank that does not join within `--tensor-parallel-timeout`
fails start-up with one line. torch is imported only once a server starts (the command line offers these
flags without it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Callable

from specsplit.client.errors import UsageError

log = logging.getLogger(__name__)


def add_tensor_parallel_arguments(p: argparse.ArgumentParser, module: str) -> None:
    """`--tensor-parallel-size`, `-address`, `-timeout`; `module`: where the service's ranks are, for --help."""
    tp = p.add_argument_group(f"tensor parallelism ({module})")
    tp.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks, one process per device: rank r on the r-th CUDA device after --device (or all on cpu)",
    )
    tp.add_argument(
        "--tensor-parallel-address",
        default="127.0.0.1:0",
        help="HOST:PORT of the ranks' rendezvous, hosted by rank 0 (port 0: any free port)",
    )
    tp.add_argument(
        "--tensor-parallel-timeout",
        type=float,
        default=300.0,
        help="seconds for every rank to join at start-up (and for any collective to complete)",
    )


def backend_for(device: str) -> str:
    import torch

    return "nccl" if torch.device(device).type == "cuda" else "gloo"


@contextlib.contextmanager
def rank_load(device: str, num_blocks: int | None, socket_dir: str | None, rank: int):
    """Around a rank's load and KV sizing (verifier or drafter, `loading.py`): yields (its device, its block count:
    the given one, else CPU's default off CUDA and None on CUDA, sized from memory, its memory baseline on CUDA).
    Rank 0 on CUDA holds the device's memory lock (`socket_dir`) against a co-located peer sizing at once."""
    import torch

    from specsplit.runtime.kv_cache_size import CPU_NUM_BLOCKS
    from specsplit.runtime.memory_profile import DeviceBaseline, device_memory_lock

    device = rank_device(device, rank) if rank else device
    on_cuda = torch.device(device).type == "cuda"
    blocks = num_blocks if num_blocks is not None or on_cuda else CPU_NUM_BLOCKS
    with device_memory_lock(socket_dir if on_cuda and rank == 0 else None):
        yield device, blocks, DeviceBaseline.take(device) if on_cuda else None


def rank_device(device: str, rank: int) -> str:
    """The device of `rank` when rank 0 runs on `device`: the next CUDA devices in order; cpu stays cpu."""
    import torch

    d = torch.device(device)
    if d.type != "cuda":
        return device
    return f"cuda:{(d.index or 0) + rank}"


def start_ranks(config, follower_main: Callable, on_exit: Callable[[int, int | None], None]) -> Followers:
    """Rank 0's start (blocking): the followers spawned, each running `follower_main(config, rank, address)`, and
    the group joined; `on_exit(rank, code)` runs when a follower exits. `config`: the server's, with
    `tensor_parallel_size`, `tensor_parallel_address`, `tensor_parallel_timeout` and `model.device`. UsageError
    for a group not formed in time."""
    from specsplit.models.parallel import TensorParallelStartError, init_tensor_parallel
    from specsplit.rpc.process import free_port

    host, _, port = config.tensor_parallel_address.rpartition(":")
    address = f"{host}:{port if port != '0' else free_port(host)}"
    followers = Followers(config, follower_main, address)
    followers.start(on_exit)
    try:
        init_tensor_parallel(
            0,
            config.tensor_parallel_size,
            address,
            backend=backend_for(config.model.device),
            timeout_s=config.tensor_parallel_timeout,
            device=rank_device(config.model.device, 0),
        )
    except TensorParallelStartError as err:
        followers.kill()
        raise UsageError(f"{err}; check that every rank's device is free and the address is reachable") from err
    return followers


async def start_followers(config, follower_main: Callable, server, close: Callable) -> Followers:
    """`start_ranks` from rank 0's event loop, with its fault handling: a follower that exits makes this process
    report NOT_SERVING on `server` (a `ServiceServer`), kill its other ranks, await `close()` (its sockets) and
    exit 1, not drain: its step thread may be stuck in a collective with the lost rank. The gRPC server is not
    stopped first: that would wake the orderly stop (`run_until_signal`), whose end of the followers broadcasts to
    the lost rank and fails, racing this exit (a process that aborted instead of exiting 1)."""
    loop = asyncio.get_running_loop()
    followers: Followers | None = None
    role = follower_main.__module__.split(".")[1]

    async def rank_lost(rank: int, code: int | None) -> None:
        log.error(
            "tensor-parallel rank %d exited (code %s): NOT_SERVING, the other ranks stopped, exiting 1 "
            "(a restarted %s serves again)",
            rank,
            code,
            role,
        )
        await server.set_not_serving()
        if followers is not None:
            followers.kill()
        await close()
        logging.shutdown()
        os._exit(1)

    followers = await loop.run_in_executor(
        None, start_ranks, config, follower_main, lambda r, c: asyncio.run_coroutine_threadsafe(rank_lost(r, c), loop)
    )
    return followers


def run_follower(config, rank: int, address: str, role: str, load: Callable, follow: Callable) -> None:
    """A follower process's life (never returns): joins the group as `rank`, `load(device)` (in step with rank 0:
    its warm-up forwards take part in collectives), waits for every rank to be ready, then `follow(loaded)` until
    rank 0 ends it (exit 0). Exits 1 on any failure, which rank 0 sees. `role`: "verifier" or "drafter"."""
    from specsplit.models.parallel import init_tensor_parallel, wait_for_ranks
    from specsplit.rpc.server import setup_logging
    from specsplit.runtime.device import use_device

    # Rank 0 alone decides when to stop (a Ctrl-C or SIGTERM to the group must not cut a step short).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    setup_logging(f"{role}-rank{rank}", config.server.log_level)
    _exit_with_parent()
    device = rank_device(config.model.device, rank)
    try:
        init_tensor_parallel(
            rank,
            config.tensor_parallel_size,
            address,
            backend=backend_for(config.model.device),
            timeout_s=config.tensor_parallel_timeout,
            device=device,
        )
        use_device(device)
        loaded = load(device)
        wait_for_ranks()  # rank 0 reports SERVING once every rank is ready
        log.info("tensor-parallel rank %d of %d on %s: following rank 0", rank, config.tensor_parallel_size, device)
        steps = follow(loaded)
    except Exception as err:  # noqa: BLE001 (one line; rank 0 reports the rank's exit)
        log.error("tensor-parallel rank %d: %s", rank, " ".join(str(err).split()) or type(err).__name__)
        os._exit(1)
    log.info("tensor-parallel rank %d: stopped after %d steps", rank, steps)
    os._exit(0)  # not interpreter shutdown: torch.distributed's teardown may wait on a rank 0 that is gone


def end_followers() -> None:
    """Rank 0, stopping: its followers leave their loop (every `follow` ends at a broadcast None)."""
    from specsplit.models.parallel import broadcast_from_first

    broadcast_from_first(None)


def _exit_with_parent() -> None:
    """Exits this process as soon as its parent (rank 0) is gone, whatever the process is waiting for."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class Followers:
    """Rank 0's handle on ranks 1 .. N-1: started with `start`, watched (`on_exit` is called, on a thread of
    its own, with the rank and exit code of the first that exits), stopped with `stop` or killed."""

    def __init__(self, config, follower_main: Callable, address: str) -> None:
        self.config, self.follower_main, self.address = config, follower_main, address
        self.procs: dict[int, multiprocessing.Process] = {}
        self._stopping = False

    def start(self, on_exit: Callable[[int, int | None], None]) -> None:
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        role = self.follower_main.__module__.split(".")[1]  # specsplit.<service>.ranks
        for rank in range(1, self.config.tensor_parallel_size):
            proc = ctx.Process(
                target=self.follower_main,
                args=(self.config, rank, self.address),
                name=f"{role}-rank{rank}",
                daemon=True,  # ended with rank 0, also when rank 0 fails at start-up
            )
            proc.start()
            self.procs[rank] = proc

        def watch() -> None:
            by_sentinel = {p.sentinel: r for r, p in self.procs.items()}
            ready = multiprocessing.connection.wait(list(by_sentinel))
            if not self._stopping:
                rank = by_sentinel[ready[0]]
                on_exit(rank, self.procs[rank].exitcode)

        threading.Thread(target=watch, name="rank-watch", daemon=True).start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Rank 0's orderly end: the followers are told to stop (`end_followers`, by the caller), then waited
        for; one still running after `timeout_s` is killed."""
        self._stopping = True
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        self._stopping = True
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
        for proc in self.procs.values():
            proc.join(5)
