"""`LocalCluster` never gives a verifier or drafter a port the cluster gives one of its services otherwise: the metrics
ports after `metrics_port` are bound only as each service starts, so the OS may hand one of them out before."""

import specsplit.cli.launcher as launcher
from specsplit.cli.launcher import LocalCluster


def test_worker_ports_avoid_the_clusters_metrics_and_http_ports(monkeypatch, tmp_path):
    cluster = LocalCluster(tmp_path, port=5000, metrics_port=6000, http_port=7000, log_dir=tmp_path)
    handed_out = iter([6001, 6002, 6000, 7000, 5000, 6123])
    monkeypatch.setattr(launcher, "free_port", lambda host=None: next(handed_out))
    assert cluster._worker_port() == 6123
