"""The drafter's server spans (docs/design.md §6): `Propose`, a child of the caller's span, with the counts,
and its children `mtp_step_0` and `mtp_steps_1_to_k` at the runner's stamps; a refused Propose
leaves an error span."""

import asyncio

import pytest
import torch
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import specsplit.drafter.servicer
from specsplit.client.errors import SpecsplitError
from specsplit.drafter.runner import ProposeOutput
from specsplit.drafter.servicer import DrafterServicer
from specsplit.proto import common_pb2, drafter_pb2
from specsplit.rpc.telemetry import inject_trace_context
from specsplit.transport.grpc_bytes import GrpcReceiver
from specsplit.transport.wire import fill_tensor_proto

HIDDEN = 8


class StampedRunner:
    """Drafts at once, with fixed step stamps."""

    mtp = torch.nn.Linear(HIDDEN, HIDDEN)

    def free(self, request_ids):
        pass

    def propose(self, items, hidden_states):
        return ProposeOutput([[7] * item.num_spec_tokens for item in items], (100, 200, 350))


class Context:
    def invocation_metadata(self):
        return ()

    async def abort(self, code, message):
        raise RuntimeError(f"{code.name}: {message}")


@pytest.fixture
def spans(monkeypatch):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(specsplit.drafter.servicer, "tracer", provider.get_tracer("test"))
    return provider.get_tracer("caller"), exporter


def _request(caller, vocab_token: int) -> drafter_pb2.ProposeRequest:
    msg = drafter_pb2.ProposeRequest(iteration=4)
    msg.requests.add(request_id="r", start_position=2, next_token_ids=[1, vocab_token], num_spec_tokens=3)
    fill_tensor_proto(msg.hidden_states, torch.zeros(2, HIDDEN))
    with caller.start_as_current_span("send_hidden_states"):
        inject_trace_context(msg.trace_context)
    return drafter_pb2.ProposeRequest.FromString(msg.SerializeToString())


def _stream(requests):
    servicer = DrafterServicer("cpu")
    servicer.ready(StampedRunner(), common_pb2.ModelInfo(vocab_size=10), GrpcReceiver("cpu", HIDDEN))

    async def run():
        async def incoming():
            for r in requests:
                yield r

        return [response async for response in servicer.ProposeStream(incoming(), Context())]

    return asyncio.run(run())


def test_propose_span_has_the_counts_and_the_step_children(spans):
    caller, exporter = spans
    (response,) = _stream([_request(caller, 5)])
    assert list(response.drafts[0].token_ids) == [7, 7, 7]
    by_name = {s.name: s for s in exporter.get_finished_spans()}
    send, propose = by_name["send_hidden_states"], by_name["Propose"]
    assert propose.kind == trace.SpanKind.SERVER and propose.parent.span_id == send.context.span_id
    assert dict(propose.attributes) == {
        "specsplit.iteration": 4,
        "specsplit.drafter_rpc": "stream",  # gRPC's ProposeStream
        "specsplit.batch_size": 1,
        "specsplit.hidden_state_bytes": 2 * HIDDEN * 4,
    }
    for name, start, end in (("mtp_step_0", 100, 200), ("mtp_steps_1_to_k", 200, 350)):
        step = by_name[name]
        assert step.parent.span_id == propose.context.span_id
        assert (step.start_time, step.end_time) == (start, end)


def test_a_refused_propose_leaves_an_error_span(spans):
    caller, exporter = spans
    with pytest.raises(RuntimeError, match="INVALID_ARGUMENT: .*outside the vocabulary"):
        _stream([_request(caller, 10)])
    (propose,) = [s for s in exporter.get_finished_spans() if s.name == "Propose"]
    assert propose.status.status_code == trace.StatusCode.ERROR


class RecordingReceiver(GrpcReceiver):
    """Records when the servicer takes the rows and when it lets them go."""

    def __init__(self, events):
        super().__init__("cpu", HIDDEN)
        self.events = events

    def receive(self, msg):
        self.events.append("receive")
        return super().receive(msg)

    def release(self):
        self.events.append("release")


class RecordingRunner(StampedRunner):
    def __init__(self, events):
        self.events = events

    def propose(self, items, hidden_states):
        self.events.append("propose")
        return super().propose(items, hidden_states)


@pytest.mark.parametrize("token, expected", [(5, ["receive", "propose", "release"]), (10, ["receive", "release"])])
def test_the_rows_are_released_before_every_reply_refusals_included(spans, token, expected):
    """cuda_ipc's rows are the verifier's slot, read in place: the servicer must let them go (wait for
    the work on them) before any answer leaves, or the verifier could rewrite a slot still being read."""
    caller, _ = spans
    events = []
    servicer = DrafterServicer("cpu")
    servicer.ready(RecordingRunner(events), common_pb2.ModelInfo(vocab_size=10), RecordingReceiver(events))
    try:
        response = servicer.handle_local_request(_request(caller, token))
    except SpecsplitError as err:  # token 10 is outside the vocabulary
        assert "outside the vocabulary" in err.message
        response = None
    events.append("reply")
    assert events == [*expected, "reply"]
    assert (response is not None) == (token == 5)
