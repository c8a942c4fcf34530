"""A two-rank torch.distributed process group for point-to-point transfers, outside the global
default group (so a broken one can be dropped and a new one made, and tests can hold both ranks).

Rank 0 (the verifier) owns the TCP rendezvous store; each open uses a fresh key prefix.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from datetime import timedelta

import torch.distributed as dist

log = logging.getLogger(__name__)


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"rendezvous address {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def open_store(address: str, is_master: bool, timeout_s: float) -> dist.TCPStore:
    host, port = split_address(address)
    timeout = timedelta(seconds=timeout_s)
    if is_master:
        return dist.TCPStore(host, port, None, True, timeout=timeout, wait_for_workers=False)
    return dist.TCPStore(host, port, None, False, timeout=timeout)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def make_pair_group(backend: str, store: dist.Store, generation: int, rank: int, host: str, timeout_s: float):
    """Blocks until both ranks of this generation have joined (gloo) or returns at once (nccl:
    communicators form on the first transfer, which the caller makes during the open)."""
    prefixed = dist.PrefixStore(f"specsplit-hidden/{generation}", store)
    if backend == "gloo":  # joining waits for the peer up to timeout_s
        opts = dist.ProcessGroupGloo._Options()
        device = dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") if _is_loopback(host) else None
        opts._devices = [device or dist.ProcessGroupGloo.create_default_device()]
        opts._timeout = timedelta(seconds=timeout_s)
        return dist.ProcessGroupGloo(prefixed, rank, 2, opts)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        # Our own waits are bounded by timeout_s and abort the group; its watchdog only backs them up.
        opts._timeout = timedelta(seconds=4 * timeout_s + 60)
        return dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
    raise ValueError(f"unknown backend {backend!r}; choose nccl or gloo")


def wait(work, timeout_s: float, what: str) -> None:
    """Blocks the calling thread until `work` is done; raises TimeoutError past `timeout_s`."""
    try:
        done = work.wait(timedelta(seconds=timeout_s))
    except RuntimeError as err:
        raise TimeoutError(f"{what} failed or timed out after {timeout_s:g} s: {err}") from err
    if done is False:
        raise TimeoutError(f"{what} did not finish within {timeout_s:g} s")


def drop(group) -> None:
    """Aborts a group that may have transfers stuck on a lost peer, without blocking the caller."""
    if group is None:
        return

    def abort():
        for name in ("abort", "_abort"):
            fn = getattr(group, name, None)
            if fn is not None:
                try:
                    fn()
                except Exception as err:  # noqa: BLE001 (best effort: the group is being thrown away)
                    log.debug("abort of the old process group: %s", err)
                return

    if isinstance(group, dist.ProcessGroupGloo):
        return  # dropping the reference is enough; its pending waits end by their own timeout
    threading.Thread(target=abort, name="drop-process-group", daemon=True).start()
