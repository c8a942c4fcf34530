"""Penalties, min_tokens and logprobs on the target's logits (`specsplit/verifier/logits_processors.py`): each row is
processed as target-only decoding would process it (the drafts before it counted as output), so verification stays
lossless; greedy output through the verifier's worker with drafts equals transformers' own penalised generation."""

from collections import Counter

import pytest
import torch

from specsplit.models.loader import load_target
from specsplit.verifier.batch import Sampling, VerifyBatch, VerifyItem
from specsplit.verifier.logits_processors import (
    LogitsOptions,
    LogitsPlan,
    RequestRows,
    TokenHistory,
    apply,
    take_logprobs,
)
from specsplit.verifier.runner import VerifierRunner
from specsplit.verifier.worker import VerifierWorker
from tests.fixtures.tiny import write_tiny_checkpoint

V = 101  # an odd vocabulary


def _reference_row(row, prompt, output, o: LogitsOptions, num_output_before: int):
    """vLLM's formulas, one token at a time."""
    x = row.clone()
    for t in set(prompt) | set(output):
        x[t] = x[t] / o.repetition_penalty if x[t] > 0 else x[t] * o.repetition_penalty
    for t, c in Counter(output).items():
        x[t] -= o.frequency_penalty * c + o.presence_penalty
    if num_output_before < o.min_tokens:
        x[list(o.end_token_ids)] = float("-inf")
    return x


def test_every_row_is_processed_as_if_the_drafts_before_it_were_output():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, V, generator=g) * 3
    a = LogitsOptions(repetition_penalty=1.7, presence_penalty=0.5, frequency_penalty=0.3)
    b = LogitsOptions(min_tokens=4, end_token_ids=(2, 7))
    c = LogitsOptions(repetition_penalty=0.8, frequency_penalty=-0.4, min_tokens=3, end_token_ids=(5,))
    requests = [  # rows 0-2: a (2 drafts); row 3: a request without options; rows 4-5: b; rows 6-8: c
        RequestRows(0, 0, [9, 9], [1, 2, 3, 9, 4], 3, 5, a),
        RequestRows(2, 4, [2], [], 2, 5, b),
        RequestRows(3, 6, [5, 8], [4, 4, 5, 6], 2, 4, c),
    ]
    out = logits.clone()
    apply(out, LogitsPlan(requests))
    for r in requests:
        prompt, output = r.history[: r.num_prompt_tokens], r.history[r.num_prompt_tokens :]
        for k in range(len(r.drafts) + 1):
            before = r.num_before + k - r.num_prompt_tokens
            want = _reference_row(logits[r.first_row + k], prompt, output + r.drafts[:k], r.options, before)
            torch.testing.assert_close(out[r.first_row + k], want, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[3], logits[3])  # a row of a request without options is untouched
    assert torch.isinf(out[4, [2, 7]]).all() and not torch.isinf(out[5]).any()  # b: 3 output before row 4, 4 before 5


def test_logprobs_are_the_raw_rows_log_softmax_with_the_most_likely_first():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    o = LogitsOptions(logprobs=4, repetition_penalty=2.0)
    plan = LogitsPlan([RequestRows(0, 0, [7, 8], [1, 2], 1, 2, o)])
    taken = take_logprobs(logits, plan)
    apply(logits.clone(), plan)  # penalties do not change what was taken
    want = torch.log_softmax(logits, -1)
    torch.testing.assert_close(taken.logprobs, want)
    assert taken.top_ids.tolist() == want.topk(4, -1).indices.tolist()
    sampled = torch.tensor([[7, 30, -1]])  # draft 7 accepted, 30 recovered; the padded slot picks any token
    chosen = taken.chosen(sampled, {0: 0})
    assert chosen[:2].tolist() == pytest.approx([want[0, 7].item(), want[1, 30].item()])


# ---- lossless through the worker, against transformers' own penalised generation -----------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("lp") / "m", architecture="llama", seed=3)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_target(checkpoint)


@pytest.fixture
def worker(model):
    runner = VerifierRunner(model, model.make_kv_cache(64, 4), sampler_backend="reference")
    return VerifierWorker(runner, vocab_size=model.config.vocab_size, max_model_len=256, device="cpu")


PROMPT = [5, 17, 42, 5, 7, 3, 17]


def _speculate(worker, sampling: Sampling, oracle: list[int], n: int) -> tuple[list[int], list]:
    """Greedy decoding of n tokens through the worker, each step verifying 3 drafts: the oracle's next tokens with
    the last one wrong every other step (so steps accept all, or reject one)."""
    out, logprobs, it = [], [], 0
    while len(out) < n:
        it += 1
        r = VerifyItem("a", 0, [], sample=True, num_prompt_tokens=len(PROMPT), sampling=sampling)
        if not out:
            r.token_ids = list(PROMPT)
        else:
            drafts = oracle[len(out) : len(out) + 3]
            if it % 2 and drafts:
                drafts[-1] = (drafts[-1] + 1) % 100
            r.num_computed_tokens = len(PROMPT) + len(out) - 1
            r.token_ids = [out[-1], *drafts]
            r.num_draft_tokens = len(drafts)
        msg = VerifyBatch(iteration=it, requests=[r])
        batch, launched, _ = worker.launch(msg)
        step = worker.finish(batch, launched)
        out += step.sampled_token_ids[0]
        logprobs += step.logprobs[0] if step.logprobs else []
    return out[:n], logprobs[:n]


@pytest.mark.parametrize(
    "hf_options, sampling",
    [
        ({"repetition_penalty": 1.8}, Sampling(repetition_penalty=1.8)),
        ({"repetition_penalty": 0.7}, Sampling(repetition_penalty=0.7)),
    ],
)
def test_greedy_with_drafts_equals_transformers_penalised_generation(worker, hf_model, hf_options, sampling):
    n = 24
    with torch.no_grad():
        oracle = hf_model.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, **hf_options)
    oracle = oracle[0, len(PROMPT) :].tolist()
    plain = hf_model.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False)[0, len(PROMPT) :].tolist()
    assert oracle != plain  # the penalty matters on this prompt
    got, _ = _speculate(worker, sampling, oracle, n)
    assert got == oracle


def test_min_tokens_keeps_the_end_tokens_out_until_enough_are_out(worker, hf_model):
    with torch.no_grad():
        plain = hf_model.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)[0, len(PROMPT) :]
    end = plain[1].item()  # what greedy emits second: the request's "EOS" here
    with torch.no_grad():
        oracle = hf_model.generate(
            torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, min_new_tokens=6, eos_token_id=end,
            pad_token_id=0,
        )[0, len(PROMPT) :].tolist()  # fmt: skip
    assert end not in oracle[:6]
    sampling = Sampling(min_tokens=6, end_token_ids=(end,))
    got, _ = _speculate(worker, sampling, oracle, len(oracle))
    assert got == oracle


def test_logprobs_of_each_emitted_token_are_the_targets(worker, hf_model):
    n = 10
    with torch.no_grad():
        full = hf_model.generate(
            torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    oracle = full.sequences[0, len(PROMPT) :].tolist()
    want = [torch.log_softmax(step_logits[0].float(), -1) for step_logits in full.logits]  # raw logits per position
    got, logprobs = _speculate(worker, Sampling(logprobs=3), oracle, n)
    assert got == oracle and len(logprobs) == n
    for k, entry in enumerate(logprobs):
        assert entry.token_id == oracle[k] and entry.logprob == pytest.approx(want[k][oracle[k]].item(), abs=1e-4)
        top = want[k].topk(3)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_sampled_tokens_follow_the_penalised_target_where_a_draft_was_verified(model, hf_model):
    """Temperature 1, all three penalties, a one-hot draft after the prompt: the token emitted at the draft's position
    (the draft accepted, or one drawn from the residual) follows the processed target (chi-square over 2,000 seeded
    requests: each token expected 5 times or more, the prompt's tokens together, the rest; the last 4 prompt tokens
    count as output,
    so presence and frequency apply). Sampled from the unprocessed target, it fails."""
    from scipy.stats import chisquare

    runner = VerifierRunner(model, model.make_kv_cache(512, 4), sampler_backend="reference")
    worker = VerifierWorker(runner, vocab_size=model.config.vocab_size, max_model_len=256, device="cpu")
    o = LogitsOptions(repetition_penalty=1.5, presence_penalty=0.7, frequency_penalty=0.4)
    with torch.no_grad():
        raw = hf_model(torch.tensor([PROMPT])).logits[0, -1].float()
    p = torch.softmax(_reference_row(raw, PROMPT[:3], PROMPT[3:], o, 4).double(), -1)
    draft = p.topk(2).indices[1].item()  # the second most likely: accepted often, rejected often
    sampling = dict(temperature=1.0, repetition_penalty=1.5, presence_penalty=0.7, frequency_penalty=0.4)
    counts = torch.zeros_like(p)
    for it in range(10):
        requests = [
            VerifyItem(
                f"r{i}", 0, [*PROMPT, draft], num_draft_tokens=1, sample=True, num_prompt_tokens=3,
                sampling=Sampling(seed=1000 * it + i, **sampling),
            )
            for i in range(200)
        ]  # fmt: skip
        msg = VerifyBatch(iteration=it + 1, requests=requests)
        batch, launched, _ = worker.launch(msg)
        step = worker.finish(batch, launched)
        for tokens in step.sampled_token_ids:
            counts[tokens[0]] += 1
        worker.free([r.request_id for r in msg.requests])
    n = counts.sum()
    prompt = sorted(set(PROMPT))  # the penalised tokens, one bin: where the penalties move the most mass
    bins = [[t] for t in range(len(p)) if p[t] * n >= 5 and t not in prompt] + [prompt]
    binned = [t for b in bins for t in b]
    observed = [counts[b].sum().item() for b in bins] + [(n - counts[binned].sum()).item()]
    expected = [(p[b].sum() * n).item() for b in bins] + [((1 - p[binned].sum()) * n).item()]
    result = chisquare(observed, expected)
    assert result.pvalue > 1e-3, (observed, expected)


def test_a_token_history_is_cut_back_and_extended_in_place_and_its_views_stay_as_they_were():
    """`TokenHistory` (the worker's history of a request with penalties or a grammar): `set(keep, tokens)` is its
    first `keep` tokens then `tokens`, growing past its array's size; a view taken before is not changed by a later
    step's tokens, which go past it."""
    history = TokenHistory([1, 2, 3])
    history.set(3, [4, 5, 6])  # the step's last token and two drafts
    assert list(history.view(len(history))) == [1, 2, 3, 4, 5, 6]
    before = history.view(4)  # the history before the drafts
    history.set(5, [9, 10])  # one draft accepted: num_computed_tokens 5
    assert list(history.view(len(history))) == [1, 2, 3, 4, 5, 9, 10] and list(before) == [1, 2, 3, 4]
    history.set(7, list(range(100, 300)))  # past the array's size
    assert len(history) == 207 and list(history.view(9)) == [1, 2, 3, 4, 5, 9, 10, 100, 101]
    assert list(before) == [1, 2, 3, 4]
    history.set(2, [7])  # cut back (a re-prefill)
    assert list(history.view(len(history))) == [1, 2, 7]
