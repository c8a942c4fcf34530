"""`LocalCluster` never gives a verifier or drafter a port the cluster gives one of its services otherwise: the metrics
ports after `metrics_port` are bound only as each service starts, so the OS may hand one of them out before."""

import socket

import specsplit.cli.launcher as launcher
from specsplit.cli.launcher import LocalCluster
from specsplit.rpc.process import LOWEST_PORT, _ephemeral_low, free_port


def test_worker_ports_avoid_the_clusters_metrics_and_http_ports(monkeypatch, tmp_path):
    cluster = LocalCluster(tmp_path, port=5000, metrics_port=6000, http_port=7000, log_dir=tmp_path)
    handed_out = iter([6001, 6002, 6000, 7000, 5000, 6123])
    monkeypatch.setattr(launcher, "free_port", lambda host=None: next(handed_out))
    assert cluster._worker_port() == 6123


def test_free_ports_lie_below_the_kernels_ephemeral_range_and_bind():
    """A port handed out below the ephemeral range cannot become another socket's port by bind(0) or by an outgoing
    connection before the service binds it (a verifier of `specsplit up` once found its port in use)."""
    low = _ephemeral_low()
    for _ in range(20):
        port = free_port()
        if low > LOWEST_PORT:
            assert LOWEST_PORT <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
