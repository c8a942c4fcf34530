"""The engine streams an iteration's outputs only once the next iteration's request is sent (the
verifier works meanwhile), and never loses or repeats them, also when that send fails."""

import asyncio

import grpc

from specsplit.coordinator.config import SchedulerConfig
from specsplit.coordinator.engine import Engine
from specsplit.coordinator.iteration import VerifyOutcome, VerifyResult
from specsplit.coordinator.request import Request, SamplingParams
from specsplit.coordinator.scheduler import Scheduler
from specsplit.rpc.bidi_stream import StreamError

PROMPT = list(b"hi: ")


def token_at(position: int) -> int:
    return ord("a") + position % 26  # what the fake verifier samples at each position


class ByteTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


class FakeVerifier:
    """Answers each request with the token of its next position (no drafts); records, at every send and
    receive, how many tokens had been streamed to the client; fails the send of the iterations in `fail_sends`."""

    def __init__(self, streamed, fail_sends=(), fail_receives=None, refuse=()):
        self.streamed = streamed
        self.refuse = set(refuse)  # request ids whose every batch is answered INVALID_ARGUMENT
        self.fail_sends = set(fail_sends)
        self.fail_receives = fail_receives or {}  # iteration -> the status its answer fails with
        self.events = []
        self.batch_sizes = {}  # iteration -> requests it ran
        self._last = None

    async def send(self, output):
        self.events.append(("send", output.iteration, self.streamed()))
        self.batch_sizes[output.iteration] = len(output.scheduled)
        if output.iteration in self.fail_sends:
            raise StreamError(grpc.StatusCode.UNAVAILABLE, "verifier went away")
        self._last = output

    async def receive(self):
        await asyncio.sleep(0)
        self.events.append(("receive", self._last.iteration, self.streamed()))
        code = self.fail_receives.get(self._last.iteration)
        if code is not None:
            raise StreamError(code, "verifier: Internal error from Core")
        if self.refuse & {s.request.request_id for s in self._last.scheduled}:
            self.events.append(("refused", self._last.iteration, self.streamed()))
            raise StreamError(grpc.StatusCode.INVALID_ARGUMENT, "verifier: position out of range")
        return VerifyOutcome(
            [
                VerifyResult(s.request.request_id, [token_at(s.num_computed_tokens + len(s.token_ids))], 0)
                for s in self._last.scheduled
            ]
        )

    def close(self):
        pass


async def generate(max_tokens: int, fail_sends=(), fail_receives=None):
    config = SchedulerConfig(max_model_len=256, block_size=16, num_blocks=64, num_speculative_tokens=0)
    queued = []  # every output put on the client's queue, consumed or not
    stream = FakeVerifier(lambda: sum(len(o.token_ids) for o in queued), fail_sends, fail_receives)
    engine = Engine(Scheduler(config, eos_token_ids=[]), verifier=stream, tokenizer=ByteTokenizer())
    queue = engine.add_request(Request("r", PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    put = queue.put_nowait
    queue.put_nowait = lambda out: (queued.append(out), put(out))[1]
    engine.start()
    tokens, reason, error = [], None, None
    try:
        while reason is None:
            out = await asyncio.wait_for(queue.get(), 10)
            tokens += out.token_ids
            reason, error = out.finish_reason, out.error
    finally:
        await engine.stop()
    events = [(*e, stream.batch_sizes[e[1]]) for e in stream.events]  # kind, iteration, streamed, batch size
    return (tokens, reason, events) if error is None else (tokens, error, events)


def test_outputs_stream_after_the_next_request_is_sent():
    tokens, reason, events = asyncio.run(generate(max_tokens=4))
    assert reason == "length"
    assert tokens == [token_at(len(PROMPT) + i) for i in range(4)]
    sends = [(it, n) for kind, it, n, _ in events if kind == "send"]
    receives = [(it, n) for kind, it, n, _ in events if kind == "receive"]
    assert [it for it, _ in sends] == [1, 2, 3, 4, 5]  # 5: frees the finished request's KV, runs nothing
    # Iteration i's token is queued after iteration i+1's request went out and before its answer came back.
    assert [n for _, n in sends] == [0, 0, 1, 2, 3]
    assert [n for _, n in receives] == [0, 1, 2, 3, 4]


def test_a_failed_send_still_delivers_the_previous_outputs_and_nothing_twice():
    tokens, reason, events = asyncio.run(generate(max_tokens=5, fail_sends={3}))
    assert reason == "length"
    assert tokens == [token_at(len(PROMPT) + i) for i in range(5)]  # none lost, none repeated
    failed = [n for kind, it, n, _ in events if kind == "send" and it == 3]
    assert failed == [1]  # iteration 1's token was out; iteration 2's was streamed despite the failure
    after = [(kind, it, n) for kind, it, n, _ in events if it > 3]
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
        # 1 answered, then failures; the request is not run again (an iteration freeing its KV may follow)
        assert len([kind for kind, _, _, size in events if kind == "receive" and size]) == iterations


def test_a_refused_request_fails_alone_and_the_rest_of_its_batch_finishes_whole():
    """A verifier that refuses every batch holding one request (INVALID_ARGUMENT): that request fails, the others
    of its batch are scheduled apart from it and finish with every token."""

    async def run():
        config = SchedulerConfig(max_model_len=256, block_size=16, num_blocks=64, num_speculative_tokens=0)
        stream = FakeVerifier(lambda: 0, refuse={"r4"})
        engine = Engine(Scheduler(config, eos_token_ids=[]), verifier=stream, tokenizer=ByteTokenizer())
        ids = [f"r{i}" for i in range(6)]
        queues = {
            rid: engine.add_request(Request(rid, PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))) for rid in ids
        }
        engine.start()
        got = {}
        try:
            for rid, queue in queues.items():
                tokens, out = [], None
                while out is None or out.finish_reason is None:
                    out = await asyncio.wait_for(queue.get(), 10)
                    tokens += out.token_ids
                got[rid] = (tokens, out.finish_reason, out.error)
        finally:
            await engine.stop()
        return got, stream.events, stream.batch_sizes

    got, events, batch_sizes = asyncio.run(run())
    tokens, reason, error = got.pop("r4")
    assert (
        reason == "error" and error.code is grpc.StatusCode.INVALID_ARGUMENT and "position out of range" in str(error)
    )
    assert tokens == []
    for rid, (tokens, reason, error) in got.items():
        assert (reason, error) == ("length", None), rid
        assert tokens == [token_at(len(PROMPT) + i) for i in range(4)], rid
    # Refused: the batch of six, then the half with r4 (three), its half with r4 (two), then r4 alone.
    assert [size for kind, it, _ in events if kind == "refused" for size in [batch_sizes[it]]] == [6, 3, 2, 1]


def test_an_outage_that_began_before_a_request_arrived_counts_from_its_arrival():
    """The verifier goes away: the request waiting then fails after verifier_unavailable_s. The engine sits idle,
    the verifier still away; a request arriving later meets one more failure and then the verifier back: it
    finishes whole (the outage's clock, started before it arrived, does not fail it at its first retry)."""

    async def run():
        config = SchedulerConfig(max_model_len=256, block_size=16, num_blocks=64, num_speculative_tokens=0)
        stream = FakeVerifier(lambda: 0)
        engine = Engine(
            Scheduler(config, eos_token_ids=[]),
            verifier=stream,
            tokenizer=ByteTokenizer(),
            verifier_unavailable_s=1.2,  # more than the longest backoff (1 s)
        )
        failing = {"sends": 10**6}
        answer = stream.send

        async def send(request):
            if failing["sends"] > 0:  # every send, also an iteration that only frees
                failing["sends"] -= 1
                raise StreamError(grpc.StatusCode.UNAVAILABLE, "verifier went away")
            await answer(request)

        stream.send = send
        engine.start()
        try:
            first = engine.add_request(Request("a", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True)))
            out = await asyncio.wait_for(first.get(), 10)
            assert out.finish_reason == "error" and "verifier unreachable" in str(out.error)
            await asyncio.sleep(1.5)  # idle, the outage now longer than verifier_unavailable_s
            failing["sends"] = 1
            second = engine.add_request(Request("b", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True)))
            tokens, reason = [], None
            while reason is None:
                out = await asyncio.wait_for(second.get(), 10)
                tokens += out.token_ids
                reason = out.finish_reason
            return tokens, reason if out.error is None else str(out.error)
        finally:
            await engine.stop()

    tokens, reason = asyncio.run(run())
    assert reason == "length" and tokens == [token_at(len(PROMPT) + i) for i in range(3)]
