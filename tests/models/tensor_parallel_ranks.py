"""Runs a function on N tensor-parallel ranks: CPU processes joined over gloo (`run_ranks`).

CPU ranks are forked from a fork server (`rank_context`), never from the test process: a pytest worker that ran
gRPC tests has gRPC's threads alive, and a child forked from it can block for ever on a lock one of them held (CI
saw a rank never report). The fork server is a fresh interpreter that imported torch and the model code once, so
a rank still starts in a fraction of a second."""

from __future__ import annotations

import multiprocessing
import traceback

from specsplit.rpc.process import free_port


def run_ranks(size: int, fn, *args, cuda: bool = False, timeout_s: float = 120.0):
    """`fn(*args)` (`fn` importable by name) on ranks 0 .. size - 1 of a gloo group, each a process of
    `rank_context` with one thread (`cuda`: an NCCL group of spawned processes, rank r on cuda:r); returns rank 0's
    result (anything picklable), raising with the rank's traceback if a rank fails."""
    ctx = multiprocessing.get_context("spawn") if cuda else rank_context()
    results = ctx.Queue()
    address = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank_main, args=(r, size, address, fn, args, results, cuda)) for r in range(size)]
    for p in procs:
        p.start()
    try:
        outcome = {}
        while len(outcome) < size:
            rank, ok, value = results.get(timeout=timeout_s)
            if not ok:
                raise AssertionError(f"tensor-parallel rank {rank} of {size} failed:\n{value}")
            outcome[rank] = value
        return outcome[0]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def rank_context():
    """The multiprocessing context CPU ranks start in: forked from a clean fork server that preloaded torch and
    the tensor-parallel model code (CUDA cannot be forked: `run_ranks(cuda=True)` spawns)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "specsplit.models.parallel", "specsplit.models.loader"])
    return ctx


def _rank_main(rank: int, size: int, address: str, fn, args, results, cuda: bool) -> None:
    import torch

    from specsplit.models.parallel import destroy_tensor_parallel, init_tensor_parallel

    torch.set_num_threads(1)
    try:
        if cuda:
            torch.cuda.set_device(rank)
        backend, device = ("nccl", f"cuda:{rank}") if cuda else ("gloo", "cpu")
        init_tensor_parallel(rank, size, address, backend=backend, timeout_s=60, device=device)
        value = fn(*args)
        destroy_tensor_parallel()
        results.put((rank, True, value if rank == 0 else None))
    except BaseException:  # noqa: BLE001 (reported to the test)
        results.put((rank, False, traceback.format_exc()))
