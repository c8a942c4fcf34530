"""OpenTelemetry set-up shared by the three services (torch-free).

Exporters are chosen by the standard variables:
- `OTEL_SDK_DISABLED=true` turns tracing and metrics off (no-op API).
- `OTEL_TRACES_EXPORTER`: comma list of `otlp`, `console`, `file`, `none`. Default: `otlp` when
  `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) is set, else `file` when
  `SPECSPLIT_TRACE_DIR` is set, else none. `file` writes JSON lines to
  `$SPECSPLIT_TRACE_DIR/<service>.jsonl` (what `specsplit trace` reads).
- `OTEL_METRICS_EXPORTER`: comma list of `otlp`, `prometheus`, `console`, `none`. Default:
  `prometheus` when the service has `--metrics-port`, plus `otlp` when an OTLP endpoint is set.
- `OTEL_SERVICE_NAME` overrides the service name (`specsplit-coordinator`, …); the OTLP exporter
  reads its own `OTEL_EXPORTER_OTLP_*` variables (endpoint, headers, insecure, …).
W3C trace context travels in gRPC metadata (`traceparent`), injected by `outgoing_metadata()` and
extracted by `incoming_context()`; on persistent streams, in each message's `trace_context` map
(`inject_trace_context()`, `extract_trace_context()`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

log = logging.getLogger(__name__)

_providers: list = []

# Bucket bounds (seconds) of the latency histograms (`explicit_bucket_boundaries_advisory`): 0.1 ms to 500 s in
# steps of 1-2-5, from a GPU's Propose (milliseconds) to a queued request's time to first token (minutes). Prometheus'
# `histogram_quantile` interpolates inside the bucket that holds the quantile, whose bounds are at most 2.5x apart.
# The drafter autoscaler's p95 targets (docker/k8s: 50 ms; the CPU demo's 200 ms) are bounds, so whether a p95 is
# over its target is read exactly from the buckets.
LATENCY_BUCKETS_S = (
    0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500,
)  # fmt: skip


def _csv(name: str) -> list[str]:
    return [x.strip().lower() for x in os.environ.get(name, "").split(",") if x.strip()]


def _otlp_endpoint(signal: str) -> bool:
    env = os.environ
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT"))


def setup(
    service: str, *, metrics_port: int | None = None, metrics_host: str = "0.0.0.0", prometheus: bool = False
) -> None:
    """Installs tracer and meter providers for this process (idempotent per process). `prometheus`: metrics in
    prometheus_client's registry even without `metrics_port` (the coordinator's HTTP API serves them on /metrics)."""
    if _providers or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return
    from opentelemetry.sdk.resources import Resource

    name = os.environ.get("OTEL_SERVICE_NAME") or f"specsplit-{service}"
    resource = Resource.create({"service.name": name, "service.namespace": "specsplit"})
    _setup_traces(resource, name)
    _setup_metrics(resource, metrics_port, metrics_host, prometheus)


def _setup_traces(resource, name: str) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    kinds = _csv("OTEL_TRACES_EXPORTER")
    if not kinds:
        kinds = ["otlp"] if _otlp_endpoint("TRACES") else (["file"] if os.environ.get("SPECSPLIT_TRACE_DIR") else [])
    kinds = [k for k in kinds if k != "none"]
    if not kinds:
        return
    provider = TracerProvider(resource=resource)
    for kind in kinds:
        if kind == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        elif kind == "console":
            exporter = ConsoleSpanExporter()
        elif kind == "file":
            directory = Path(os.environ.get("SPECSPLIT_TRACE_DIR", "traces"))
            exporter = JsonLinesSpanExporter(directory / f"{name.removeprefix('specsplit-')}.jsonl")
        else:
            raise ValueError(f"OTEL_TRACES_EXPORTER: unknown exporter {kind!r} (otlp, console, file, none)")
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    trace.set_tracer_provider(provider)
    _providers.append(provider)


def _setup_metrics(resource, metrics_port: int | None, metrics_host: str, prometheus: bool) -> None:
    from opentelemetry import metrics
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader

    kinds = _csv("OTEL_METRICS_EXPORTER")
    if not kinds:
        kinds = (["prometheus"] if metrics_port or prometheus else []) + (["otlp"] if _otlp_endpoint("METRICS") else [])
    readers = []
    for kind in kinds:
        if kind == "none":
            continue
        if kind == "prometheus":
            from opentelemetry.exporter.prometheus import PrometheusMetricReader
            from prometheus_client import start_http_server

            if not metrics_port and not prometheus:
                raise ValueError("the prometheus metrics exporter needs --metrics-port (or --http-port)")
            if metrics_port:
                start_http_server(metrics_port, addr=metrics_host)
            readers.append(PrometheusMetricReader())
        elif kind == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(), export_interval_millis=5000))
        elif kind == "console":
            readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter()))
        else:
            raise ValueError(f"OTEL_METRICS_EXPORTER: unknown exporter {kind!r} (otlp, prometheus, console, none)")
    if readers:
        provider = MeterProvider(resource=resource, metric_readers=readers)
        metrics.set_meter_provider(provider)
        _providers.append(provider)


def shutdown() -> None:
    """Flushes and stops exporters (call at process exit)."""
    while _providers:
        provider = _providers.pop()
        try:
            provider.shutdown()
        except Exception:  # noqa: BLE001 - exporting must never fail a shutdown
            log.exception("telemetry shutdown failed")


def outgoing_metadata(ctx: otel_context.Context | None = None) -> list[tuple[str, str]]:
    """gRPC metadata carrying the W3C trace context of `ctx` (default: the current one)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return list(carrier.items())


def incoming_context(metadata: Sequence[tuple[str, str | bytes]] | None) -> otel_context.Context:
    """The trace context a caller sent in gRPC metadata."""
    carrier = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    return propagate.extract(carrier)


def inject_trace_context(carrier: MutableMapping[str, str]) -> None:
    """Writes the current W3C trace context into a message's `trace_context` map, in place."""
    propagate.inject(carrier)


_NO_CONTEXT = otel_context.Context()


def extract_trace_context(carrier: Mapping[str, str]) -> otel_context.Context:
    """The trace context a caller wrote into a message's `trace_context` map, read in place; an empty
    map (the caller does not trace) has nothing to parse."""
    return propagate.extract(carrier) if carrier else _NO_CONTEXT


class JsonLinesSpanExporter:
    """Writes finished spans as JSON lines (one file per service) for `specsplit trace`."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def export(self, spans) -> object:
        from opentelemetry.sdk.trace.export import SpanExportResult

        lines = [json.dumps(span_to_dict(s)) for s in spans]
        with self._lock, open(self.path, "a") as f:
            f.write("".join(line + "\n" for line in lines))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def span_to_dict(span) -> dict:
    ctx = span.get_span_context()
    return {
        "name": span.name,
        "service": span.resource.attributes.get("service.name", ""),
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{span.parent.span_id:016x}" if span.parent else None,
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "status_message": span.status.description,
        "attributes": dict(span.attributes or {}),
        "links": [
            {
                "trace_id": f"{link.context.trace_id:032x}",
                "span_id": f"{link.context.span_id:016x}",
                "attributes": dict(link.attributes or {}),
            }
            for link in span.links
        ],
    }
