"""OpenTelemetry across every hop, read back from the span files the three real processes write
(OTEL_TRACES_EXPORTER=file), from an OTLP/gRPC receiver, and from the Prometheus endpoints."""

import json
import signal
import threading
import time
import urllib.request
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from specsplit import Client
from specsplit.cli.launcher import LocalCluster
from specsplit.rpc.process import free_port


def _spans(trace_dir):
    out = []
    for f in sorted(trace_dir.glob("*.jsonl")):
        out += [json.loads(line) for line in f.read_text().splitlines()]
    return out


@pytest.fixture(scope="module")
def traced(tiny_checkpoint, tmp_path_factory):
    """Runs a few requests (one alone, two batched, one after the drafter died); returns the spans."""
    tmp = tmp_path_factory.mktemp("traced")
    ports = {"coordinator": free_port(), "drafter": free_port()}
    env = {"OTEL_TRACES_EXPORTER": "file", "SPECSPLIT_TRACE_DIR": str(tmp / "traces")}
    cluster = LocalCluster(
        tiny_checkpoint,
        num_speculative_tokens=2,
        log_dir=tmp,
        env=env,
        # A fixed k: every iteration proposes, so each request's trace has its Propose spans (and the failed ones).
        coordinator_args=["--metrics-port", str(ports["coordinator"]), "--no-adaptive"],
        drafter_args=["--metrics-port", str(ports["drafter"])],
    )
    with cluster, Client(cluster.address, timeout=60) as client:
        alone = client.generate(prompt_token_ids=[5, 6, 7], max_tokens=6, ignore_eos=True, request_id="alone")
        # Two requests that certainly overlap: the long one streams, and the short one is sent only once the
        # long one has its first token, so it arrives while the long one has many iterations left (two threads
        # started together could arrive one after the other had finished on a loaded machine).
        running = threading.Event()

        def long_request():
            for _ in client.stream(prompt_token_ids=[9, 0], max_tokens=200, ignore_eos=True, request_id="batched-0"):
                running.set()

        long = threading.Thread(target=long_request)
        long.start()
        assert running.wait(60)
        client.generate(prompt_token_ids=[9, 1], max_tokens=8, ignore_eos=True, request_id="batched-1")
        long.join(120)
        assert not long.is_alive()
        metrics = {
            role: urllib.request.urlopen(f"http://127.0.0.1:{p}/metrics", timeout=10).read().decode()
            for role, p in ports.items()
        }
        time.sleep(1.5)  # the drafter's span batch (0.5 s) is exported before it is killed
        cluster.kill("drafter", signal.SIGKILL)
        client.generate(prompt_token_ids=[5], max_tokens=3, ignore_eos=True, request_id="no-drafter")
    return {"spans": _spans(tmp / "traces"), "alone": alone, "metrics": metrics}


def _trace_of(spans, request_id):
    root = next(s for s in spans if s["name"] == "generate" and s["attributes"]["specsplit.request_id"] == request_id)
    return root, [s for s in spans if s["trace_id"] == root["trace_id"]]


def test_one_trace_id_spans_all_three_services(traced):
    root, trace = _trace_of(traced["spans"], "alone")
    services = {s["service"] for s in trace}
    assert services == {"specsplit-coordinator", "specsplit-verifier", "specsplit-drafter"}
    assert root["attributes"]["gen_ai.operation.name"] == "text_completion"
    assert root["attributes"]["gen_ai.usage.input_tokens"] == 3
    assert root["attributes"]["gen_ai.usage.output_tokens"] == 6


def test_server_spans_are_children_of_the_callers_client_spans(traced):
    _, trace = _trace_of(traced["spans"], "alone")
    by_id = {s["span_id"]: s for s in trace}
    verifies = [s for s in trace if s["name"] == "Verify"]
    proposes = [s for s in trace if s["name"] == "Propose"]
    assert verifies and proposes
    assert all(
        by_id[s["parent_id"]]["name"] == "verify" and by_id[s["parent_id"]]["kind"] == "CLIENT" for s in verifies
    )
    assert all(by_id[s["parent_id"]]["name"] == "send_hidden_states" for s in proposes)
    # LocalCluster's default control paths: the trace context crossed both Unix sockets.
    assert {s["attributes"]["specsplit.drafter_rpc"] for s in proposes} == {"local"}
    assert {s["attributes"]["specsplit.verifier_rpc"] for s in verifies} == {"local"}
    # Async scheduling with one co-located drafter: the step thread makes the Proposes itself on its socket.
    assert {s["attributes"]["specsplit.proposer"] for s in verifies} == {"colocated"}
    for name in ("prepare_inputs", "target_forward", "rejection_sample", "wait_for_drafts", "plan_ahead"):
        assert all(by_id[s["parent_id"]]["name"] == "Verify" for s in trace if s["name"] == name)
    # The step planned while its drafts were on their way, and ran on that plan (the drafter made every draft).
    plans = [s for s in trace if s["name"] == "plan_ahead"]
    assert plans and all(s["attributes"]["specsplit.plan_used"] for s in plans)
    assert {s["name"] for s in trace} >= {"schedule", "post_step", "mtp_step_0", "mtp_steps_1_to_k"}


def test_each_iteration_links_to_its_predecessor_and_counts_add_up(traced):
    _, trace = _trace_of(traced["spans"], "alone")
    iterations = sorted(
        (s for s in trace if s["name"] == "iteration"), key=lambda s: s["attributes"]["specsplit.iteration"]
    )
    assert len(iterations) >= 2
    for prev, cur in zip(iterations, iterations[1:]):
        links = [link for link in cur["links"] if link["attributes"]["specsplit.link"] == "previous_iteration"]
        assert [link["span_id"] for link in links] == [prev["span_id"]]
    for it in iterations:
        a = it["attributes"]
        assert a["specsplit.accepted"] + a["specsplit.rejected"] == a["specsplit.drafts_scheduled"]
        assert a["specsplit.batch_size"] == 1 and "specsplit.queue_time_ms" in a
    assert (
        sum(it["attributes"]["specsplit.drafts_scheduled"] for it in iterations)
        == traced["alone"].stats.num_draft_tokens
    )
    assert any(it["attributes"]["specsplit.hidden_state_bytes"] > 0 for it in iterations)


def test_batched_iteration_links_the_other_requests(traced):
    spans = traced["spans"]
    roots = {s["span_id"]: s for s in spans if s["name"] == "generate"}
    batched = [s for s in spans if s["name"] == "iteration" and s["attributes"]["specsplit.batch_size"] == 2]
    assert batched
    for it in batched:
        others = [link for link in it["links"] if link["attributes"]["specsplit.link"] == "batched_request"]
        assert len(others) == 1 and others[0]["span_id"] in roots


def test_a_failed_call_leaves_an_error_span(traced):
    _, trace = _trace_of(traced["spans"], "no-drafter")
    sends = [s for s in trace if s["name"] == "send_hidden_states"]
    assert sends and all(s["status"] == "ERROR" for s in sends)
    # Async scheduling: a Verify reports the Propose whose drafts it verified, the one before it. The
    # first Verify of this request reports the previous request's last Propose (made before the kill).
    # A Verify after one that sent no Propose (its request's last token: no drafts wanted) reports none.
    verifies = sorted((s for s in trace if s["name"] == "Verify"), key=lambda s: s["start_ns"])
    reported = [
        s["attributes"]["specsplit.drafter_ok"] for s in verifies[1:] if "specsplit.drafter_ok" in s["attributes"]
    ]
    assert len(reported) >= 1 and not any(reported)


def test_prometheus_endpoints_export_the_speculative_metrics(traced):
    coord, drafter = traced["metrics"]["coordinator"], traced["metrics"]["drafter"]
    for name in (
        "specsplit_draft_tokens_total",
        "specsplit_accepted_tokens_total",
        "specsplit_requests_total",
        "specsplit_time_to_first_token_seconds_bucket",
        "specsplit_iteration_duration_seconds_bucket",
        "specsplit_queue_depth",
        "specsplit_accepted_tokens_per_position_total",
    ):
        assert name in coord, name
    assert "specsplit_drafter_queue_depth" in drafter
    assert "specsplit_drafter_propose_latency_seconds_bucket" in drafter


class _Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.services: set[str] = set()

    def Export(self, request, context):
        for rs in request.resource_spans:
            for attr in rs.resource.attributes:
                if attr.key == "service.name":
                    self.services.add(attr.value.string_value)
        return trace_service_pb2.ExportTraceServiceResponse()


def test_all_three_services_export_to_an_otlp_endpoint(tiny_checkpoint, tmp_path):
    receiver = _Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_METRICS_EXPORTER": "none",
    }
    try:
        with LocalCluster(tiny_checkpoint, num_speculative_tokens=2, log_dir=tmp_path, env=env) as cluster:
            with Client(cluster.address, timeout=60) as client:
                client.generate(prompt_token_ids=[5, 6], max_tokens=4)
            deadline = time.monotonic() + 20
            want = {"specsplit-coordinator", "specsplit-verifier", "specsplit-drafter"}
            while time.monotonic() < deadline and not want <= receiver.services:
                time.sleep(0.2)
        assert want <= receiver.services
    finally:
        server.stop(0)
