"""Penalties, min_tokens and logprobs through the three services (speculation on): greedy output equals
transformers' own penalised generation, and the log-probabilities are the target's, on the gRPC SDK and through
the official openai client."""

import openai
import pytest
import torch

from specsplit import Client


@pytest.fixture(scope="module")
def hf_model(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()


def _hf(hf_model, ids: list[int], n: int, **options):
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0, output_logits=True,
            return_dict_in_generate=True, **options,
        )  # fmt: skip
    tokens = out.sequences[0, len(ids) :].tolist()
    return tokens, [torch.log_softmax(step[0].float(), -1) for step in out.logits]  # raw logits per position


IDS = [1, 5, 17, 42, 5, 7, 3, 17, 9]


def test_greedy_with_a_repetition_penalty_equals_transformers(cluster, hf_model):
    want, _ = _hf(hf_model, IDS, 20, repetition_penalty=1.8)
    plain, _ = _hf(hf_model, IDS, 20)
    assert want != plain  # the penalty changes this output
    with Client(cluster.address, timeout=60) as client:
        out = client.generate(prompt_token_ids=IDS, max_tokens=20, repetition_penalty=1.8)
    assert out.token_ids == want and out.stats.num_draft_tokens > 0  # speculation ran, lossless


def test_a_penalised_request_started_on_cached_blocks_equals_transformers(cluster, hf_model):
    """Prefix caching: a request whose prompt the cache holds starts on its blocks, its history (what its penalties
    count) their tokens; greedy with a repetition penalty still equals transformers', the second time as the first."""
    prompt = [(7 * i + 3) % 250 + 1 for i in range(70)]  # several blocks
    want, _ = _hf(hf_model, prompt, 16, repetition_penalty=1.8)
    with Client(cluster.address, timeout=60) as client:
        first = client.generate(prompt_token_ids=prompt, max_tokens=16, repetition_penalty=1.8)
        again = client.generate(prompt_token_ids=prompt, max_tokens=16, repetition_penalty=1.8)
    assert again.cached_tokens > 0  # the second started on the first's blocks
    assert first.token_ids == want and again.token_ids == want


def test_min_tokens_holds_back_the_stop_tokens_as_transformers_does(cluster, hf_model):
    plain, _ = _hf(hf_model, IDS, 8)
    stop = plain[1]  # greedy's second token, made a stop token
    eos = hf_model.generation_config.eos_token_id
    want, _ = _hf(hf_model, IDS, 10, min_new_tokens=5, eos_token_id=[stop, *([eos] if isinstance(eos, int) else eos)])
    assert stop not in want[:5]
    with Client(cluster.address, timeout=60) as client:
        out = client.generate(prompt_token_ids=IDS, max_tokens=10, min_tokens=5, stop_token_ids=[stop])
    assert out.token_ids == want


def test_logprobs_are_the_targets_on_grpc_and_openai(cluster, hf_model):
    want_ids, want_lp = _hf(hf_model, IDS, 8)
    with Client(cluster.address, timeout=60) as client:
        out = client.generate(prompt_token_ids=IDS, max_tokens=8, logprobs=3, ignore_eos=True)
    assert out.token_ids[: len(want_ids)] == want_ids and len(out.logprobs) == len(out.token_ids)
    for k, entry in enumerate(out.logprobs[: len(want_ids)]):
        assert entry.token_id == want_ids[k]
        assert entry.logprob == pytest.approx(want_lp[k][want_ids[k]].item(), abs=1e-4)
        top = want_lp[k].topk(3)
        assert [t for t, _ in entry.top] == top.indices.tolist()
    oai = openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused", max_retries=0, timeout=60)
    model = oai.models.list().data[0].id
    whole = oai.completions.create(
        model=model, prompt=IDS, max_tokens=8, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = whole.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([e.logprob for e in out.logprobs], abs=1e-5)
    # By token text, as OpenAI's completions format has it (two ids of one text share an entry).
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs) and len(lp.top_logprobs) == len(out.token_ids)
    chunks = list(
        oai.completions.create(
            model=model, prompt=IDS, max_tokens=8, temperature=0, logprobs=0, stream=True,
            extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx([e.logprob for e in out.logprobs], abs=1e-5)
    chat = oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)  # the most likely first
    oai.close()
