"""The coordinator's series under vLLM's Prometheus names and labels, so dashboards and alerts written for vLLM work
on specsplit for the series both have (docs/design.md §6 lists them).

vLLM's names carry a colon (`vllm:num_requests_running`), which OpenTelemetry instrument names cannot, so these go
to prometheus_client's default registry directly (served by `--metrics-port` and the HTTP API's /metrics; not
exported by OTLP, which has the `specsplit.*` instruments of `observability.py`). Every series has vLLM's
`model_name` label: the name the HTTP API answers to. Draft positions are 0-based, as vLLM labels them."""

from __future__ import annotations

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# vLLM's buckets for these histograms (vllm/v1/metrics/loggers.py).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)

_model = {"name": ""}  # set once by the server (set_model_name)

prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens prefilled", ["model_name"])
generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", ["model_name"])
request_success = Counter("vllm:request_success", "Finished requests", ["model_name", "finished_reason"])
time_to_first_token = Histogram(
    "vllm:time_to_first_token_seconds", "Time to first token", ["model_name"], buckets=_TTFT_BUCKETS
)
time_per_output_token = Histogram(
    "vllm:time_per_output_token_seconds", "Mean time per output token", ["model_name"], buckets=_TPOT_BUCKETS
)
e2e_request_latency = Histogram(
    "vllm:e2e_request_latency_seconds", "Arrival to last token", ["model_name"], buckets=_E2E_BUCKETS
)
spec_decode_num_drafts = Counter("vllm:spec_decode_num_drafts", "Verify steps that carried drafts", ["model_name"])
spec_decode_num_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified", ["model_name"])
spec_decode_num_accepted_tokens = Counter(
    "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", ["model_name"]
)
spec_decode_num_accepted_tokens_per_pos = Counter(
    "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted drafts by position (0-based)", ["model_name", "position"]
)


def set_model_name(name: str) -> None:
    _model["name"] = name


def model() -> str:
    return _model["name"]


class _SchedulerGauges:
    """vllm:num_requests_running and vllm:num_requests_waiting, read from the scheduler at each scrape; with prefix
    caching, vllm:prefix_cache_queries and vllm:prefix_cache_hits (prompt tokens of admitted requests, and those the
    verifier's cache held), labelled worker="verifier" (the drafter counts its own MTP-KV hits)."""

    def __init__(self):
        self.scheduler = None

    def collect(self):
        if self.scheduler is None:
            return
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests running", len(self.scheduler.running)),
            ("vllm:num_requests_waiting", "Requests waiting", self.scheduler.num_waiting),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric([model()], value)
            yield gauge
        cache = self.scheduler.prefix_cache
        if cache is None:
            return
        for name, doc, value in (
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", cache.queries),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", cache.hits),
        ):
            counter = CounterMetricFamily(name, doc, labels=["model_name", "worker"])
            counter.add_metric([model(), "verifier"], value)
            yield counter


scheduler_gauges = _SchedulerGauges()
REGISTRY.register(scheduler_gauges)
