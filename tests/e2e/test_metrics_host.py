"""A service's Prometheus port listens where its gRPC port does (`--host`), not on every address of the machine,
unless `--metrics-host` says otherwise; read from the real process's listening sockets (/proc). The coordinator
serves metrics before it has found its verifier, so it runs here alone."""

import subprocess
import sys
import urllib.request

import pytest

from specsplit.rpc.process import free_port

from .proc import wait_listening_on


@pytest.mark.parametrize(
    "flags, wanted",
    [([], {"127.0.0.1"}), (["--metrics-host", "0.0.0.0"], {"0.0.0.0"})],
    ids=["host", "metrics-host"],
)
def test_metrics_listen_on_the_services_host(tiny_checkpoint, tmp_path, flags, wanted):
    port = free_port()
    cmd = [sys.executable, "-m", "specsplit", "serve", "coordinator", "--model", str(tiny_checkpoint)]
    cmd += ["--verifier", "127.0.0.1:1", "--host", "127.0.0.1", "--port", "0", "--metrics-port", str(port), *flags]
    with open(tmp_path / "coordinator.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        assert wait_listening_on(proc.pid, port) == wanted, (tmp_path / "coordinator.log").read_text()[-3000:]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            assert response.status == 200 and b"# TYPE" in response.read()
    finally:
        proc.kill()  # it waits for a verifier that never answers
        proc.wait(30)
