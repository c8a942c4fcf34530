"""What structured output costs a verify step: the grammar masks' host time (llguidance filling a packed mask per
row, drafts included, the batch's rows at once, as the verifier's `Grammars.batch_masks` does) and their device time
(the masks unpacked and applied to the logits, `logits_processors.apply`), at a 151,936-id vocabulary, batch 1 / 32 /
128 x k 3, the host time of a batch of new requests' first step (their matchers built, one row each) and of their
first 12 steps, with new matchers and with those finished requests left (`Grammars.free`); the drafter's host time
for the masks of a propose (k 3 MTP steps, `DrafterRunner._mask_grammars`) with every step masked and as served (the
later steps of rows whose grammar allows most tokens unmasked, `WIDE_MASK`); and the
demo checkpoint's acceptance under constraints with the drafter's drafts masked (as served) and unmasked, with the
share of verified drafts the grammar refused.

    python benchmarks/structured_output.py --device cuda [--batches 1 32 128] [--acceptance]

No 151,936-id tokenizer ships offline, so the masks run over a synthetic byte-level vocabulary of that size: the demo
tokenizer's ids, then the Python standard library's most frequent words and punctuation runs (with and without a
leading space), then letter strings; its shape (many short and medium tokens, a long tail) is what a code-and-text
BPE vocabulary looks like, which is what the mask's time depends on.
"""

from __future__ import annotations

import argparse
import collections
import functools
import re
import statistics
import sys
import sysconfig
import time
import types
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specsplit.drafter import runner as drafter_runner  # noqa: E402
from specsplit.runtime.grammar import Grammars  # noqa: E402
from specsplit.verifier.logits_processors import LogitsOptions, LogitsPlan, RequestRows, apply  # noqa: E402

VOCAB = 151_936
K = 3
SCHEMA = (
    '{"type": "object", "properties": {"name": {"type": "string", "maxLength": 64}, "size": {"type": "integer"}, '
    '"tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}, "ok": {"type": "boolean"}}, '
    '"required": ["name", "size", "tags", "ok"], "additionalProperties": false}'
)
TEXT = '{"name":"read_config_file_and_parse_every_section","size":4096,"tags":["io","config","parse","ini"],"ok":true}'
PROMPTS = [
    "import os\n\n\ndef read_lines(path):\n",
    "class Stack:\n    def __init__(self):\n",
    "    for i in range(len(items)):\n",
    "try:\n    import zlib\nexcept ImportError:\n",
    "if __name__ == '__main__':\n",
    "def add(a, b):\n    return",
    "with open(filename) as f:\n",
    "def fib(n):\n",
]
KINDS = {
    "json schema": {"json": SCHEMA},
    "regex": {"regex": r"[a-z]+(_[a-z]+)*\([a-z]*\)"},
    "choice": {"choice": ["read", "write", "close the file", "open the file"]},
    "grammar (GBNF)": {"grammar": 'root ::= "def " name "(" name ")"\nname ::= [a-z]+'},
}


class SyntheticTokenizer:
    """A byte-level vocabulary of `size` tokens (id 0: EOS) with a greedy longest-match encoder."""

    def __init__(self, size: int):
        tokens = [b"<eos>"] + [bytes([b]) for b in range(256)]
        seen = set(tokens)
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        counts: collections.Counter = collections.Counter()
        for path in sorted(stdlib.glob("*.py"))[:400]:
            for word in re.findall(r" ?\w+| ?[^\w\s]+|\s+", path.read_text(errors="replace")):
                counts[word.encode()] += 1
        for word, _ in counts.most_common():
            if len(tokens) == size:
                break
            if word not in seen:
                seen.add(word)
                tokens.append(word)
        rng = np.random.default_rng(0)
        while len(tokens) < size:
            word = bytes(rng.integers(97, 123, int(rng.integers(3, 9))).tolist())
            if word not in seen:
                seen.add(word)
                tokens.append(word)
        self.tokens = tokens
        self.eos_token_id, self.bos_token_id = 0, None
        self.special_token_ids = [0]
        self._max = max(map(len, tokens))
        self._ids = {t: i for i, t in enumerate(tokens)}

    def __call__(self, data: bytes) -> list[int]:
        out, at = [], 0
        while at < len(data):
            for n in range(min(self._max, len(data) - at), 0, -1):
                token = self._ids.get(data[at : at + n])
                if token is not None and token != 0:
                    out.append(token)
                    at += n
                    break
        return out


def synthetic_grammars() -> tuple[Grammars, SyntheticTokenizer]:
    import llguidance

    tok = SyntheticTokenizer(VOCAB)
    return Grammars(None, llguidance.LLTokenizer(llguidance.TokenizerWrapper(tok))), tok


def mask_times(batches: list[int], device: str, repeats: int) -> list[dict]:
    import llguidance

    grammars, tok = synthetic_grammars()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    text = tok(TEXT.encode())
    rows = []
    for batch in batches:
        # Each request decodes the text from its own point on, one token further every step, verifying the next K
        # tokens as drafts (all allowed: every row is masked, the most work a step does). Its matcher follows its
        # output as in serving: one new token consumed per step, the drafts consumed and rolled back.
        offsets = [i % (len(text) - K - repeats) for i in range(batch)]
        host = []
        for step in range(repeats):
            starts = [o + step for o in offsets]
            t0 = time.perf_counter()
            masks = grammars.batch_masks([(f"r{i}", grammar, text[:s], text[s : s + K]) for i, s in enumerate(starts)])
            host.append(time.perf_counter() - t0)
        plan = LogitsPlan(
            [
                RequestRows(i, i * (K + 1), text[s : s + K], [], 0, 0, LogitsOptions(grammar=grammar), allowed=m)
                for i, (s, m) in enumerate(zip(starts, masks))
            ]
        )
        logits = torch.randn(batch * (K + 1), VOCAB, device=device)
        dev = []
        for _ in range(repeats):
            if device != "cpu":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            apply(logits, plan)
            if device != "cpu":
                torch.cuda.synchronize()
            dev.append(time.perf_counter() - t0)
        first = []  # a batch of new requests' first step: their matchers made (no finished request's), one row each
        for step in range(repeats):
            ids = [f"new{step}-{i}" for i in range(batch)]
            fresh = Grammars(None, grammars.tokenizer)
            t0 = time.perf_counter()
            fresh.batch_masks([(rid, grammar, [], []) for rid in ids])
            first.append(time.perf_counter() - t0)
        # A batch of new requests' first START_STEPS steps, as the steps above from the text's start: with matchers
        # made new (a fresh Grammars each time) and with the matchers the requests before them left (`free`).
        new = [start_ms(Grammars(None, grammars.tokenizer), grammar, text, batch) for _ in range(3)]
        start_ms(grammars, grammar, text, batch)  # leaves its matchers for the next requests
        reused = [start_ms(grammars, grammar, text, batch) for _ in range(3)]
        every_step, served = propose_masks_ms(grammars, grammar, text, offsets, repeats, device)
        rows.append(
            dict(
                batch=batch,
                host_ms=1e3 * statistics.median(host),
                device_ms=1e3 * statistics.median(dev),
                first_ms=1e3 * statistics.median(first),
                start_new_ms=statistics.median(new),
                start_reused_ms=statistics.median(reused),
                propose_every_step_ms=every_step,
                propose_served_ms=served,
            )
        )
        r = rows[-1]
        print(
            f"| {batch} | {K} | {r['host_ms']:.2f} | {r['device_ms']:.3f} | {r['first_ms']:.2f} "
            f"| {r['start_new_ms']:.1f} | {r['start_reused_ms']:.1f} | {every_step:.2f} | {served:.2f} |",
            flush=True,
        )
    return rows


START_STEPS = 12


def propose_masks_ms(
    grammars: Grammars, grammar: str, text: list[int], offsets: list[int], repeats: int, device: str
) -> tuple[float, float]:
    """Median host ms of the drafter's masks for one propose of K MTP steps (the batch's requests at `offsets` in the
    text, one token further each repeat; each step's drafts the text's next tokens), with every step masked (a
    `WIDE_MASK` no mask exceeds) and as served: `DrafterRunner._mask_grammars` itself, the masks applied to logits on
    the GPU (their upload and kernel launched); on the CPU their application, which a GPU runs, is left out."""
    runner = types.SimpleNamespace(
        grammars=grammars, _column_ids=None, _words=None, _step_masks=None, graphs=None, device=torch.device(device)
    )
    runner._host_words = functools.partial(drafter_runner.DrafterRunner._host_words, runner)
    logits = torch.zeros(len(offsets), VOCAB, device=device)
    served, apply_packed = drafter_runner.WIDE_MASK, drafter_runner.apply_packed
    if device == "cpu":
        drafter_runner.apply_packed = lambda *args: None
    times = {}
    for wide_mask in (2.0, served):
        drafter_runner.WIDE_MASK = wide_mask
        per = []
        for step in range(repeats):
            starts = [o + step for o in offsets]
            items = [
                drafter_runner.ProposeItem(f"r{i}", 0, [], K, grammar=grammar, output=text[:s])
                for i, s in enumerate(starts)
            ]
            rows = list(range(len(items)))
            wide: set[int] = set()
            t0 = time.perf_counter()
            masks = drafter_runner.DrafterRunner._draft_masks(runner, items, rows)
            for j in range(K):
                drafted = {i: text[s : s + j] for i, s in enumerate(starts)}
                drafter_runner.DrafterRunner._mask_grammars(runner, masks, logits, items, rows, drafted, wide)
            masks.close()
            if device != "cpu":
                torch.cuda.synchronize()
            per.append(time.perf_counter() - t0)
        times[wide_mask] = 1e3 * statistics.median(per)
    drafter_runner.WIDE_MASK, drafter_runner.apply_packed = served, apply_packed
    return times[2.0], times[served]


def start_ms(grammars: Grammars, grammar: str, text: list[int], batch: int) -> float:
    """Host ms of the masks of `batch` new requests' first START_STEPS steps (each one token further, K drafts), their
    requests freed after."""
    ids = [f"start{time.perf_counter_ns()}-{i}" for i in range(batch)]
    t0 = time.perf_counter()
    for step in range(START_STEPS):
        grammars.batch_masks([(rid, grammar, text[:step], text[step : step + K]) for rid in ids])
    elapsed = 1e3 * (time.perf_counter() - t0)
    grammars.free(ids)
    return elapsed


def demo_llm(device: str):
    """The demo checkpoint in one process (specsplit.LLM), k 3 fixed."""
    import specsplit

    return specsplit.LLM(ROOT / "checkpoints" / "demo", num_speculative_tokens=K, adaptive=False, device=device)


def prompts_stats(llm, spec: dict | None):
    """The speculation stats of `PROMPTS` generated greedily under `spec` (48 tokens each), merged."""
    results = llm.generate(PROMPTS, max_tokens=48, structured_output=spec, detokenize=False)
    stats = results[0].stats
    for r in results[1:]:
        stats.merge(r.stats)
    return stats


def acceptance(device: str) -> None:
    """The demo checkpoint in one process (specsplit.LLM, k 3 fixed), greedy, under each kind of constraint, its
    drafts masked with the grammar (as served) and unmasked (the drafter without a tokenizer)."""
    llm = demo_llm(device)
    drafter_grammars, tokenizer_dir = llm.drafter.runner.grammars, llm.drafter.runner.grammars.tokenizer_dir
    verifier_grammars = llm.step.worker.grammars
    print("\n| constraint | drafts | acceptance per draft position | tokens per iteration | drafts refused |")
    print("|---|---|---|---|---|")
    for kind, spec in {"none": None, **KINDS}.items():
        for drafts in ("masked", "unmasked") if spec else ("-",):
            drafter_grammars.tokenizer_dir = None if drafts == "unmasked" else tokenizer_dir
            refused0, checked0 = verifier_grammars.refused, verifier_grammars.checked
            stats = prompts_stats(llm, spec)
            refused = verifier_grammars.refused - refused0
            checked = verifier_grammars.checked - checked0
            share = f"{refused / checked:.3f}" if checked else "-"
            per = ", ".join(f"{a:.3f}" for a in stats.acceptance_per_position)
            print(f"| {kind} | {drafts} | {per} | {stats.mean_accepted_length:.2f} | {share} |")
    drafter_grammars.tokenizer_dir = tokenizer_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--acceptance", action="store_true", help="also the demo checkpoint's acceptance under constraints")
    p.add_argument(
        "--wide-mask",
        type=float,
        default=None,
        help="the acceptance with the drafter's WIDE_MASK set to this (-1: step 0 alone masked; 2: every step)",
    )
    args = p.parse_args()
    name = torch.cuda.get_device_name() if args.device != "cpu" else "CPU"
    print(f"{name}: JSON-schema masks over a {VOCAB}-id vocabulary, k {K}, median of {args.repeats}")
    print(
        "| batch | k | host ms per step (masks of every row) | device ms per step (unpack + apply) "
        "| host ms of new requests' first step (matchers made) | host ms of new requests' first "
        f"{START_STEPS} steps, new matchers | the same, matchers reused "
        "| drafter host ms per propose, every step masked "
        "| the same, as served (rows allowing most tokens: step 0 alone) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    mask_times(args.batches, args.device, args.repeats)
    if args.acceptance:
        if args.wide_mask is not None:
            drafter_runner.WIDE_MASK = args.wide_mask
        acceptance(args.device)


if __name__ == "__main__":
    main()
