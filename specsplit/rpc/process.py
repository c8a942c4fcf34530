"""A service's process on this machine: the ports it takes (`free_port`) and how long it lives. A service that
`specsplit up` started (`specsplit.cli.launcher`) ends with the process that started it (`end_with_parent`); a
verifier or drafter whose starter died first serves its coordinator until that one has exited
(`outlive_the_coordinator`)."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import random
import signal
import socket
import sys
import time

log = logging.getLogger(__name__)
WORKER_HOST = "127.0.0.1"  # verifier and drafter: reached only by this machine's coordinator and verifier

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


PARENT_ENV = "SPECSPLIT_END_WITH_PARENT"  # set by LocalCluster for its children: the pid they end with
# Set by LocalCluster for verifier and drafter: their coordinator's pid, which they serve until it exits should the
# cluster's parent die first (`outlive_the_coordinator`).
COORDINATOR_ENV = "SPECSPLIT_COORDINATOR_PID"
# What the kernel sends a verifier or drafter whose parent died: not SIGTERM, so that it is told apart from a stop
# its parent (or an operator) asked for; its handler records it and raises SIGTERM.
PARENT_DIED = signal.SIGUSR2
OUTLIVE_LIMIT_S = 60.0  # the longest a model server waits for its coordinator after its parent died
_parent: dict[str, int | bool] = {"died": False}  # and "coordinator": its pid, as `end_with_parent` read it


def end_with_parent() -> None:
    """Called first by every service (`serve` of each role): one that a `LocalCluster` started (its environment names
    the parent's pid, `PARENT_ENV`) asks the kernel for a signal when the thread that started it exits (Linux,
    `prctl(PR_SET_PDEATHSIG)`): SIGTERM for the coordinator, `PARENT_DIED` (which becomes a SIGTERM) for a model
    server that knows its coordinator; a SIGTERM, not a SIGKILL: the service drains and removes its sockets. It ends at
    once if the parent is already gone. Asked here, after exec, not in a `preexec_fn` between fork and exec: a
    `preexec_fn` makes subprocess fork, which runs gRPC's fork handlers in the parent, and those can hang a process
    that holds gRPC channels, as one that restarts a drafter does (without one, subprocess uses vfork and runs
    none)."""
    parent = os.environ.pop(PARENT_ENV, None)
    coordinator = os.environ.pop(COORDINATOR_ENV, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    death_signal = signal.SIGTERM
    if coordinator is not None:
        _parent["coordinator"] = int(coordinator)
        signal.signal(PARENT_DIED, _parent_died)
        death_signal = PARENT_DIED
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(death_signal))
    if os.getppid() != int(parent):  # the parent died before the request took effect
        os.kill(os.getpid(), death_signal)


def _parent_died(_signum, _frame) -> None:
    _parent["died"] = True
    os.kill(os.getpid(), signal.SIGTERM)


async def outlive_the_coordinator(limit_s: float = OUTLIVE_LIMIT_S) -> None:
    """Called by a verifier or drafter that was told to stop: when its cluster's parent died (a SIGKILLed `up`: the
    kernel signalled every service at once), it goes on serving until its coordinator, which is draining its own
    requests, has exited (at most `limit_s`); any other stop (its parent's, which stops the coordinator first, or an
    operator's SIGTERM) returns at once."""
    coordinator = _parent.get("coordinator")
    if not _parent["died"] or not _alive(coordinator):
        return
    log.info("the process that started this service is gone: serving coordinator %d until it exits", coordinator)
    deadline = time.monotonic() + limit_s
    while _alive(coordinator) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


LOWEST_PORT = 10000  # free_port's ports are at least this, below the kernel's ephemeral range


def free_port(host: str = WORKER_HOST) -> int:
    """A port free on `host` now, for a service that binds it later (seconds later: torch is imported first). Taken
    below the kernel's ephemeral range where it has one: a port the kernel hands out there (bind to port 0, or the
    local port of an outgoing connection, which every gRPC channel opens) may be taken by anyone before the service
    binds it, and was (`specsplit up`'s verifier refused to start: its port was in use)."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(100 if low > LOWEST_PORT else 0):
        port = rng.randrange(LOWEST_PORT, low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux), 0 where it is not known."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
