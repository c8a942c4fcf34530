"""Drafter replicas behind one verifier: where they are, whether they answer, who owns a request.

A request's MTP KV cache lives on one drafter replica, so the request sticks to it. A request is
placed by consistent hashing of its id on a ring of the healthy replicas (virtual nodes spread the
load) and keeps that owner while the owner is healthy: a replica that joins takes new requests and
moves none. When the owner fails, the request is placed again on the ring of the remaining replicas;
the new owner has no history for it and starts its MTP state afresh (drafts resume after one
iteration, output never changes). A failed replica is probed on `grpc.health.v1` with backoff and
joins the ring again when it answers SERVING.

Targets (`--drafter`): comma-separated `HOST:PORT` (kept as given) and `dns:///NAME:PORT` (a
Kubernetes headless service: one address per ready pod, re-resolved every `resolve_interval_s`).
This module never imports torch.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import logging
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specsplit.proto import drafter_pb2, drafter_pb2_grpc
from specsplit.rpc.security import TlsFiles
from specsplit.rpc.server import CHANNEL_OPTIONS

log = logging.getLogger(__name__)

DRAFTER_SERVICE = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name
DNS_PREFIX = "dns:///"
Resolver = Callable[[str, int], list[str]]  # (host, port) -> ["ip:port", ...]


def parse_targets(spec: str | None) -> list[str]:
    """`a:1, dns:///drafter:50053` -> ["a:1", "dns:///drafter:50053"]; raises ValueError on a bad entry."""
    targets = [t.strip() for t in (spec or "").split(",") if t.strip()]
    for t in targets:
        host, _, port = t.removeprefix(DNS_PREFIX).rpartition(":")
        if t.startswith("dns:") and not t.startswith(DNS_PREFIX):
            raise ValueError(f"drafter target {t!r}: write DNS names as dns:///NAME:PORT")
        if not host or not port.isdigit():
            raise ValueError(f"drafter target {t!r} is not HOST:PORT or dns:///NAME:PORT")
    return targets


def resolve_dns(host: str, port: int) -> list[str]:
    """Every address of `host` (IPv4 when it has any, else IPv6), as sorted "ip:port" strings."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    v4 = sorted({i[4][0] for i in infos if i[0] == socket.AF_INET})
    if v4:
        return [f"{ip}:{port}" for ip in v4]
    return [f"[{ip}]:{port}" for ip in sorted({i[4][0] for i in infos if i[0] == socket.AF_INET6})]


def _hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing: a key maps to the first virtual node clockwise of its hash."""

    def __init__(self, nodes: Iterable[str], vnodes: int = 64):
        points = sorted((_hash(f"{node}#{v}"), node) for node in set(nodes) for v in range(vnodes))
        self._hashes = [h for h, _ in points]
        self._nodes = [n for _, n in points]

    def lookup(self, key: str) -> str | None:
        if not self._nodes:
            return None
        i = bisect.bisect(self._hashes, _hash(key)) % len(self._nodes)
        return self._nodes[i]


@dataclass
class ReplicaStats:
    requests: int = 0  # requests placed on this replica (new or moved here)
    proposals: int = 0  # request-iterations sent to it
    calls: int = 0  # Propose/Free RPCs made
    failures: int = 0  # RPCs that failed (each one takes the replica out until it answers a probe)


@dataclass
class Replica:
    address: str
    server_name: str | None  # the DNS name a TLS certificate is checked against (None: the address)
    channel: grpc.aio.Channel
    stub: drafter_pb2_grpc.DrafterStub
    healthy: bool = True
    pending_free: list[str] = field(default_factory=list)  # frees for requests it owned
    # Prefix caching: blocks of requests it owns to register (request id, block index, key), sent once.
    pending_cached: list[tuple[str, int, bytes]] = field(default_factory=list)
    stats: ReplicaStats = field(default_factory=ReplicaStats)
    probe: asyncio.Task | None = None

    def take_cached(self) -> list[tuple[str, int, bytes]]:
        """The registrations for its next Propose (a registration lost with a failed call costs only a cache miss)."""
        cached, self.pending_cached = self.pending_cached, []
        return cached

    def freed(self, request_ids: list[str]) -> None:
        """Event loop: these frees reached the replica (a call that carried them was answered): out of the queue.
        By id, not by count: a free sent again by a later call still unanswered, or queued meanwhile, stays."""
        if request_ids:
            sent = set(request_ids)
            self.pending_free[:] = [rid for rid in self.pending_free if rid not in sent]


class DrafterPool:
    def __init__(
        self,
        targets: list[str],
        *,
        resolve_interval_s: float = 5.0,
        vnodes: int = 64,
        probe_timeout_s: float = 1.0,
        backoff_s: tuple[float, float] = (0.2, 5.0),
        resolver: Resolver = resolve_dns,
        tls: TlsFiles | None = None,
    ):
        self.targets = targets
        self.resolve_interval_s = resolve_interval_s
        self.vnodes = vnodes
        self.probe_timeout_s = probe_timeout_s
        self.backoff_s = backoff_s
        self.resolver = resolver
        self.tls = tls
        self.replicas: dict[str, Replica] = {}
        self.owner: dict[str, str] = {}  # request_id -> replica address
        self._ring = HashRing([])
        self._resolved: dict[str, list[str]] = {}  # dns target -> last addresses it gave
        self._started = False
        self._resolve_task: asyncio.Task | None = None

    async def start(self) -> None:
        """Resolves the targets once and starts re-resolving DNS names; idempotent."""
        if self._started:
            return
        self._started = True
        await self.resolve()
        if any(t.startswith(DNS_PREFIX) for t in self.targets):
            self._resolve_task = asyncio.ensure_future(self._resolve_loop())

    async def _resolve_loop(self) -> None:
        while True:
            await asyncio.sleep(self.resolve_interval_s)
            await self.resolve()

    async def resolve(self) -> None:
        """Brings the replica set up to date with the targets (DNS answers may change)."""
        loop = asyncio.get_running_loop()
        addresses: dict[str, str | None] = {}
        for t in self.targets:
            if not t.startswith(DNS_PREFIX):
                addresses[t] = None
                continue
            host, _, port = t.removeprefix(DNS_PREFIX).rpartition(":")
            try:
                found = await asyncio.wait_for(loop.run_in_executor(None, self.resolver, host, int(port)), 5.0)
                self._resolved[t] = found
            except (OSError, asyncio.TimeoutError) as err:
                log.warning("cannot resolve drafter %s (%s); keeping %s", t, err, self._resolved.get(t, []))
            addresses.update((a, host) for a in self._resolved.get(t, []))
        self._set_replicas(addresses)

    def _open(self, address: str, server_name: str | None) -> grpc.aio.Channel:
        """Plaintext, or mutual TLS checking the peer's certificate for `server_name`."""
        if self.tls is None:
            return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        options = [*CHANNEL_OPTIONS, *([("grpc.ssl_target_name_override", server_name)] if server_name else [])]
        return grpc.aio.secure_channel(address, self.tls.channel_credentials(), options=options)

    def _set_replicas(self, addresses: dict[str, str | None]) -> None:
        """addresses: replica address -> DNS name it was found under (None for a listed address)."""
        wanted = set(addresses)
        for addr in sorted(wanted - self.replicas.keys()):
            channel = self._open(addr, addresses[addr])
            self.replicas[addr] = Replica(addr, addresses[addr], channel, drafter_pb2_grpc.DrafterStub(channel))
            log.info("drafter replica %s added", addr)
        for addr in sorted(self.replicas.keys() - wanted):
            replica = self.replicas.pop(addr)
            if replica.probe is not None:
                replica.probe.cancel()
            asyncio.ensure_future(replica.channel.close(grace=30.0))  # let calls in flight finish
            log.info("drafter replica %s removed", addr)
        self._rebuild_ring()

    def _rebuild_ring(self) -> None:
        self._ring = HashRing([a for a, r in self.replicas.items() if r.healthy], self.vnodes)

    def healthy(self) -> list[str]:
        return sorted(a for a, r in self.replicas.items() if r.healthy)

    def assign(self, request_ids: list[str]) -> list[str | None]:
        """The replica that drafts for each request this iteration (None: no healthy replica)."""
        out: list[str | None] = []
        for rid in request_ids:
            old = self.owner.get(rid)
            replica = self.replicas.get(old) if old else None
            if replica is None or not replica.healthy:
                new = self._ring.lookup(rid)
                if new is None:
                    out.append(None)
                    continue
                self._place(rid, old, new)
                replica = self.replicas[new]
            out.append(replica.address)
        return out

    def _place(self, rid: str, old: str | None, new: str) -> None:
        self.owner[rid] = new
        self.replicas[new].stats.requests += 1
        if old is None:
            log.debug("request %s -> drafter %s", rid, new)
            return
        log.info("request %s moved from drafter %s to %s", rid, old, new)
        if old in self.replicas:  # its stale MTP state there goes when that replica answers again
            self.replicas[old].pending_free.append(rid)

    def cache_blocks(self, blocks: list[tuple[str, int, bytes]]) -> None:
        """Registrations queued on the replica owning each request (none where it has no owner)."""
        for block in blocks:
            replica = self.replicas.get(self.owner.get(block[0], ""))
            if replica is not None:
                replica.pending_cached.append(block)

    def free(self, request_ids: list[str]) -> None:
        """Queues frees for the replica that owns each request (sent with its next call)."""
        for rid in request_ids:
            replica = self.replicas.get(self.owner.pop(rid, ""))
            if replica is not None:
                replica.pending_free.append(rid)

    def record_call(self, address: str, num_proposals: int, error: str | None = None) -> None:
        """Counts one RPC to a replica; a failed one takes the replica off the ring until a
        health probe says it is SERVING again."""
        replica = self.replicas.get(address)
        if replica is None:
            return
        replica.stats.calls += 1
        replica.stats.proposals += num_proposals
        if error is None:
            return
        replica.stats.failures += 1
        if not replica.healthy:
            return
        log.warning(
            "drafter %s failed (%s); its requests move to %s",
            address,
            error,
            [a for a in self.healthy() if a != address] or "no replica (no drafts)",
        )
        replica.healthy = False
        self._rebuild_ring()
        replica.probe = asyncio.ensure_future(self._probe_until_back(replica))

    async def _probe_until_back(self, replica: Replica) -> None:
        delay, max_delay = self.backoff_s
        request = health_pb2.HealthCheckRequest(service=DRAFTER_SERVICE)
        while True:
            await asyncio.sleep(delay)
            # A fresh connection each try: the old one may be stuck behind a dead link.
            old = replica.channel
            replica.channel = self._open(replica.address, replica.server_name)
            replica.stub = drafter_pb2_grpc.DrafterStub(replica.channel)
            asyncio.ensure_future(old.close())
            try:
                resp = await health_pb2_grpc.HealthStub(replica.channel).Check(request, timeout=self.probe_timeout_s)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError:
                pass
            delay = min(2 * delay, max_delay)
        if self.replicas.get(replica.address) is replica:
            replica.healthy = True
            replica.probe = None
            self._rebuild_ring()
            log.info("drafter %s is back", replica.address)

    def stats(self) -> dict[str, ReplicaStats]:
        """A snapshot of the per-replica counters, by address."""
        return {a: replace(r.stats) for a, r in self.replicas.items()}

    async def close(self) -> None:
        if self._resolve_task is not None:
            self._resolve_task.cancel()
        for replica in self.replicas.values():
            if replica.probe is not None:
                replica.probe.cancel()
            await replica.channel.close()
        summary = ", ".join(f"{a}: {s}" for a, s in self.stats().items())
        log.info("drafter pool closed; %s", summary or "no replicas")
