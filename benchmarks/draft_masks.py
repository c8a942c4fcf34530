"""The drafter's host time for a constrained Propose's masks, step by step, as `DrafterRunner` spends it: the matchers
brought to the outputs (`DraftMasks`), then per MTP step the masks filled (llguidance's executor) and the check for
wide rows (`_widen`), then the drafts rolled back. Each request walks the JSON schema of `structured_output.py` over its
synthetic 151,936-id vocabulary (a random allowed token each step, as a random-weight model writes), its output
growing by k tokens a Propose and its drafts the walk's next tokens; the Proposes' times over the walks, for the
drafter's grammar (`draft_grammar`: loose string bounds left out) and the exact one, with llguidance's executor at
its default threads and at each `--threads` (0: no executor, each row filled in turn on the calling thread, which
spares the executor's hand-off to its threads, which can cost more than a few cheap rows' masks: cpu_2core.md).
Mean and p90 matter more than the median: a length-bounded string's first mask at each length walks the vocabulary's
trie: the last table times a fresh matcher's first mask at a few lengths into the name, and the same mask again.

`--acceptance`: the demo checkpoint's acceptance (one process, k 3, greedy, `structured_output.py`'s prompts) under
that schema (a name of at most 64 characters) and under one of short bounded strings, with the drafter's grammar as
served, exact, and with every length bound left out, which is what the loose-bound threshold (`LOOSE_LENGTH`) is for.

    python benchmarks/draft_masks.py [--batch 32] [--proposes 25] [--threads 0 2 4] [--acceptance]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.structured_output import SCHEMA, VOCAB, K, SyntheticTokenizer, synthetic_grammars  # noqa: E402
from specsplit.drafter import runner as drafter_runner  # noqa: E402
from specsplit.runtime import grammar as grammar_module  # noqa: E402
from specsplit.runtime.grammar import DraftMasks, Grammars  # noqa: E402

# A schema whose strings are short and bounded (every bound tight, below LOOSE_LENGTH).
TIGHT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"type": "string", "minLength": 3, "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "tags"],
    "additionalProperties": False,
}
PARTS = ("matchers", *(f"step {s} {what}" for s in range(K) for what in ("masks", "wide")), "rollback", "propose")


def walks(grammars: Grammars, grammar: str, batch: int, length: int, seed: int) -> list[list[int]]:
    """Per request, up to `length` tokens of a walk through `grammar`: a uniformly random allowed token (EOS aside)
    each step, until only EOS is allowed."""
    import llguidance
    import llguidance.numpy

    rng = np.random.default_rng(seed)
    out = np.empty((1, grammars.words), dtype=np.int32)
    eos = grammars.eos
    result = []
    for _ in range(batch):
        matcher, seq = llguidance.LLMatcher(grammars.tokenizer, grammar), []
        for _ in range(length):
            llguidance.numpy.fill_next_token_bitmask(matcher, out, 0)
            allowed = np.flatnonzero(np.unpackbits(out.view(np.uint8), bitorder="little")[:VOCAB])
            allowed = allowed[~np.isin(allowed, list(eos))]
            if not len(allowed):
                break
            seq.append(int(allowed[rng.integers(len(allowed))]))
            matcher.consume_token(seq[-1])
        result.append(seq)
    return result


def proposes(grammars: Grammars, grammar: str, paths: list[list[int]], count: int, rounds: int) -> dict[str, list]:
    """ms per part of `count` Proposes along `paths`, `rounds` times over (the first round left out: its matchers are
    new), the batch's requests freed after each round (their matchers kept for the next, as served). `DraftMasks`
    masks with `grammar` as it is (the caller gives the drafter's or the exact one)."""
    relax, grammar_module.draft_grammar = grammar_module.draft_grammar, lambda g: g
    try:
        return _proposes(grammars, grammar, paths, count, rounds)
    finally:
        grammar_module.draft_grammar = relax


def _proposes(grammars: Grammars, grammar: str, paths: list[list[int]], count: int, rounds: int) -> dict[str, list]:
    times = {part: [] for part in PARTS}
    words = np.empty((len(paths), grammars.words), dtype=np.int32)
    for rnd in range(rounds):
        ids = [f"walk{rnd}-{i}" for i in range(len(paths))]
        for n in range(count):
            at = 2 + K * n
            t0 = time.perf_counter()
            before = at - K if n else 0  # what the request's earlier Proposes carried of its output, as served
            masks = DraftMasks(
                grammars, {i: (ids[i], grammar, path[before:at], before) for i, path in enumerate(paths)}
            )
            marks = [t0, time.perf_counter()]
            wide: set[int] = set()
            for s in range(K):
                jobs = [(i, i, path[at : at + s]) for i, path in enumerate(paths) if i not in wide]
                masks.fill(jobs, words)
                marks.append(time.perf_counter())
                drafter_runner._widen(words, [row for row, _, _ in jobs], [key for _, key, _ in jobs], wide)
                marks.append(time.perf_counter())
            masks.close()
            marks.append(time.perf_counter())
            if rnd:
                for part, (a, b) in zip(PARTS, zip(marks, marks[1:])):
                    times[part].append(1e3 * (b - a))
                times["propose"].append(1e3 * (marks[-1] - t0))
        grammars.free(ids)
    return times


def fill_in_turn(executor, jobs: list[tuple[object, int]], out: np.ndarray) -> None:
    """`llguidance.numpy.fill_next_token_bitmask_par`'s work without its executor: each (matcher, row) in turn."""
    import llguidance.numpy

    for matcher, row in jobs:
        llguidance.numpy.fill_next_token_bitmask(matcher, out, row)


def first_masks(grammars: Grammars, tok: SyntheticTokenizer, grammars_by_name: dict[str, str]) -> None:
    """ms of a fresh matcher's first mask, and of the same mask again, inside the schema's name (a string of at most 64
    characters) at a few lengths, per grammar."""
    import llguidance
    import llguidance.numpy

    out = np.empty((1, grammars.words), dtype=np.int32)
    print("\n| grammar | characters into the name | first mask ms | again ms | allowed ids |")
    print("|---|---|---|---|---|")
    for name, grammar in grammars_by_name.items():
        for length in (10, 30, 50, 60):
            matcher = llguidance.LLMatcher(grammars.tokenizer, grammar)
            prefix = tok(('{"name":"' + "ab" * (length // 2)).encode())
            matcher.consume_tokens(prefix)
            times = []
            for _ in range(2):
                t0 = time.perf_counter()
                llguidance.numpy.fill_next_token_bitmask(matcher, out, 0)
                times.append(1e3 * (time.perf_counter() - t0))
            allowed = int(np.bitwise_count(out.view(np.uint32)).sum())
            print(f"| {name} | {length} | {times[0]:.3f} | {times[1]:.3f} | {allowed} |", flush=True)


def acceptance() -> None:
    """The demo checkpoint's tokens per iteration under both schemas, the drafter's grammar as served, exact, and with
    every string length bound left out."""
    import json

    from benchmarks.structured_output import demo_llm, prompts_stats

    llm = demo_llm("cpu")
    served, loose = grammar_module.draft_grammar, grammar_module.LOOSE_LENGTH
    print("\n| schema | drafter's grammar | acceptance per draft position | tokens per iteration |")
    print("|---|---|---|---|")
    for name, schema in (("benchmark's (name <= 64 characters)", SCHEMA), ("short strings (3-8)", TIGHT_SCHEMA)):
        spec = {"json": schema if isinstance(schema, str) else json.dumps(schema)}
        for variant in ("as served", "exact", "every bound left out"):
            grammar_module.draft_grammar = (lambda g: g) if variant == "exact" else served
            grammar_module.LOOSE_LENGTH = 0 if variant == "every bound left out" else loose
            served.cache_clear()
            try:
                stats = prompts_stats(llm, spec)
            finally:
                grammar_module.draft_grammar, grammar_module.LOOSE_LENGTH = served, loose
                served.cache_clear()
            per = ", ".join(f"{a:.3f}" for a in stats.acceptance_per_position)
            print(f"| {name} | {variant} | {per} | {stats.mean_accepted_length:.2f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--proposes", type=int, default=25, help="Proposes per walk (the output grows by k each)")
    p.add_argument("--rounds", type=int, default=3, help="times over the walks, the first left out")
    p.add_argument(
        "--threads",
        type=int,
        nargs="*",
        default=[],
        help="llguidance executor threads besides its default (0: none, each row filled in turn on the calling thread)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--acceptance", action="store_true", help="also the demo checkpoint's acceptance (CPU)")
    args = p.parse_args()
    import llguidance
    import llguidance.numpy

    from specsplit.client.sdk import structured_output_pb
    from specsplit.coordinator.structured_output import compile_grammar

    grammars, tok = synthetic_grammars()
    exact = compile_grammar(structured_output_pb({"json": SCHEMA}))
    paths = walks(grammars, exact, args.batch, 2 + K * args.proposes + K, args.seed)
    timed = args.rounds - 1
    print(f"batch {args.batch}, k {K}, {args.proposes} Proposes per walk, {timed} rounds timed; ms per Propose")
    print("| grammar | executor threads | part | median | mean | p90 | max |")
    print("|---|---|---|---|---|---|---|")
    par = llguidance.numpy.fill_next_token_bitmask_par
    for threads in [None, *args.threads]:
        grammars._executor = llguidance.LLExecutor(threads) if threads else llguidance.LLExecutor()
        llguidance.numpy.fill_next_token_bitmask_par = fill_in_turn if threads == 0 else par
        label = "default" if threads is None else threads or "none, in turn"
        for name, grammar in (("drafter's", grammar_module.draft_grammar(exact)), ("exact", exact)):
            times = proposes(grammars, grammar, paths, args.proposes, args.rounds)
            for part in PARTS:
                v = times[part]
                print(
                    f"| {name} | {label} | {part} | {statistics.median(v):.3f} "
                    f"| {statistics.fmean(v):.3f} | {np.percentile(v, 90):.3f} | {max(v):.3f} |",
                    flush=True,
                )
    llguidance.numpy.fill_next_token_bitmask_par = par
    first_masks(grammars, tok, {"drafter's": grammar_module.draft_grammar(exact), "exact": exact})
    if args.acceptance:
        acceptance()


if __name__ == "__main__":
    main()
