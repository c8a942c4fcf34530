"""The verifier's drafter channel for its flags (`make_channel`): a `SocketChannel` to a co-located drafter or a
`PoolChannel` to pooled replicas (`drafter_channel.py` says what each is), or the refusal of flags that do not fit
together."""

from __future__ import annotations

from specsplit.rpc.local_stream import DRAFTER_RPCS
from specsplit.rpc.security import TlsFiles
from specsplit.transport.base import HiddenStatesSender
from specsplit.transport.grpc_bytes import GrpcSender
from specsplit.verifier.drafter_channel import DrafterChannel, TransportConfigError
from specsplit.verifier.drafter_pool import DNS_PREFIX, DrafterPool, parse_targets
from specsplit.verifier.pool_channel import PoolChannel
from specsplit.verifier.socket_channel import SocketChannel


def make_channel(
    address: str | None,
    timeout_s: float = 30.0,
    *,
    tls: TlsFiles | None = None,
    pool: DrafterPool | None = None,
    rpc: str = "stream",
    transport: HiddenStatesSender | None = None,
) -> DrafterChannel:
    """The channel for the verifier's flags: `address`, None (no speculation: every Propose fails at once, no drafts)
    or the `--drafter` targets, e.g. `a:50053,dns:///drafter:50053` (or `pool`, over them); `rpc` "local" (a
    co-located drafter's socket) or "stream"; `transport` (default: grpc bytes). Raises TransportConfigError where
    they do not fit together, ValueError for a target that is not HOST:PORT."""
    if rpc not in DRAFTER_RPCS:
        raise ValueError(f"drafter rpc must be one of {', '.join(DRAFTER_RPCS)}, got {rpc!r}")
    pool = pool if pool is not None else DrafterPool(parse_targets(address), tls=tls)
    transport = transport if transport is not None else GrpcSender()
    targets = pool.targets
    one_replica = len(targets) == 1 and not targets[0].startswith(DNS_PREFIX)
    # Not nccl on the socket: its sends pair with the drafter's receives through a process group that a restarted
    # drafter must re-join, which the pool's Proposes on the event loop handle.
    if rpc == "local" and transport.name == "nccl":
        raise TransportConfigError("a co-located drafter takes hidden states by cuda_ipc (grpc on CPU), not nccl")
    if targets and (transport.name != "grpc" or rpc == "local") and not one_replica:
        kind = "a co-located drafter" if rpc == "local" else f"hidden states by {transport.name}"
        raise TransportConfigError(
            f"{kind} needs exactly one --drafter HOST:PORT, got {address!r} (several drafter replicas: "
            "--placement pooled with --hidden-transport grpc)"
        )
    if rpc == "local" and one_replica:
        return SocketChannel(pool, transport, timeout_s)
    return PoolChannel(pool, transport, timeout_s)
