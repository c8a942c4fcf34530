"""The latency histograms resolve the latencies they measure, read as their consumers read them: a real Prometheus
scrapes the three services of a pooled cluster serving real generations, and its `histogram_quantile` (the drafter
autoscaler's own query, from the Prometheus adapter's rules) lands near the latency the services measured.

A quantile read from buckets lies in the bucket that holds the true quantile, so it is as good as that bucket is
narrow: with bounds far apart (OpenTelemetry's default 0, 5, 10, … s on a seconds metric), a Propose of a few
milliseconds reads as a p95 of 4.75 s."""

import math

import pytest

from tests.e2e.prometheus import LATENCY_HISTOGRAMS, ScrapedCluster, adapter_query, prometheus_binary

PROPOSE = "specsplit_drafter_propose_latency_seconds"


@pytest.fixture(scope="module")
def scraped(tiny_checkpoint, tmp_path_factory):
    """Sixteen sequential generations; each latency histogram's mean (the services' own _sum/_count) and median
    (Prometheus), and the adapter's p95 of Propose latency by pod."""

    def send(client):
        for i in range(16):
            client.generate(prompt_token_ids=[5, 6, 7, i], max_tokens=24, ignore_eos=True)

    with ScrapedCluster(tiny_checkpoint, tmp_path_factory.mktemp("scraped")) as scraped:
        measured = scraped.measure(send)
        medians = {
            series: scraped.prometheus.scalar(f"histogram_quantile(0.5, sum(rate({series}_bucket[2m])) by (le))")
            for series in LATENCY_HISTOGRAMS
        }
        pod = ScrapedCluster.POD["drafter"]
        p95 = scraped.prometheus.query(adapter_query("specsplit_drafter_propose_latency_p95_seconds", [pod]))
    return {**measured, "medians": medians, "adapter_p95": p95}


def test_the_autoscalers_p95_of_propose_latency_lands_near_the_measured_latency(scraped):
    """The adapter's p95 query per drafter pod, against the p95 of the Proposes as the drafter timed each one: the
    quantile read from the buckets lies in the bucket of the true one, whose bounds are 2.5x apart (and a few
    Proposes may be in one set and not the other)."""
    ((labels, p95),) = scraped["adapter_p95"].items()
    assert labels == (("pod", ScrapedCluster.POD["drafter"]),)
    proposes = sorted(scraped["proposes"])
    assert len(proposes) >= 100  # 16 requests of 24 tokens, about one Propose per token
    measured = proposes[math.ceil(0.95 * len(proposes)) - 1]
    mean = scraped["means"][PROPOSE]
    assert measured / 3 <= p95 <= 3 * measured, (
        f"p95 {p95 * 1e3:.2f} ms, measured {measured * 1e3:.2f} ms over {len(proposes)} Proposes "
        f"(mean {mean * 1e3:.2f} ms)"
    )


@pytest.mark.parametrize("series", [s for s in LATENCY_HISTOGRAMS if s != PROPOSE])
def test_every_latency_histogram_resolves_what_it_measures(scraped, series):
    """The median against the mean from the service's own _sum/_count: a latency's median is at most twice its mean
    (half the values are at least the median), and the quantile within its bucket, whose bounds are 2.5x apart; the
    median, which the slow outliers of a loaded machine do not move, is read rather than the p95 of 16 requests."""
    mean, median = scraped["means"][series], scraped["medians"][series]
    assert mean / 5 <= median <= 5 * mean, f"{series}: median {median * 1e3:.2f} ms, mean {mean * 1e3:.2f} ms"


def test_a_missing_prometheus_fails_saying_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no prometheus on it
    with pytest.raises(pytest.fail.Exception, match=r"apt-get install -y --no-install-recommends prometheus"):
        prometheus_binary()
