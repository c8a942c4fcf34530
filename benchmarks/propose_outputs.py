"""The host time a constrained Propose spends on its requests' outputs, by output length: the verifier building the
items (`build_propose`), the message serialized and parsed (`parse_items`), and the drafter's matchers following the
outputs (`DraftMasks`, then the drafts rolled back). A Propose carries each request's output past what its earlier
Proposes carried (`ProposeItem.output_offset`); `whole` is every Propose carrying the whole output, as before the
offset, which the drafter then compared with what it followed. Both in one process, alternating, a batch of
constrained requests each writing a JSON array of strings over the synthetic 151,936-id vocabulary of
`structured_output.py`, k tokens a step; the median ms per Propose at each output length.

    python benchmarks/propose_outputs.py [--batch 32] [--lengths 64 512 2048 8192] [--proposes 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.structured_output import VOCAB, K, synthetic_grammars  # noqa: E402
from specsplit.drafter.servicer import parse_items  # noqa: E402
from specsplit.proto import drafter_pb2  # noqa: E402
from specsplit.runtime.grammar import DraftMasks  # noqa: E402
from specsplit.verifier.batch import Sampling  # noqa: E402
from specsplit.verifier.propose_request import SentOutputs, build_propose  # noqa: E402

SCHEMA = '{"type": "array", "items": {"type": "string"}}'
PARTS = ("build", "serialize", "parse", "matchers", "propose")


def text_tokens(tok, length: int) -> list[int]:
    """At least `length` tokens of a JSON array of strings (left open), as the synthetic tokenizer encodes it."""
    n = max(8, length // 4)
    while True:
        tokens = tok(("[" + ",".join(f'"item {i} of the list"' for i in range(n))).encode())
        if len(tokens) >= length:
            return tokens
        n *= 2


def run(grammars, grammar: str, text: list[int], batch: int, length: int, count: int, whole: bool, rnd: int) -> dict:
    """ms per part of `count` Proposes of `batch` requests whose outputs grow by K tokens a Propose from `length`."""
    ids = [f"r{rnd}-{'w' if whole else 't'}-{i}" for i in range(batch)]
    sampling = [Sampling(grammar=grammar)] * batch
    hidden = torch.zeros(batch * K, 2)
    sent = SentOutputs()
    times = {part: [] for part in PARTS}
    for n in range(-1, count):  # the first Propose of the requests (their matchers made) is not timed
        at = length + K * max(n, 0)
        step = [text[at - K : at]] * batch
        outputs = {i: text[: at - K] for i in range(batch)}
        marks = [time.perf_counter()]
        plan = build_propose(
            n,
            ids,
            [at] * batch,
            [K] * batch,
            sampling,
            hidden,
            next_token_ids=step,
            num_rejected=[0] * batch,
            grammar_outputs=outputs,
            sampled_token_ids=step,
            outputs_sent=None if whole else sent,
        )
        marks.append(time.perf_counter())
        data = plan.request.SerializeToString()
        marks.append(time.perf_counter())
        items = parse_items(drafter_pb2.ProposeRequest.FromString(data), VOCAB, 16)
        marks.append(time.perf_counter())
        masks = DraftMasks(
            grammars, {i: (it.request_id, it.grammar, it.output, it.output_offset) for i, it in enumerate(items)}
        )
        assert not masks.errors and not masks.wanted, (masks.errors, masks.wanted)
        masks.close()
        marks.append(time.perf_counter())
        if n >= 0:
            for part, a, b in zip(PARTS, marks, marks[1:]):
                times[part].append(1e3 * (b - a))
            times["propose"].append(1e3 * (marks[-1] - marks[0]))
    grammars.free(ids)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 512, 2048, 8192])
    p.add_argument("--proposes", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3, help="each mode's runs per length, alternating")
    args = p.parse_args()
    import llguidance

    grammars, tok = synthetic_grammars()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    text = text_tokens(tok, max(args.lengths) + K * (args.proposes + 1))
    print(f"batch {args.batch}, k {K}, {args.proposes} Proposes x {args.rounds} rounds per mode and length: median ms")
    print("| output tokens | outputs carried | " + " | ".join(PARTS) + " |")
    print("|---|---|" + "---|" * len(PARTS))
    for length in args.lengths:
        merged = {mode: {part: [] for part in PARTS} for mode in ("tails", "whole")}
        for rnd in range(args.rounds):
            for mode in ("tails", "whole") if rnd % 2 == 0 else ("whole", "tails"):
                times = run(grammars, grammar, text, args.batch, length, args.proposes, mode == "whole", rnd)
                for part in PARTS:
                    merged[mode][part] += times[part]
        for mode, times in merged.items():
            cells = " | ".join(f"{statistics.median(times[part]):.3f}" for part in PARTS)
            print(f"| {length} | {mode} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
