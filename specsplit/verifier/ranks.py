"""A tensor-parallel verifier's ranks: one process per device, the first rank (the `serve verifier` process)
serving gRPC and the others following its steps.

`serve verifier --tensor-parallel-size N` starts ranks 1 .. N-1 as spawned processes (`Followers.start`),
joins them in one torch.distributed group (`specsplit.models.parallel`), and each rank loads its shard of
the target. A follower then loops (`follow`): it receives each step's `ForwardStep` from rank 0, runs the
same forward on its device (a CUDA graph's replay where rank 0's would), and so takes part in the step's
all-reduces and the logits gather. Rejection sampling, the coordinator's messages and the hidden states
for the drafter stay on rank 0, whose hidden states are the whole model's (every rank's are, after the
last all-reduce).

Faults: a follower that exits makes rank 0 report NOT_SERVING, stop its other ranks and exit 1 (the
supervisor or Kubernetes restarts it, and the coordinator re-prefills its requests there, as after any
verifier restart); a rank 0 that exits ends its followers (their wait for the next step fails, and each
also watches its parent). A rank that does not join within `--tensor-parallel-timeout` fails start-up
with one line.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def follow(runner) -> int:
    """A follower's loop over rank 0's steps, until rank 0 broadcasts the end (None); returns the steps run."""
    from specsplit.models.parallel import broadcast_from_first
    from specsplit.models.step_upload import StepUpload

    cache = runner.kv_cache
    upload = StepUpload(cache.device)
    steps = 0
    while (step := broadcast_from_first()) is not None:
        (ids, positions, rows), _, _ = upload([step.input_ids, step.positions, step.logits_indices])
        attn = cache.upload_step(step.plan, use_kernel=step.use_kernel)
        with torch.inference_mode():
            runner.forward(ids, positions, attn, rows)
        steps += 1
    return steps


def end_followers() -> None:
    """Rank 0, stopping: its followers leave their loop."""
    from specsplit.models.parallel import broadcast_from_first

    broadcast_from_first(None)


def follower_main(config, rank: int, address: str) -> None:
    """A follower process: `config` is rank 0's VerifierConfig. Exits 1 on any failure (rank 0 sees it)."""
    from specsplit.grpc_server import setup_logging
    from specsplit.models.device import use_device
    from specsplit.models.parallel import init_tensor_parallel, wait_for_ranks
    from specsplit.models.serve_options import apply_eager_option
    from specsplit.verifier.loading import load_and_size, rank_device

    # Rank 0 alone decides when to stop (a Ctrl-C or SIGTERM to the group must not cut a step short).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    setup_logging(f"verifier-rank{rank}", config.server.log_level)
    _exit_with_parent()
    options = config.model
    device = rank_device(options.device, rank)
    try:
        init_tensor_parallel(
            rank,
            config.tensor_parallel_size,
            address,
            backend=backend_for(options.device),
            timeout_s=config.tensor_parallel_timeout,
            device=device,
        )
        use_device(device)
        # Loaded and sized as rank 0 does, in step with it (the warm-up's collectives, one block count).
        _, _, runner, _ = load_and_size(config, apply_eager_option(options.eager), rank)
        wait_for_ranks()  # rank 0 reports SERVING once every rank is ready
        log.info("tensor-parallel rank %d of %d on %s: following rank 0", rank, config.tensor_parallel_size, device)
        steps = follow(runner)
    except Exception as err:  # noqa: BLE001 (one line; rank 0 reports the rank's exit)
        log.error("tensor-parallel rank %d: %s", rank, " ".join(str(err).split()) or type(err).__name__)
        os._exit(1)
    log.info("tensor-parallel rank %d: stopped after %d steps", rank, steps)
    os._exit(0)  # not interpreter shutdown: torch.distributed's teardown may wait on a rank 0 that is gone


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

    def __init__(self, config, address: str) -> None:
        self.config, self.address = config, address
        self.procs: dict[int, multiprocessing.Process] = {}
        self._stopping = False

    def start(self, on_exit: Callable[[int, int | None], None]) -> None:
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        for rank in range(1, self.config.tensor_parallel_size):
            proc = ctx.Process(
                target=follower_main,
                args=(self.config, rank, self.address),
                name=f"verifier-rank{rank}",
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
