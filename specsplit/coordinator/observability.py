"""The coordinator's spans and metrics (docs/design.md §6).

Trace shape: one `generate` span per request (SERVER, `gen_ai.*` attributes) is the root of the
request's trace. Each engine iteration is an `iteration` span whose parent is the request span of
the oldest request in the batch and which links to
- the previous iteration's span (`specsplit.link = previous_iteration`): the cross-iteration hop
  that carries `spec_token_ids` from one propose to the next verification;
- the request spans of the other requests in the batch (`specsplit.link = batched_request`).
Its children are `schedule`, `verify` (CLIENT; the verifier's and drafter's spans hang below it)
and `post_step`.
"""

from __future__ import annotations

import time

from opentelemetry import metrics, trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from specsplit.coordinator import vllm_metrics as vllm
from specsplit.rpc.telemetry import LATENCY_BUCKETS_S

tracer = trace.get_tracer("specsplit.coordinator")
meter = metrics.get_meter("specsplit.coordinator")

requests_total = meter.create_counter("specsplit.requests", description="finished requests by finish reason")
drafts_total = meter.create_counter("specsplit.drafts", description="verify iterations that carried drafts")
draft_tokens_total = meter.create_counter("specsplit.draft_tokens", description="draft tokens verified")
accepted_tokens_total = meter.create_counter("specsplit.accepted_tokens", description="draft tokens accepted")
accepted_per_position = meter.create_counter(
    "specsplit.accepted_tokens_per_position", description="accepted drafts by draft position (1-based)"
)
time_to_first_token = meter.create_histogram(
    "specsplit.time_to_first_token", unit="s", explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S
)
time_per_output_token = meter.create_histogram(
    "specsplit.time_per_output_token", unit="s", explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S
)
iteration_duration = meter.create_histogram(
    "specsplit.iteration_duration", unit="s", explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S
)
spec_tokens_chosen = meter.create_histogram(
    "specsplit.spec_tokens_chosen",
    description="drafts a decoding request asks the drafter for, per request and iteration (adaptive speculation)",
    explicit_bucket_boundaries_advisory=[0, 1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 31],
)


def observe_queue(scheduler) -> None:
    """Registers queue depth and running-request gauges read from the scheduler."""

    def waiting(_options):
        yield metrics.Observation(scheduler.num_waiting)

    def running(_options):
        yield metrics.Observation(len(scheduler.running))

    meter.create_observable_gauge("specsplit.queue_depth", [waiting], description="requests waiting")
    meter.create_observable_gauge("specsplit.running_requests", [running], description="requests running")
    vllm.scheduler_gauges.scheduler = scheduler


def start_request_span(request, model: str, parent_ctx) -> trace.Span:
    s = request.sampling
    return tracer.start_span(
        "generate",
        context=parent_ctx,
        kind=SpanKind.SERVER,
        attributes={
            "gen_ai.operation.name": "text_completion",
            "gen_ai.request.model": model,
            "gen_ai.request.max_tokens": s.max_tokens,
            "gen_ai.request.temperature": s.temperature,
            "gen_ai.request.top_p": s.top_p,
            "gen_ai.request.top_k": s.top_k,
            "gen_ai.usage.input_tokens": request.num_prompt_tokens,
            "specsplit.request_id": request.request_id,
        },
    )


def end_request_span(span: trace.Span | None, request, reason: str, error: Exception | None = None) -> None:
    stats = request.stats
    now = time.monotonic()
    requests_total.add(1, {"finish_reason": reason})
    model = vllm.model()
    vllm.request_success.labels(model, reason).inc()
    vllm.e2e_request_latency.labels(model).observe(now - request.arrival_time)
    if request.first_token_time is not None:
        n = len(request.output_token_ids)
        if n > 1:
            time_per_output_token.record((now - request.first_token_time) / (n - 1))
            vllm.time_per_output_token.labels(model).observe((now - request.first_token_time) / (n - 1))
    if span is None:
        return
    span.set_attributes(
        {
            "gen_ai.usage.output_tokens": len(request.output_token_ids),
            "gen_ai.response.finish_reasons": [reason],
            "specsplit.num_iterations": stats.num_iterations,
            "specsplit.num_draft_tokens": stats.num_draft_tokens,
            "specsplit.num_accepted_tokens": stats.num_accepted_tokens,
            "specsplit.draft_count_histogram": stats.draft_count_histogram,
            "specsplit.num_preemptions": request.num_preemptions,
            "gen_ai.usage.cached_input_tokens": request.num_cached_tokens or 0,
        }
    )
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, str(error)))
    span.end()


def record_first_token(request) -> None:
    time_to_first_token.record(request.first_token_time - request.arrival_time)
    vllm.time_to_first_token.labels(vllm.model()).observe(request.first_token_time - request.arrival_time)
    vllm.prompt_tokens.labels(vllm.model()).inc(request.num_prompt_tokens)


def record_generated_tokens(num_tokens: int) -> None:
    vllm.generation_tokens.labels(vllm.model()).inc(num_tokens)


def start_iteration_span(output, previous: trace.SpanContext | None, schedule_start_ns: int) -> trace.Span:
    spans = [s.request.span for s in output.scheduled if s.request.span is not None]
    parent = trace.set_span_in_context(spans[0]) if spans else None
    links = []
    if previous is not None:
        links.append(Link(previous, {"specsplit.link": "previous_iteration"}))
    links += [Link(s.get_span_context(), {"specsplit.link": "batched_request"}) for s in spans[1:]]
    return tracer.start_span(
        "iteration",
        context=parent,
        links=links,
        start_time=schedule_start_ns,
        attributes={
            "specsplit.iteration": output.iteration,
            "specsplit.batch_size": len(output.scheduled),
            "specsplit.num_scheduled_tokens": output.num_scheduled_tokens,
            "specsplit.drafts_scheduled": sum(s.num_draft_tokens for s in output.scheduled),
            # Per scheduled request, in order: drafts verified now, drafts asked for the next iteration.
            "specsplit.draft_tokens_per_request": [s.num_draft_tokens for s in output.scheduled],
            "specsplit.spec_tokens_per_request": [s.num_spec_tokens for s in output.scheduled],
            "specsplit.num_spec_tokens": sum(s.num_spec_tokens for s in output.scheduled),
            "specsplit.num_preempted": output.num_preempted,
            "specsplit.queue_time_ms": max(
                (s.queue_time_ms for s in output.scheduled if s.queue_time_ms is not None), default=0.0
            ),
            # Prefix caching, per scheduled request: tokens it started on from the cache (on the step admitting it).
            "specsplit.cached_tokens_per_request": [
                s.num_computed_tokens if s.num_cached_blocks else 0 for s in output.scheduled
            ],
        },
    )


def record_draft_choice(output) -> None:
    """Each decoding request's draft count asked for this iteration, in `specsplit.spec_tokens_chosen`."""
    for item in output.scheduled:
        if item.sample:
            spec_tokens_chosen.record(item.num_spec_tokens)


def record_verify(iteration_span: trace.Span, output, results, response) -> tuple[int, int]:
    """Records the iteration's counts; returns (drafts verified, accepted), and accepted + rejected = drafts. The
    batch's counts go to each series once per iteration (per draft position for the positional ones), not once per
    request: the same sums, at a host cost that does not grow with the batch."""
    accepted = rejected = num_drafts = num_draft_tokens = 0
    drafts_at: list[int] = []  # per draft position: drafts verified there; accepted_at: those accepted
    accepted_at: list[int] = []
    for item, result in zip(output.scheduled, results):
        n_drafts = result.num_draft_tokens
        if not item.sample or not n_drafts:
            continue
        n_acc = len(result.sampled_token_ids) - 1
        rejected += n_drafts - n_acc
        accepted += n_acc
        num_drafts += 1
        num_draft_tokens += n_drafts
        if len(drafts_at) < n_drafts:
            grow = n_drafts - len(drafts_at)
            drafts_at += [0] * grow
            accepted_at += [0] * grow
        for pos in range(n_drafts):
            drafts_at[pos] += 1
            accepted_at[pos] += pos < n_acc
    if num_drafts:
        drafts_total.add(num_drafts)
        draft_tokens_total.add(num_draft_tokens)
        accepted_tokens_total.add(accepted)
        model = vllm.model()
        vllm.spec_decode_num_drafts.labels(model).inc(num_drafts)
        vllm.spec_decode_num_draft_tokens.labels(model).inc(num_draft_tokens)
        vllm.spec_decode_num_accepted_tokens.labels(model).inc(accepted)
        for pos, n in enumerate(accepted_at):  # zeros too, so every position is exported
            accepted_per_position.add(n, {"position": pos + 1})
            vllm.spec_decode_num_accepted_tokens_per_pos.labels(model, str(pos)).inc(n)
    iteration_span.set_attributes(
        {
            "specsplit.accepted": accepted,
            "specsplit.rejected": rejected,
            "specsplit.hidden_state_bytes": response.hidden_state_bytes,
            "specsplit.drafter_ok": response.drafter_ok,
            "specsplit.verifier.forward_ms": response.timing.forward_ns / 1e6,
            "specsplit.verifier.propose_ms": response.timing.propose_ns / 1e6,
        }
    )
    return accepted + rejected, accepted
