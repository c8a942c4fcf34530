"""The engine streams an iteration's outputs only once the next iteration's request is sent (the
verifier works meanwhile), and never loses or repeats them, also when that send fails."""

import asyncio
from types import SimpleNamespace

import grpc

from specsplit.bidi_stream import StreamError
from specsplit.coordinator.config import SchedulerConfig
from specsplit.coordinator.engine import Engine
from specsplit.coordinator.request import Request, SamplingParams
from specsplit.coordinator.scheduler import Scheduler
from specsplit.proto import verifier_pb2

PROMPT = list(b"hi: ")


def token_at(position: int) -> int:
    return ord("a") + position % 26  # what the fake verifier samples at each position


class ByteTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


class FakeVerifyStream:
    """Answers each request with the token of its next position (no drafts); records, at every send and
    receive, how many tokens had been streamed to the client; fails the send of the iterations in `fail_sends`."""

    def __init__(self, streamed, fail_sends=(), fail_receives=None):
        self.streamed = streamed
        self.fail_sends = set(fail_sends)
        self.fail_receives = fail_receives or {}  # iteration -> the status its answer fails with
        self.events = []
        self._last = None

    async def send(self, request):
        self.events.append(("send", request.iteration, self.streamed()))
        if request.iteration in self.fail_sends:
            raise StreamError(grpc.StatusCode.UNAVAILABLE, "verifier went away")
        self._last = request

    async def receive(self):
        await asyncio.sleep(0)
        self.events.append(("receive", self._last.iteration, self.streamed()))
        code = self.fail_receives.get(self._last.iteration)
        if code is not None:
            raise StreamError(code, "verifier: Internal error from Core")
        response = verifier_pb2.VerifyResponse()
        for r in self._last.requests:
            position = r.num_computed_tokens + len(r.token_ids)
            response.results.add(request_id=r.request_id, sampled_token_ids=[token_at(position)], num_rejected=0)
        return response

    def close(self):
        pass


async def generate(max_tokens: int, fail_sends=(), fail_receives=None):
    config = SchedulerConfig(max_model_len=256, block_size=16, num_blocks=64, num_speculative_tokens=0)
    engine = Engine(
        Scheduler(config, eos_token_ids=[]), verifier=SimpleNamespace(VerifyStream=None), tokenizer=ByteTokenizer()
    )
    queue = engine.add_request(Request("r", PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    queued = []  # every output put on the client's queue, consumed or not
    put = queue.put_nowait
    queue.put_nowait = lambda out: (queued.append(out), put(out))[1]
    engine._verify_stream = stream = FakeVerifyStream(
        lambda: sum(len(o.token_ids) for o in queued), fail_sends, fail_receives
    )
    engine.start()
    tokens, reason, error = [], None, None
    try:
        while reason is None:
            out = await asyncio.wait_for(queue.get(), 10)
            tokens += out.token_ids
            reason, error = out.finish_reason, out.error
    finally:
        await engine.stop()
    return (tokens, reason, stream.events) if error is None else (tokens, error, stream.events)


def test_outputs_stream_after_the_next_request_is_sent():
    tokens, reason, events = asyncio.run(generate(max_tokens=4))
    assert reason == "length"
    assert tokens == [token_at(len(PROMPT) + i) for i in range(4)]
    sends = [(it, n) for kind, it, n in events if kind == "send"]
    receives = [(it, n) for kind, it, n in events if kind == "receive"]
    assert [it for it, _ in sends] == [1, 2, 3, 4, 5]  # 5: frees the finished request's KV, runs nothing
    # Iteration i's token is queued after iteration i+1's request went out and before its answer came back.
    assert [n for _, n in sends] == [0, 0, 1, 2, 3]
    assert [n for _, n in receives] == [0, 1, 2, 3, 4]


def test_a_failed_send_still_delivers_the_previous_outputs_and_nothing_twice():
    tokens, reason, events = asyncio.run(generate(max_tokens=5, fail_sends={3}))
    assert reason == "length"
    assert tokens == [token_at(len(PROMPT) + i) for i in range(5)]  # none lost, none repeated
    failed = [n for kind, it, n in events if kind == "send" and it == 3]
    assert failed == [1]  # iteration 1's token was out; iteration 2's was streamed despite the failure
    after = [(kind, it, n) for kind, it, n in events if it > 3]
    assert after[0] == ("send", 4, 2)  # re-prefilled from the coordinator's tokens, then carried on


def test_internal_from_a_verifier_going_away_is_retried_and_loses_nothing():
    """A stream cut by the verifier's shutdown can answer INTERNAL: the iteration is retried (re-prefilled from the
    coordinator's tokens) as for UNAVAILABLE, and the request finishes whole."""
    internal = grpc.StatusCode.INTERNAL
    tokens, reason, events = asyncio.run(generate(max_tokens=5, fail_receives={3: internal, 4: internal}))
    assert reason == "length"
    assert tokens == [token_at(len(PROMPT) + i) for i in range(5)]


def test_internal_that_keeps_coming_back_fails_the_request_and_invalid_argument_at_once():
    internal, invalid = grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT
    for fail_receives, iterations in [({i: internal for i in range(2, 40)}, 1 + 4), ({2: invalid}, 1 + 1)]:
        tokens, error, events = asyncio.run(generate(max_tokens=5, fail_receives=fail_receives))
        assert error.code == next(iter(fail_receives.values())) and "Internal error from Core" in str(error)
        assert len([kind for kind, *_ in events if kind == "receive"]) == iterations  # 1 answered, then failures
