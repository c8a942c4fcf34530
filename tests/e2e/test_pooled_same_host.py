"""A pooled drafter on the verifier's host: Proposes go on its Unix socket (ProposeStream without gRPC); one whose
socket is not on the verifier's host (here its file removed, as on another host) is reached on gRPC's stream. The
choice is made afresh with each new channel: a drafter that restarted is found where it is now. Greedy output
equals transformers' throughout (read back from the span files the real processes write)."""

import json
import signal
import time

from specsplit import Client
from specsplit.cli.launcher import LocalCluster
from specsplit.rpc.process import free_port
from tests.e2e.helpers import (
    check_shared_prefix_greedy,
    greedy_ignoring_eos,
    hide_drafter_socket,
    prefix_cache_counters,
)

PROMPT, MAX_TOKENS = [5, 6, 7, 8], 24


def _propose_rpcs(trace_dir, request_id: str) -> list[str]:
    """`specsplit.drafter_rpc` of every Propose span in the request's trace."""
    spans = [json.loads(line) for f in sorted(trace_dir.glob("*.jsonl")) for line in f.read_text().splitlines()]
    root = next(s for s in spans if s["name"] == "generate" and s["attributes"]["specsplit.request_id"] == request_id)
    return [
        s["attributes"]["specsplit.drafter_rpc"]
        for s in spans
        if s["trace_id"] == root["trace_id"] and s["name"] == "Propose"
    ]


def test_a_pooled_drafter_on_this_host_takes_its_socket_and_one_elsewhere_grpc(tiny_checkpoint, hf_greedy, tmp_path):
    env = {"OTEL_TRACES_EXPORTER": "file", "SPECSPLIT_TRACE_DIR": str(tmp_path / "traces")}
    want = greedy_ignoring_eos(hf_greedy, PROMPT, MAX_TOKENS)
    outputs = {}
    with LocalCluster(
        tiny_checkpoint,
        num_speculative_tokens=3,
        log_dir=tmp_path,
        env=env,
        placement="pooled",
        coordinator_args=["--no-adaptive"],  # a Propose every iteration: each request's trace shows its path
    ) as cluster:
        with Client(cluster.address, timeout=60) as client:
            outputs["same-host"] = client.generate(
                prompt_token_ids=PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, request_id="same-host"
            )
        cluster.kill("drafter", signal.SIGTERM)  # (drains: its spans are written before it exits)
        cluster.restart("drafter")
        hidden = hide_drafter_socket(cluster.services["drafter"].address)
        with Client(cluster.address, timeout=60) as client:
            # The first Propose after the restart fails on the old socket; the verifier probes the drafter back on a
            # new channel (backoff from 0.2 s) and asks where it is: no socket on this host now.
            deadline = time.monotonic() + 30
            while client.generate(prompt_token_ids=[9, 9], max_tokens=8, ignore_eos=True).stats.num_draft_tokens == 0:
                assert time.monotonic() < deadline, "no drafts 30 s after the drafter restarted"
            outputs["elsewhere"] = client.generate(
                prompt_token_ids=PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, request_id="elsewhere"
            )
        verifier_log = (tmp_path / "verifier.log").read_text()
    for name, out in outputs.items():
        assert out.token_ids == want, name
    assert outputs["elsewhere"].stats.num_draft_tokens > 0  # drafted by the restarted drafter, over gRPC
    same_host, elsewhere = (_propose_rpcs(tmp_path / "traces", rid) for rid in ("same-host", "elsewhere"))
    assert same_host and set(same_host) == {"local"}
    assert elsewhere and set(elsewhere) == {"stream"}
    assert "ProposeStream on its Unix socket" in verifier_log
    assert f"ProposeStream on gRPC (its socket {hidden!r} is not on this host)" in verifier_log


def test_a_pooled_drafter_starts_shared_prefixes_on_the_mtp_blocks_it_cached(tiny_checkpoint, hf_greedy, tmp_path):
    """Prefix caching with a pooled drafter, whose block registrations and keys go with its replica's Proposes:
    prompts sharing a prefix equal transformers' greedy output, start on the verifier's cached blocks, and the
    drafter starts each on its own cached MTP blocks of them (its `worker="drafter"` counters: every token it was
    asked for found)."""
    metrics_port = free_port()  # the drafter's is metrics_port + 2
    with LocalCluster(
        tiny_checkpoint,
        num_speculative_tokens=3,
        log_dir=tmp_path,
        placement="pooled",
        coordinator_args=["--no-adaptive"],
        metrics_port=metrics_port,
    ) as cluster:
        cached = check_shared_prefix_greedy(cluster.address, hf_greedy, seed=40)
        counters = prefix_cache_counters(f"http://127.0.0.1:{metrics_port + 2}/metrics")
    assert counters == {
        ("vllm:prefix_cache_queries_total", "drafter"): cached,
        ("vllm:prefix_cache_hits_total", "drafter"): cached,
    }
