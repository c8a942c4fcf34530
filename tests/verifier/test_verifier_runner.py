"""Verifier runner in process: drafts equal to the target's greedy continuation are all accepted,
a wrong draft is rejected at its position and replaced by the target's token, and the KV cache is
rolled back so later steps equal plain decoding."""

import pytest
import torch

from specsplit.client.errors import FailedPrecondition, InvalidArgument
from specsplit.models.loader import load_target
from specsplit.runtime.cuda_graphs import CudaGraphRunner
from specsplit.verifier.batch import Sampling, VerifyBatch, VerifyItem
from specsplit.verifier.input_batch import build_input_batch
from specsplit.verifier.runner import VerifierRunner, step_output
from tests.fixtures.tiny import write_tiny_checkpoint

PROMPT = [5, 17, 42, 99, 7, 3]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_target(write_tiny_checkpoint(tmp_path_factory.mktemp("v") / "m", architecture="qwen3", seed=3))


def graphed_runner(model) -> VerifierRunner:
    """Triton attention for decode / verify steps, through the CUDA-graph runner's static buffers
    (run eagerly: no capture on CPU); buckets 1, 2, 4, larger steps eager."""
    cache = model.make_kv_cache(64, 4)
    runner = VerifierRunner(model, cache, sampler_backend="reference", attention_kernel=True, cuda_graphs=False)
    runner.graphs = CudaGraphRunner(model, cache, max_model_len=256, max_num_tokens=4, capture=False)
    return runner


@pytest.fixture(scope="module", params=["sdpa", "kernel_graph_buffers"])
def runner(model, request):
    if request.param == "sdpa":
        return VerifierRunner(model, model.make_kv_cache(64, 4), sampler_backend="reference")
    return graphed_runner(model)


def step(runner, reqs, it=1):
    items = [
        VerifyItem(
            request_id=rid,
            num_computed_tokens=nc,
            token_ids=list(tokens),
            num_draft_tokens=d,
            sample=sample,
            next_token_id=tokens[0] if not sample else 0,
            num_spec_tokens=2,
        )
        for rid, nc, tokens, d, sample in reqs
    ]
    msg = VerifyBatch(iteration=it, requests=items)
    batch = build_input_batch(
        msg, vocab_size=runner.model.config.vocab_size, max_model_len=256, num_cached_tokens=runner.kv_cache.num_tokens
    )
    return runner.step(batch)


def greedy(runner, rid, n):
    """Plain decoding (no drafts) for n tokens."""
    out = step(runner, [(rid, 0, PROMPT, 0, True)]).sampled_token_ids[0]
    while len(out) < n:
        nc = len(PROMPT) + len(out) - 1
        out += step(runner, [(rid, nc, [out[-1]], 0, True)]).sampled_token_ids[0]
    runner.free([rid])
    return out


def test_oracle_drafts_are_all_accepted_and_wrong_draft_rejected_at_its_position(runner):
    ref = greedy(runner, "plain", 8)
    first = step(runner, [("a", 0, PROMPT, 0, True)])
    assert first.sampled_token_ids[0] == ref[:1]
    nc = len(PROMPT)
    # all 3 drafts correct → 3 accepted + bonus
    out = step(runner, [("a", nc, [ref[0], *ref[1:4]], 3, True)])
    assert out.sampled_token_ids[0] == ref[1:5] and out.num_rejected[0] == 0
    # hidden states of the 4 valid positions go to the drafter, paired with the sampled tokens
    assert out.start_positions[0] == nc and out.next_token_ids[0] == ref[1:5]
    assert out.hidden_states.shape[0] == 4
    nc += 4
    # draft 2 wrong: accepted 1, recovered = target's token, 2 rejected
    bad = [ref[5], (ref[6] + 1) % 300, 1]
    out = step(runner, [("a", nc, [ref[4], *bad], 3, True)])
    assert out.sampled_token_ids[0] == ref[5:7] and out.num_rejected[0] == 2
    nc += 4 - 2
    out = step(runner, [("a", nc, [ref[6]], 0, True)])  # KV rolled back: plain decode continues right
    assert out.sampled_token_ids[0] == ref[7:8]
    runner.free(["a"])


def test_prefill_chunks_send_every_position_to_the_drafter(runner):
    out = step(runner, [("c", 0, PROMPT[:4], 0, False)])
    assert out.sampled_token_ids[0] == [] and out.next_token_ids[0] == PROMPT[1:4] + [PROMPT[0]]
    out2 = step(runner, [("c", 4, PROMPT[4:], 0, True)])
    assert out2.start_positions[0] == 4 and out2.next_token_ids[0][:1] == PROMPT[5:6]
    assert out2.hidden_states.shape[0] == 2
    runner.free(["c"])


def test_ragged_batch_equals_each_request_alone(runner):
    ref = greedy(runner, "plain", 4)
    out = step(runner, [("x", 0, PROMPT, 0, True), ("y", 0, PROMPT[:3], 0, False)])
    assert out.sampled_token_ids[0] == ref[:1]
    out = step(runner, [("y", 3, PROMPT[3:], 0, True), ("x", 6, [ref[0], ref[1], ref[2]], 2, True)])
    assert out.sampled_token_ids[0] == ref[:1] and out.sampled_token_ids[1] == ref[1:4]
    runner.free(["x", "y"])


def test_unknown_request_with_computed_tokens_is_failed_precondition(runner):
    with pytest.raises(FailedPrecondition, match="re-prefill"):
        step(runner, [("ghost", 10, [1], 0, True)])


@pytest.mark.parametrize(
    "req, message",
    [
        (("a", 0, [], 0, True), "no token_ids"),
        (("a", -1, [1], 0, True), "negative"),
        (("a", 0, [1, 2], 2, True), "num_draft_tokens 2 not in"),
        (("a", 0, [1, 2], 1, False), "drafts in a prefill chunk"),
        (("a", 0, [1] * 33, 32, True), "32 drafts; at most 31 per request"),
        (("a", 0, [10**6], 0, True), "outside the vocabulary"),
    ],
)
def test_bad_verify_request_is_invalid_argument(runner, req, message):
    with pytest.raises(InvalidArgument, match=message):
        step(runner, [req])


def test_hidden_states_are_float_rows_of_hidden_size(runner):
    out = step(runner, [("h", 0, PROMPT, 0, True)])
    assert out.hidden_states.dtype == torch.float32
    assert out.hidden_states.shape == (len(PROMPT), runner.model.config.hidden_size)
    runner.free(["h"])


@pytest.mark.parametrize(
    ("sampling", "all_greedy", "any_filter"),
    [
        ([Sampling()] * 2, True, False),
        ([Sampling(), Sampling(temperature=0.7)], False, False),
        ([Sampling(temperature=0.7, top_k=5)], False, True),
        ([Sampling(temperature=0.7, top_p=0.9)], False, True),
    ],
)
def test_input_batch_tells_the_sampler_what_the_host_knows(sampling, all_greedy, any_filter):
    """all_greedy / any_filter / max_num_draft let the sampler skip a launch and every device sync;
    a wrong flag would change tokens (greedy race skipped, filters ignored), so they must be exact."""
    requests = [
        VerifyItem(f"r{i}", 0, [5, 6, 7, 8][: 2 + i], num_draft_tokens=1 + i, sample=True, sampling=sp)
        for i, sp in enumerate(sampling)
    ]
    msg = VerifyBatch(iteration=1, requests=requests)
    batch = build_input_batch(msg, vocab_size=100, max_model_len=64, num_cached_tokens=lambda rid: 0)
    assert (batch.all_greedy, batch.any_filter, batch.max_num_draft) == (all_greedy, any_filter, len(sampling))


def test_kernel_and_graph_buffer_path_decodes_like_the_sdpa_path(model):
    plain = VerifierRunner(model, model.make_kv_cache(64, 4), sampler_backend="reference")
    graphed = graphed_runner(model)
    assert greedy(graphed, "g", 10) == greedy(plain, "g", 10)
    # Oracle drafts: a 4-token verify step per request, two requests → 8 tokens: eager kernel path.
    ref = greedy(plain, "g", 10)
    for r in (plain, graphed):
        step(r, [("p", 0, PROMPT, 0, True), ("q", 0, PROMPT, 0, True)])
    nc = len(PROMPT)
    drafts = [ref[0], *ref[1:4]]
    outs = [step(r, [("p", nc, drafts, 3, True), ("q", nc, drafts, 3, True)]) for r in (plain, graphed)]
    assert outs[0].sampled_token_ids == outs[1].sampled_token_ids == [ref[1:5], ref[1:5]]
    torch.testing.assert_close(outs[1].hidden_states, outs[0].hidden_states, atol=1e-4, rtol=1e-4)


def test_prefill_longer_than_a_verify_step_runs_the_kernel_through_the_graph_buffers(model):
    """A 40-token prompt (over KERNEL_MAX_QUERY_LEN, few (query, key) pairs) takes the kernel path and the
    graph runner's 64-token bucket, and samples and hands the drafter what the SDPA path does."""
    prompt = [(7 * i + 3) % model.config.vocab_size for i in range(40)]
    plain = VerifierRunner(model, model.make_kv_cache(64, 4), sampler_backend="reference")
    cache = model.make_kv_cache(64, 4)
    graphed = VerifierRunner(model, cache, sampler_backend="reference", attention_kernel=True, cuda_graphs=False)
    graphed.graphs = CudaGraphRunner(model, cache, max_model_len=64, max_num_tokens=64, capture=False)
    ran = []
    run = graphed.graphs.run
    graphed.graphs.run = lambda *args: ran.append(args[2].num_tokens) or run(*args)
    outs = [step(r, [("p", 0, prompt, 0, True)]) for r in (plain, graphed)]
    assert ran == [40]
    assert outs[0].sampled_token_ids == outs[1].sampled_token_ids
    torch.testing.assert_close(outs[1].hidden_states, outs[0].hidden_states, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("wrong_first", [False, True])
def test_hidden_rows_are_those_of_the_accepted_positions_request_after_request(wrong_first):
    """`step_output` sends the drafter the hidden rows of each request's kept positions, in request
    order: one run of rows when every draft is kept (a slice), separate runs when a request loses its
    tail (an index); both must pick exactly the rows of the positions the tokens follow."""
    # a: 1 token + 2 drafts; b: 1 token + 1 draft. Query rows: a 0..2, b 3..4.
    requests = [
        VerifyItem(rid, 4, tokens, num_draft_tokens=len(tokens) - 1, sample=True, num_spec_tokens=2)
        for rid, tokens in (("a", [5, 6, 7]), ("b", [8, 9]))
    ]
    msg = VerifyBatch(iteration=1, requests=requests)
    batch = build_input_batch(msg, vocab_size=100, max_model_len=64, num_cached_tokens=lambda rid: 4)
    hidden = torch.arange(5, dtype=torch.float32)[:, None].repeat(1, 3)  # row i holds i
    # Sampled per request (padded with -1): a keeps both drafts or loses both; b keeps its draft.
    sampled = [[6, 7, 11], [9, 12, -1]] if not wrong_first else [[13, -1, -1], [9, 12, -1]]
    num_sampled = [3, 2] if not wrong_first else [1, 2]
    out = step_output(batch, sampled, num_sampled, hidden, (0, 0, 0, 0))
    rows_a = [0, 1, 2] if not wrong_first else [0]
    assert out.hidden_states[:, 0].tolist() == [*rows_a, 3, 4]
    assert out.next_token_ids == [sampled[0][: num_sampled[0]], [9, 12]]
    assert out.num_rejected == ([2, 0] if wrong_first else [0, 0])


def test_a_step_prepared_for_more_drafts_than_came_equals_a_plain_step(runner):
    """Async scheduling plans a step before its held drafts are in (`VerifierRunner.prepare` with a
    placeholder per draft asked for); when fewer come, `step` prepares the real batch again: the
    early KV slots are rolled back and the output is that of a plain step."""
    ref = greedy(runner, "plain", 6)
    step(runner, [("p", 0, PROMPT, 0, True)])
    nc = len(PROMPT)
    early = runner.prepare(["p"], [nc], [1 + 3])  # 3 drafts asked for
    out = step(runner, [("p", nc, [ref[0], ref[1]], 1, True)])  # ... 1 came
    assert out.sampled_token_ids[0] == ref[1:3] and runner.kv_cache.num_tokens("p") == nc + 2
    assert not early.matches(_batch(runner, [("p", nc, [ref[0], ref[1]], 1, True)]))
    # A batch that matches its early prepare steps on it: same output as preparing it then.
    nc += 2
    msg = [("p", nc, [ref[2], ref[3], ref[4]], 2, True)]
    prepared = runner.prepare(["p"], [nc], [3])
    calls = []
    runner.prepare = lambda *args: calls.append(args)  # the step must not prepare again (instance attribute)
    try:
        out = runner.step(_batch(runner, msg), prepared)
    finally:
        del runner.prepare
    assert out.sampled_token_ids[0] == ref[3:6] and out.num_rejected[0] == 0 and calls == []
    runner.free(["p"])


def _batch(runner, reqs):
    items = [
        VerifyItem(rid, nc, list(tokens), num_draft_tokens=d, sample=sample, num_spec_tokens=3)
        for rid, nc, tokens, d, sample in reqs
    ]
    msg = VerifyBatch(iteration=1, requests=items)
    return build_input_batch(
        msg, vocab_size=runner.model.config.vocab_size, max_model_len=256, num_cached_tokens=runner.kv_cache.num_tokens
    )
