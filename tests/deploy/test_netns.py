"""Coordinator, verifier and two drafters, each on its own host (network namespace, veth, address).

Proves across real links: greedy output through the four processes equals transformers' greedy
decoding; requests spread over both drafters and each sticks to one; cutting one drafter's link
mid-generation changes no token (its requests move to the other drafter); when the link comes back
the drafter is used again for new requests, which get drafts from it.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from netns_hosts import HostProcess, Hosts, netns_unavailable

from specsplit import AsyncClient
from specsplit.verifier.drafter_pool import HashRing
from tests.fixtures.tiny import write_tiny_checkpoint

PORTS = {"coordinator": 50051, "verifier": 50052, "a": 50053, "b": 50053}
DRAFTER_TIMEOUT_S = 1.0
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", architecture="llama", seed=1)


@pytest.fixture(scope="module")
def greedy(checkpoint):
    """transformers' greedy decoding of n tokens, continued past EOS like `ignore_eos`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()

    def generate(prompt: list[int], n: int) -> list[int]:
        out: list[int] = []
        with torch.no_grad():
            while len(out) < n:
                ids = torch.tensor([prompt + out])
                new = model.generate(
                    ids, max_new_tokens=n - len(out), do_sample=False, pad_token_id=model.generation_config.eos_token_id
                )
                out += new[0, ids.shape[1] :].tolist()
        return out[:n]

    return generate


@pytest.fixture
def hosts():
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    with Hosts(list(PORTS)) as h:
        yield h
    assert not h.exists()


@pytest.fixture
def services(hosts, checkpoint, tmp_path, monkeypatch):
    """The four services on their hosts; stopped (SIGTERM, then SIGKILL) whatever happens."""
    for name in [k for k in os.environ if "proxy" in k.lower()]:  # the hosts are reached directly
        monkeypatch.delenv(name)
    env = dict(os.environ)
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", OTEL_SDK_DISABLED="true")
    addr = {n: f"{hosts.addr[n]}:{p}" for n, p in PORTS.items()}

    def serve(name: str, role: str, *extra: str) -> HostProcess:
        cmd = [
            sys.executable,
            "-m",
            "specsplit",
            "serve",
            role,
            "--host",
            hosts.addr[name],
            "--port",
            str(PORTS[name]),
            "--model",
            str(checkpoint),
            *extra,
        ]
        return HostProcess.start(hosts, name, cmd, tmp_path, env)

    procs: dict[str, HostProcess] = {}
    # Drafters on hosts of their own. These hosts share one filesystem, where a pooled drafter's Unix socket would
    # be on the verifier's host (and taken, past the links): their socket files are removed once they serve.
    sockets = {name: Path(tempfile.mkdtemp(prefix=f"ns-{name}-")) for name in ("a", "b")}  # (short paths)
    try:
        procs["a"] = serve("a", "drafter", "--placement", "pooled", "--socket-dir", str(sockets["a"]))
        procs["b"] = serve("b", "drafter", "--placement", "pooled", "--socket-dir", str(sockets["b"]))
        procs["verifier"] = serve(
            "verifier",
            "verifier",
            "--drafter",
            f"{addr['a']},{addr['b']}",
            "--placement",
            "pooled",
            "--drafter-timeout",
            str(DRAFTER_TIMEOUT_S),
            "--log-level",
            "DEBUG",
        )
        procs["coordinator"] = serve(
            "coordinator",
            "coordinator",
            *["--verifier", addr["verifier"], "--verifier-rpc", "stream", "--num-speculative-tokens", "3"],
            "--no-adaptive",  # drafts every iteration: the drafters' placement is what is tested
        )
        deadline = time.monotonic() + 150  # four processes importing torch on two cores
        for name, p in procs.items():
            role = "drafter" if name in ("a", "b") else name
            p.wait_for_line(f"{role} listening on {addr[name]}", deadline)
        for directory in sockets.values():
            (socket_file,) = directory.glob("drafter-*.sock")
            socket_file.unlink()
        yield procs, addr
    finally:
        for p in procs.values():  # all drain at once, then each is waited for (SIGKILL if it hangs)
            if p.proc.poll() is None:
                p.proc.terminate()
        for p in procs.values():
            p.stop()
        for directory in sockets.values():
            shutil.rmtree(directory, ignore_errors=True)


def ids_on(ring: HashRing, replica: str, prefix: str, n: int) -> list[str]:
    """The first n request ids `prefix-i` that the ring places on `replica`."""
    return [rid for rid in (f"{prefix}-{i}" for i in range(1000)) if ring.lookup(rid) == replica][:n]


def prompt_of(rid: str) -> list[int]:
    i = int(rid.rsplit("-", 1)[1])
    return [(7 * i + j) % 250 + 3 for j in range(3 + i % 9)]


async def generate_all(address: str, rids: list[str], on_progress=None) -> dict[str, tuple[list[int], object]]:
    """Streams every request concurrently; on_progress(tokens so far by id) after each delta."""
    got: dict[str, list[int]] = {rid: [] for rid in rids}
    stats: dict[str, object] = {}

    async with AsyncClient(address, timeout=120) as client:

        async def one(rid: str) -> None:
            async for delta in client.stream(
                prompt_token_ids=prompt_of(rid), max_tokens=MAX_TOKENS, ignore_eos=True, request_id=rid
            ):
                got[rid].extend(delta.token_ids)
                stats[rid] = delta.stats or stats.get(rid)
                if on_progress is not None:
                    on_progress(got)

        await asyncio.wait_for(asyncio.gather(*(one(r) for r in rids)), timeout=120)
    return {rid: (got[rid], stats[rid]) for rid in rids}


def placements(log: str) -> dict[str, str]:
    """request id -> the drafter it ended on, from the verifier's pool log."""
    out: dict[str, str] = {}
    for rid, to in re.findall(r"request (\S+) -> drafter (\S+)", log):
        out[rid] = to
    for rid, to in re.findall(r"request (\S+) moved from drafter \S+ to (\S+)", log):
        out[rid] = to
    return out


def test_drafters_on_other_hosts_lose_a_link_and_come_back_without_changing_output(hosts, services, greedy):
    procs, addr = services
    verifier = procs["verifier"]
    ring = HashRing([addr["a"], addr["b"]])  # the verifier's placement while both drafters are up

    # 1. Requests spread over both drafters; drafter b's link is cut while they generate.
    before = ids_on(ring, addr["a"], "before", 3) + ids_on(ring, addr["b"], "before", 3)
    cut = {"done": False}

    def cut_when_all_have_started(got: dict[str, list[int]]) -> None:
        if not cut["done"] and all(len(toks) >= 8 for toks in got.values()):
            hosts.cut("b")
            cut["done"] = True

    results = asyncio.run(generate_all(addr["coordinator"], before, cut_when_all_have_started))
    assert cut["done"]
    for rid, (tokens, _) in results.items():
        assert tokens == greedy(prompt_of(rid), MAX_TOKENS), rid
    log = verifier.log()
    assert f"drafter {addr['b']} failed" in log
    for rid in before[3:]:  # b's requests went on, with drafts from a
        assert f"request {rid} moved from drafter {addr['b']} to {addr['a']}" in log
    assert all(stats.num_draft_tokens > 0 for _, stats in results.values())

    # 2. The link comes back: the verifier's health probe finds b again, new requests go to it.
    hosts.restore("b")
    verifier.wait_for_log(f"drafter {addr['b']} is back", timeout_s=30)
    after = ids_on(ring, addr["a"], "after", 3) + ids_on(ring, addr["b"], "after", 3)
    sent_to = {n: hosts.bytes_to(n) for n in ("a", "b")}
    results = asyncio.run(generate_all(addr["coordinator"], after))
    sent_to = {n: hosts.bytes_to(n) - sent_to[n] for n in ("a", "b")}
    for rid, (tokens, stats) in results.items():
        assert tokens == greedy(prompt_of(rid), MAX_TOKENS), rid
        assert stats.num_draft_tokens > 0, rid  # drafting resumed, on b for b's requests

    placed = placements(verifier.log())
    assert {rid: placed[rid] for rid in after} == {rid: ring.lookup(rid) for rid in after}  # no move
    counts = {n: sum(1 for rid in before + after if placed[rid] == addr[n]) for n in ("a", "b")}
    print(f"requests per drafter (final placement): {counts}; bytes sent after the restore: {sent_to}")
    assert counts == {"a": 9, "b": 3}  # b's first three moved to a; three new ones came back to b
    assert sent_to["b"] > 10_000 and sent_to["a"] > 10_000  # hidden states crossed both links

    # 3. The verifier's own per-replica counters, logged when it stops.
    verifier.stop()
    (summary,) = re.findall(r"drafter pool closed; (.*)", verifier.log())
    for name in ("a", "b"):
        assert re.search(re.escape(addr[name]) + r": ReplicaStats\(requests=[1-9]", summary), summary
    assert re.search(re.escape(addr["b"]) + r": ReplicaStats\(.*failures=[1-9]", summary), summary
