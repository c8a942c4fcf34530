"""Graceful shutdown: SIGTERM makes a service report NOT_SERVING, stop admitting work, finish what
is in flight, and exit 0. (The session's cluster, whose services drain for 1 s and give in-flight calls 60 s; the
service a test stopped is started again for the next test that takes it: tests/e2e/conftest.py.)"""

import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specsplit import Client, SpecsplitError
from specsplit.rpc.process import free_port

from .helpers import DEMO, greedy_ignoring_eos, start_streams

N_TOKENS = 40


def _health(address: str) -> str:
    try:
        with grpc.insecure_channel(address) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status
        return health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    except grpc.RpcError as err:
        return err.code().name


def test_sigterm_on_the_coordinator_finishes_in_flight_streams_then_exits_0(cluster):
    c = cluster
    got, done = [], threading.Event()

    def stream():
        with Client(c.address, timeout=120) as client:
            for delta in client.stream(prompt_token_ids=[5, 6], max_tokens=150, ignore_eos=True):
                got.extend(delta.token_ids)
                if delta.finish_reason:
                    got.append(delta.finish_reason)
        done.set()

    t = threading.Thread(target=stream)
    t.start()
    while len(got) < 5:
        time.sleep(0.01)
    coordinator = c.services["coordinator"].proc
    coordinator.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert _health(c.address) == "NOT_SERVING"  # during the delay, probes see it draining
    time.sleep(1.0)
    with Client(c.address, timeout=5) as client, pytest.raises(SpecsplitError) as err:
        client.generate(prompt_token_ids=[5], max_tokens=2)  # no new work is admitted
    assert err.value.code is grpc.StatusCode.UNAVAILABLE
    assert done.wait(60)
    assert got[-1] == "length" and len(got) == 151  # the in-flight stream finished in full
    assert coordinator.wait(30) == 0


def test_sigterm_on_a_coordinator_still_waiting_for_its_verifier_exits_0_at_once(tmp_path):
    """Its wait (up to --startup-timeout, 600 s) ends with the signal, not with the wait."""
    port, nobody = free_port(), free_port()
    log_path = tmp_path / "coordinator.log"
    command = [sys.executable, "-m", "specsplit", "serve", "coordinator", "--model", str(DEMO)]
    command += ["--verifier", f"127.0.0.1:{nobody}", "--port", str(port)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while _health(f"127.0.0.1:{port}") != "NOT_SERVING":  # serving health: past its gRPC server's start
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log_path.read_text()
        assert "stopped before its verifier answered" in log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("role", ["drafter", "verifier"])
def test_sigterm_on_a_model_service_reports_not_serving_and_exits_0(cluster, role):
    with Client(cluster.address, timeout=60) as client:  # opens the coordinator's VerifyStream
        assert client.generate(prompt_token_ids=[5, 6], max_tokens=4).token_ids
    svc = cluster.services[role]
    svc.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert _health(svc.address) == "NOT_SERVING"
    # The idle persistent stream ends at once: well inside the 60 s grace the fixture gives.
    assert svc.proc.wait(15) == 0
    # and it ends quietly: no report of native objects alive at exit (Triton's, from the interpreter's teardown)
    assert "leaked" not in svc.log_path.read_text()


@pytest.mark.parametrize("rpc", ["local", "stream"])
def test_sigterm_on_the_verifier_under_load_drains_and_a_restarted_one_loses_nothing(cluster, hf_greedy, rpc):
    """A rolling update of the verifier: SIGTERM under four concurrent streams, on the coordinator's Unix-socket
    VerifyStream (`local`, the default) and on gRPC's (`stream`). The verifier reports NOT_SERVING, ends its
    streams after the step in flight and exits 0; a verifier started again takes the work over; every stream
    completes equal to transformers' greedy output, none fails."""
    fixture_flags = list(cluster.extra["coordinator"])
    if rpc != "local":
        _restart_coordinator(cluster, [*fixture_flags, "--verifier-rpc", rpc])
    try:
        prompts = [[3 + i, 40 + i, 7] for i in range(4)]
        progressed = threading.Event()
        threads, results, errors = start_streams(
            cluster.address, prompts, N_TOKENS, lambda n: n >= 8 and progressed.set()
        )
        assert progressed.wait(60)
        verifier = cluster.services["verifier"]
        verifier.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert _health(verifier.address) == "NOT_SERVING"
        assert verifier.proc.wait(30) == 0  # drained, not killed: the streams it served were ended cleanly
        assert any(t.is_alive() for t in threads)  # streams outlived it: the restarted verifier finishes them
        assert "Traceback" not in (verifier.log_tail(200) or "")
        cluster.restart("verifier")
        for t in threads:
            t.join(240)
        assert not errors, errors
        for i, p in enumerate(prompts):
            assert results[i] == greedy_ignoring_eos(hf_greedy, p, N_TOKENS), f"stream {i}"
    finally:
        if rpc != "local":
            _restart_coordinator(cluster, fixture_flags)


def _restart_coordinator(cluster, flags: list[str]) -> None:
    """Starts the session cluster's coordinator again with these extra flags."""
    coordinator = cluster.services["coordinator"]
    coordinator.proc.send_signal(signal.SIGTERM)
    assert coordinator.proc.wait(30) == 0
    cluster.extra["coordinator"] = flags
    cluster.restart("coordinator")
