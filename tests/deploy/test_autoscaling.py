"""The drafter autoscaler's rule, end to end: Kubernetes' HPA algorithm over the metrics and targets of the rendered
manifests (`kubectl kustomize`), fed with the custom metrics the Prometheus adapter's queries (its values.yaml) read
from a real Prometheus scraping a real drafter. A drafter at light load keeps its replicas; one slower than the
latency target is scaled up.

The drafter here runs on the CPU, so the CPU demo's targets decide (cpu-demo: p95 of Propose latency 200 ms, queue
depth 2, 2 to 4 replicas); the GPU overlay's 50 ms target (pooled) scales the slowed drafter up too."""

from __future__ import annotations

import math
import re
import sys

import pytest
from deploy_tools import K8S, by_kind, kustomize

from tests.e2e.prometheus import ScrapedCluster, adapter_query
from tests.fixtures.tiny import write_tiny_checkpoint

DRAFTER = "specsplit-drafter"
TOLERANCE = 0.1  # kube-controller-manager's --horizontal-pod-autoscaler-tolerance (its default)
SLOW_PROPOSE_S = 0.3  # over the CPU demo's 200 ms target, and well under a generation's timeout


def quantity(text: str) -> float:
    """A Kubernetes quantity as the HPA targets here write them: a decimal, or milli-units (`200m`)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(m?)", text)
    assert m, f"quantity {text!r}: only decimals and milli-units are read here"
    return float(m.group(1)) / (1000 if m.group(2) else 1)


def desired_replicas(hpa: dict, current: int, values: dict[str, list[float]]) -> int:
    """The replica count Kubernetes' horizontal pod autoscaler asks for with `Pods` metrics and `AverageValue` targets
    (every pod ready and reporting): per metric, the ratio of its average over the pods to its target; a ratio within
    TOLERANCE of 1 keeps `current`, another asks for ceil(ratio * current); the largest ask over the metrics, clamped
    to minReplicas..maxReplicas. `values`: each metric's value per pod, by metric name."""
    asks = []
    for metric in hpa["metrics"]:
        assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue", metric
        pods = values[metric["pods"]["metric"]["name"]]
        ratio = sum(pods) / len(pods) / quantity(metric["pods"]["target"]["averageValue"])
        asks.append(current if abs(ratio - 1) <= TOLERANCE else math.ceil(ratio * current))
    return min(max(max(asks), hpa["minReplicas"]), hpa["maxReplicas"])


def drafter_autoscaler(overlay: str) -> tuple[dict, int]:
    """The overlay's drafter HPA spec and the replicas its drafter Deployment starts with."""
    docs = kustomize(str(K8S / "overlays" / overlay))
    deployment = by_kind(docs, "Deployment")[DRAFTER]
    return by_kind(docs, "HorizontalPodAutoscaler")[DRAFTER]["spec"], deployment["spec"]["replicas"]


def custom_metrics(scraped: ScrapedCluster, hpa: dict) -> dict[str, list[float]]:
    """What the adapter serves for each metric the HPA watches, for the one drafter pod (its value per pod)."""
    pod = ScrapedCluster.POD["drafter"]
    values = {}
    for metric in hpa["metrics"]:
        name = metric["pods"]["metric"]["name"]
        result = scraped.prometheus.query(adapter_query(name, [pod]))
        assert list(result) == [(("pod", pod),)], f"{name}: {result}"
        values[name] = list(result.values())
        assert all(math.isfinite(v) for v in values[name]), f"{name}: {values[name]}"
    return values


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", architecture="llama", seed=1)


def _scrape(checkpoint, directory, send, role_commands=None) -> dict:
    """The custom metrics of both overlays' HPAs after `send`'s traffic, and the Proposes' mean latency."""
    with ScrapedCluster(checkpoint, directory, role_commands=role_commands) as scraped:
        means = scraped.measure(send)["means"]
        return {
            "propose_mean_s": means["specsplit_drafter_propose_latency_seconds"],
            "metrics": {o: custom_metrics(scraped, drafter_autoscaler(o)[0]) for o in ("cpu-demo", "pooled")},
        }


@pytest.fixture(scope="module")
def light_load(checkpoint, tmp_path_factory):
    """A few sequential requests to a drafter as fast as the CPU makes it."""

    def send(client):
        for i in range(4):
            client.generate(prompt_token_ids=[5, 6, 7, i], max_tokens=16, ignore_eos=True)

    return _scrape(checkpoint, tmp_path_factory.mktemp("light"), send)


@pytest.fixture(scope="module")
def slowed(checkpoint, tmp_path_factory):
    """Two short sequential requests to a drafter each of whose Proposes sleeps SLOW_PROPOSE_S."""

    def send(client):
        for i in range(2):
            client.generate(prompt_token_ids=[5, 6, 7, i], max_tokens=6, ignore_eos=True)

    slow = [sys.executable, "-m", "tests.e2e.slow_drafter", str(SLOW_PROPOSE_S), "--every-propose"]
    return _scrape(checkpoint, tmp_path_factory.mktemp("slowed"), send, role_commands={"drafter": slow})


def test_the_drafter_autoscaler_keeps_a_light_load_and_scales_up_a_slow_drafter(light_load, slowed):
    # The one drafter stands for each replica of the Deployment: every one of them would report what it reports.
    hpa, current = drafter_autoscaler("cpu-demo")
    light = desired_replicas(hpa, current, light_load["metrics"]["cpu-demo"])
    assert light <= current, (
        f"light load asks for {light} drafters (of {current}): {light_load['metrics']['cpu-demo']}, "
        f"mean Propose {light_load['propose_mean_s'] * 1e3:.2f} ms"
    )
    assert slowed["propose_mean_s"] >= SLOW_PROPOSE_S
    for overlay in ("cpu-demo", "pooled"):
        hpa, current = drafter_autoscaler(overlay)
        asked = desired_replicas(hpa, current, slowed["metrics"][overlay])
        assert asked > current, f"{overlay}: a slow drafter asks for {asked} (of {current}): {slowed['metrics']}"
