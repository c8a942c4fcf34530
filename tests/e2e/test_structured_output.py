"""Structured output through the three services with the demo checkpoint (real drafts): every output follows its
constraint (a JSON schema, any JSON object, a regex, a choice, a GBNF grammar), greedy and sampled, with no drafts,
a fixed k of 3 and adaptive k, whole and streamed; greedy equals target-only decoding under the same constraint
(transformers' model with llguidance's mask, token by token); a bad constraint is INVALID_ARGUMENT naming it; a
max_tokens that cuts a JSON text ends with finish_reason "length"."""

import json
import re
import threading
import time

import grpc
import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import pytest
import torch

from specsplit import Client
from specsplit.cli.launcher import LocalCluster
from specsplit.client.errors import InvalidArgument
from specsplit.client.sdk import structured_output_pb
from specsplit.coordinator.structured_output import compile_grammar
from tests.e2e.helpers import generate_concurrently, kill_under_streams
from tests.e2e.test_demo_model import DEMO, PROMPTS

MAX_TOKENS = 48
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "size": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["name", "size", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]+_[0-9]{2}"
CHOICES = ["read", "write", "close the file"]
GBNF = 'root ::= "def " name "(" name ")"\nname ::= [a-z]+'
KINDS = {
    "json": {"json": SCHEMA},
    "json_object": {"json_object": True},
    "regex": {"regex": REGEX},
    "choice": {"choice": CHOICES},
    "grammar": {"grammar": GBNF},
}


def follows(kind: str, text: str) -> bool:
    if kind == "json":
        value = json.loads(text)
        return set(value) == {"name", "size", "ok"} and isinstance(value["size"], int) and len(value["name"]) <= 12
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"def [a-z]+\([a-z]+\)", text) is not None


@pytest.fixture(scope="module")
def oracle():
    """Target-only greedy decoding under a constraint: transformers' model, llguidance's mask at every token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEMO)
    model = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()
    lt = llguidance.hf.from_tokenizer(tok)

    def greedy(prompt_ids: list[int], grammar: str, n: int) -> list[int]:
        matcher, out = llguidance.LLMatcher(lt, grammar), []
        mask = llguidance.numpy.allocate_token_bitmask(1, lt.vocab_size)
        for _ in range(n):
            with torch.no_grad():
                logits = model(torch.tensor([prompt_ids + out])).logits[0, -1]
            llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
            bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[: logits.shape[0]].astype(bool)
            allowed = torch.from_numpy(np.pad(bits, (0, logits.shape[0] - bits.shape[0])))
            token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
            out.append(token)
            if token == tok.eos_token_id:
                break
            assert matcher.consume_token(token)
        return out

    return tok, greedy


def prompt_ids(i: int) -> list[int]:
    """PROMPTS[i] as the server tokenizes text (special tokens included)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO).encode(PROMPTS[i])


def run_all(address: str, k: int | None, **sampling) -> dict[str, list]:
    """Every kind on every prompt, all at once; per kind its results in prompt order."""
    jobs = [(kind, i) for kind in KINDS for i in range(4)]
    per = [{"structured_output": KINDS[kind], **sampling} for kind, _ in jobs]
    if k is not None:
        per = [p | {"num_speculative_tokens": k} for p in per]
    prompts = [prompt_ids(i) for _, i in jobs]
    outs = generate_concurrently(address, prompts, MAX_TOKENS, per_prompt=per, ignore_eos=False)
    results: dict[str, list] = {kind: [] for kind in KINDS}
    for n, (kind, _) in enumerate(jobs):
        results[kind].append(outs[n])
    return results


def test_greedy_follows_every_constraint_and_equals_target_only_decoding(demo_fixed_k, oracle):
    tok, greedy = oracle
    drafted = run_all(demo_fixed_k.address, 3)
    plain = run_all(demo_fixed_k.address, 0)
    accepted = 0
    for kind, spec in KINDS.items():
        grammar = compile_grammar(structured_output_pb(spec))
        for i, (a, b) in enumerate(zip(drafted[kind], plain[kind])):
            # Every bounded constraint ends; an object of any keys may go on until max_tokens (the demo model repeats).
            assert a.finish_reason == "stop" or kind == "json_object", (kind, i, a.text)
            assert a.finish_reason != "stop" or follows(kind, a.text), (kind, i, a.text)
            assert a.token_ids == b.token_ids, (kind, i)
            want = greedy(prompt_ids(i), grammar, MAX_TOKENS)
            assert a.token_ids == want, (kind, i)  # EOS included, as the services report it
            accepted += a.stats.num_accepted_tokens
    assert accepted > 0


def test_sampled_output_follows_the_constraint_and_reproduces_with_its_seed(demo_fixed_k):
    """Seeded sampling at temperature 1 (coupled verification): valid outputs, the same with k 3 as with none."""
    drafted = run_all(demo_fixed_k.address, 3, temperature=1.0, seed=17)
    plain = run_all(demo_fixed_k.address, 0, temperature=1.0, seed=17)
    for kind in KINDS:
        for i, (a, b) in enumerate(zip(drafted[kind], plain[kind])):
            if a.finish_reason == "stop":
                assert follows(kind, a.text), (kind, i, a.text)
            assert a.token_ids == b.token_ids, (kind, i)
    assert sum(r.finish_reason == "stop" for rs in drafted.values() for r in rs) >= len(drafted) * 2


def test_adaptive_and_streamed_outputs_follow_the_constraint(tmp_path):
    with LocalCluster(DEMO, num_speculative_tokens=3, log_dir=tmp_path, coordinator_args=["--adaptive"]) as cluster:
        outs = run_all(cluster.address, None)
        with Client(cluster.address, timeout=120) as client:
            for kind, spec in KINDS.items():
                deltas = list(client.stream(PROMPTS[0], max_tokens=MAX_TOKENS, structured_output=spec))
                text = "".join(d.text for d in deltas)
                assert text == outs[kind][0].text
                assert outs[kind][0].finish_reason != "stop" or follows(kind, text), (kind, text)
    for kind, results in outs.items():
        for r in results:
            assert r.finish_reason == "stop" or kind == "json_object", (kind, r.text)
            assert r.finish_reason != "stop" or follows(kind, r.text), (kind, r.text)


def test_a_cut_json_ends_with_length_and_a_bad_constraint_is_invalid_argument(demo_fixed_k):
    with Client(demo_fixed_k.address, timeout=120) as client:
        cut = client.generate(PROMPTS[0], max_tokens=4, structured_output={"json": SCHEMA})
        assert cut.finish_reason == "length" and cut.text.startswith("{")
        for bad, words in [
            ({"json": '{"type": "nope"}'}, "type"),
            ({"regex": "(unclosed"}, "regex"),
            ({"grammar": "root ::= undefined_rule"}, "grammar"),
        ]:
            with pytest.raises(InvalidArgument) as err:
                client.generate(PROMPTS[0], max_tokens=4, structured_output=bad)
            assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
            assert words in str(err.value).lower(), str(err.value)


def test_sampled_tokens_at_constrained_positions_follow_the_masked_target(demo_fixed_k, oracle):
    """Tokens 1 and 2 of 300 sampled generations under a regex (temperature 1, k 3: token 2 verifies a draft),
    unseeded (rejection sampling) and seeded (coupled), against the exact marginals of the target masked by the
    grammar at each position; chi-square, false-failure rate 1e-3 each."""
    from scipy import stats
    from transformers import AutoModelForCausalLM

    tok, _ = oracle
    model = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()
    lt = llguidance.hf.from_tokenizer(tok)
    grammar = compile_grammar(structured_output_pb({"regex": REGEX}))
    prompt = tok.encode(PROMPTS[1])
    mask = llguidance.numpy.allocate_token_bitmask(1, lt.vocab_size)

    def allowed(prefix: list[int], vocab: int) -> torch.Tensor:
        matcher = llguidance.LLMatcher(lt, grammar)
        assert matcher.consume_tokens(prefix) if prefix else True
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
        bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:vocab].astype(bool)
        return torch.from_numpy(np.pad(bits, (0, vocab - bits.shape[0])))

    with torch.no_grad():
        logits1 = model(torch.tensor([prompt])).logits[0, -1].double()
        vocab = logits1.shape[0]
        p1 = torch.softmax(logits1.masked_fill(~allowed([], vocab), float("-inf")), -1)
        support = torch.nonzero(p1 > 1e-7).flatten().tolist()
        logits2 = model(torch.tensor([prompt + [t] for t in support])).logits[:, -1].double()
        masks2 = torch.stack([allowed([t], vocab) for t in support])
        p2 = (p1[support, None] * torch.softmax(logits2.masked_fill(~masks2, float("-inf")), -1)).sum(0)

    n, workers = 300, 12
    for seeded in (False, True):
        tokens: list[list[int]] = []

        def worker(w, seeded=seeded, tokens=tokens):
            with Client(demo_fixed_k.address, timeout=300) as client:
                for s in range(w, n, workers):
                    out = client.generate(
                        prompt_token_ids=prompt, max_tokens=2, temperature=1.0, seed=s if seeded else None,
                        structured_output={"regex": REGEX},
                    )  # fmt: skip
                    tokens.append(out.token_ids)

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert len(tokens) == n
        for position, p in ((0, p1), (1, p2)):
            observed = [t[position] for t in tokens if len(t) > position]
            counts = np.bincount(observed, minlength=vocab).astype(float)
            expected = p.numpy() * len(observed)
            assert counts[expected == 0].sum() == 0  # nothing the grammar forbids
            big = expected >= 5
            obs = np.append(counts[big], counts[~big].sum())
            exp = np.append(expected[big], expected[~big].sum())
            obs, exp = obs[exp > 0], exp[exp > 0]
            exp *= obs.sum() / exp.sum()  # p's float sum
            assert len(obs) >= 3
            assert stats.chisquare(obs, exp).pvalue > 1e-3, (seeded, position)


def test_a_drafter_killed_under_constrained_streams_and_restarted_leaves_their_output_as_target_only(
    demo_fixed_k, oracle
):
    """Constrained streams (the drafter following each output's grammar, each Propose carrying only the output's new
    tokens) while the drafter is SIGKILLed and started again: the verifier goes on without drafts (its failed Propose
    drops what it had sent: a stream still running when the drafter is back sends its output whole). Every output
    still equals target-only decoding under its constraint up to its first EOS (the streams ignore EOS, which under a
    completed grammar is all that follows), and the restarted drafter's constrained drafts are accepted again."""
    tok, greedy = oracle
    kinds = ["json", "regex", "grammar", "json_object"]
    prompts = [prompt_ids(i) for i in range(len(kinds))]
    per = [{"structured_output": KINDS[kind]} for kind in kinds]
    results = kill_under_streams(demo_fixed_k, "drafter", prompts, MAX_TOKENS, per_prompt=per)
    eos = tok.eos_token_id
    for i, kind in enumerate(kinds):
        got = results[i][: results[i].index(eos) + 1] if eos in results[i] else results[i]
        assert got == greedy(prompts[i], compile_grammar(structured_output_pb(KINDS[kind])), len(got)), kind
    deadline = time.monotonic() + 30  # the verifier probes a lost drafter with backoff (<= 5 s)
    with Client(demo_fixed_k.address, timeout=60) as client:  # the restarted drafter drafts constrained requests again
        while True:
            out = client.generate(prompt_token_ids=prompts[0], max_tokens=24, structured_output=KINDS["json"])
            if out.stats.num_accepted_tokens > 0:
                break
            assert time.monotonic() < deadline, "no constrained drafts accepted 30 s after the drafter restarted"
            time.sleep(0.2)
    assert out.token_ids == greedy(prompts[0], compile_grammar(structured_output_pb(KINDS["json"])), 24)
