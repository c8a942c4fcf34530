"""Adaptive speculation's draft counts are observable: per request in its stats (and on the wire and its span), per
iteration and request on the iteration span, and per request and iteration in `specsplit.spec_tokens_chosen`."""

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from specsplit.client.results import SpecStats
from specsplit.coordinator import observability as obs
from specsplit.coordinator.config import SchedulerConfig
from specsplit.coordinator.iteration import VerifyResult
from specsplit.coordinator.request import Request, SamplingParams
from specsplit.coordinator.scheduler import Scheduler


@pytest.fixture
def telemetry(monkeypatch):
    spans, reader = InMemorySpanExporter(), InMemoryMetricReader()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    monkeypatch.setattr(obs, "tracer", tracer_provider.get_tracer("test"))
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    monkeypatch.setattr(obs, "spec_tokens_chosen", meter.create_histogram("specsplit.spec_tokens_chosen"))
    return spans, reader


def test_draft_counts_in_stats_spans_and_metrics(telemetry):
    spans, reader = telemetry
    cfg = SchedulerConfig(max_model_len=256, block_size=16, num_blocks=64, num_speculative_tokens=3)
    s = Scheduler(cfg, [99])
    s.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True)))
    s.add_request(Request("b", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True, num_speculative_tokens=1)))
    chosen, verified = [], []
    for _ in range(4):
        out = s.schedule()
        span = obs.start_iteration_span(out, None, 0)
        obs.record_draft_choice(out)
        span.end()
        chosen += [x.num_spec_tokens for x in out.scheduled]
        verified.append([x.num_draft_tokens for x in out.scheduled])
        results = [
            VerifyResult(x.request.request_id, [7], x.num_draft_tokens, x.num_draft_tokens) for x in out.scheduled
        ]
        s.update_from_output(out, results)
    assert verified == [[0, 0], [3, 1], [3, 1], [3, 1]]  # no timing yet: each request's cap
    iteration_spans = [sp for sp in spans.get_finished_spans() if sp.name == "iteration"]
    assert [list(sp.attributes["specsplit.draft_tokens_per_request"]) for sp in iteration_spans] == verified
    assert [sp.attributes["specsplit.num_spec_tokens"] for sp in iteration_spans] == [4, 4, 4, 4]
    (metric,) = reader.get_metrics_data().resource_metrics[0].scope_metrics[0].metrics
    (point,) = metric.data.data_points
    assert (point.count, point.sum) == (len(chosen), sum(chosen))
    a = s.requests["a"]
    assert a.stats.draft_count_histogram == [1, 0, 0, 3]  # one iteration verified none (the prefill), three 3
    obs.end_request_span(obs.tracer.start_span("generate"), a, "length")
    (generate,) = [sp for sp in spans.get_finished_spans() if sp.name == "generate"]
    assert list(generate.attributes["specsplit.draft_count_histogram"]) == [1, 0, 0, 3]
    both = SpecStats.from_pb(a.stats.to_pb())
    both.merge(s.requests["b"].stats)
    assert both.draft_count_histogram == [2, 3, 0, 3] and both.to_dict()["draft_count_histogram"] == [2, 3, 0, 3]
