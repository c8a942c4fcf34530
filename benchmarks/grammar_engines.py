"""Grammar engines for structured output, llguidance (what specsplit serves with) against xgrammar, on the synthetic
151,936-id vocabulary of benchmarks/structured_output.py and its constraints (JSON schema, regex, choice, GBNF
grammar), on the host:

- compile: a constraint to a request's matcher. llguidance: the coordinator's compile (`compile_grammar`: the grammar
  text, validated; cached per constraint), then the verifier's `LLMatcher(tokenizer, grammar)` for every request (its
  lexer and parser are built there). xgrammar: `GrammarCompiler.compile_*` over the vocabulary (cached per constraint
  by the compiler), then `GrammarMatcher(compiled)` for every request. Cold: the cache cleared; cached: the same
  constraint again.
- step: a verify step's masks as the verifier needs them: B requests x (k 3 + 1) rows. Each request's matcher
  consumes the newest token of its output, then its k drafts one after another to mask the row after each (the
  drafts are the constraint's text, all allowed: the most work a step does), then the drafts are rolled back.
  llguidance: `Grammars.batch_masks`, the verifier's code (every row of the batch at once on its executor's
  threads). xgrammar: `GrammarMatcher.accept_token` for the output, then row by row across the batch
  `BatchGrammarMatcher.batch_fill_next_token_bitmask` and `batch_accept_token` for the drafts, `batch_rollback` at the
  end, on as many threads as llguidance's executor has. Request i decodes the constraint's text from its own point on
  (one token further every step, a fresh matcher made untimed where it starts over).
Medians and p90s over --repeats; the masks of both engines are compared row by row at batch 1 (the tokens they
disagree on, which should be none or a few special ids).

    python benchmarks/grammar_engines.py [--batches 1 32] [--repeats 20]

xgrammar is not one of specsplit's dependencies: where it does not import (e.g. `pip install --target /tmp/xg
xgrammar`, then PYTHONPATH=/tmp/xg), llguidance is measured alone.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.structured_output import KINDS, TEXT, VOCAB, synthetic_grammars  # noqa: E402
from specsplit.client.sdk import structured_output_pb  # noqa: E402
from specsplit.coordinator import structured_output as coordinator  # noqa: E402

K = 3
WORDS = -(-VOCAB // 32)
EOS = 0  # the synthetic tokenizer's
# Per constraint (KINDS' keys): a text it accepts, which the requests decode.
TEXTS = {
    "json schema": TEXT,
    "regex": "read_config_file_and_parse_every_section_of_it_then_write_the_result_back_to_disk(filename)",
    "choice": "close the file",
    "grammar (GBNF)": "def readconfigfileandparseeverysectionofitthenwritetheresultback(filename)",
}
THREADS = max(1, min(32, int(0.8 * len(os.sched_getaffinity(0)))))  # llguidance's LLExecutor default


def stats_ms(seconds: list[float]) -> tuple[float, float]:
    """(median, p90) in ms."""
    ms = sorted(1e3 * s for s in seconds)
    return statistics.median(ms), ms[min(len(ms) - 1, int(0.9 * len(ms)))]


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:  # e.g. on PYTHONPATH without its metadata
        return "(version unknown)"


def imports_torch(module: str) -> bool:
    """Whether importing `module` in a fresh interpreter imports torch too."""
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return out.strip() == "True"


class LLGuidance:
    name = "llguidance"

    def __init__(self):
        import llguidance

        t0 = time.perf_counter()
        self.grammars, self.tok = synthetic_grammars()
        self.tokenizer = self.grammars.tokenizer
        self.setup_s = time.perf_counter() - t0
        self.llguidance = llguidance

    def compile(self, spec: dict, cold: bool):
        # The coordinator's compile, its per-constraint cache cleared for a cold one.
        if cold:
            coordinator._compile.cache_clear()
        return coordinator.compile_grammar(structured_output_pb(spec))

    def matcher(self, compiled):
        return self.llguidance.LLMatcher(self.tokenizer, compiled)

    def begin(self, compiled, texts: list[list[int]]):
        self.compiled, self.texts = compiled, texts
        self.grammars.clear()

    def sync(self, i: int, output: list[int]) -> None:
        """Untimed: request i's matcher made and advanced through `output`."""
        self.grammars.free([f"r{i}"])
        self.grammars.batch_masks([(f"r{i}", self.compiled, output, [])])

    def step(self, outputs: list[list[int]], drafts: list[list[int]]) -> np.ndarray:
        jobs = [(f"r{i}", self.compiled, out, d) for i, (out, d) in enumerate(zip(outputs, drafts))]
        return np.concatenate(self.grammars.batch_masks(jobs))


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok):
        import xgrammar as xgr

        t0 = time.perf_counter()
        info = xgr.TokenizerInfo(tok.tokens, xgr.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=[EOS])
        self.compiler = xgr.GrammarCompiler(info, max_threads=THREADS)
        self.setup_s = time.perf_counter() - t0
        self.batch = xgr.BatchGrammarMatcher(THREADS)
        self.xgr = xgr

    def compile(self, spec: dict, cold: bool):
        if cold:
            self.compiler.clear_cache()
        kind, value = next(iter(spec.items()))
        if kind == "json":  # compact, as the coordinator compiles it (no whitespace between tokens)
            return self.compiler.compile_json_schema(value, any_whitespace=False, separators=(",", ":"))
        if kind == "regex":
            return self.compiler.compile_regex(value)
        if kind == "choice":  # as vLLM's xgrammar backend has it: one EBNF alternative per choice
            return self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in value))
        return self.compiler.compile_grammar(value)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def begin(self, compiled, texts: list[list[int]]):
        self.compiled, self.texts = compiled, texts
        self.matchers: dict[int, tuple[object, int]] = {}  # request -> (matcher, tokens of its output consumed)

    def sync(self, i: int, output: list[int]) -> None:
        m = self.matcher(self.compiled)
        for t in output:
            assert m.accept_token(t), "the text does not follow its constraint"
        self.matchers[i] = (m, len(output))

    def step(self, outputs: list[list[int]], drafts: list[list[int]]) -> np.ndarray:
        batch, xgr = len(outputs), self.xgr
        out = np.full((batch * (K + 1), WORDS), -1, dtype=np.int32)
        matchers = []
        for i, output in enumerate(outputs):
            m, consumed = self.matchers[i]
            for t in output[consumed:]:  # the step's new token
                m.accept_token(t)
            self.matchers[i] = (m, len(output))
            matchers.append(m)
        # Row j of every request still going: its mask, then its draft j consumed (an EOS ends it: no row after it
        # matters). Rows after a draft the matcher refuses keep allowing everything, as llguidance's.
        going, depth = list(range(batch)), [0] * batch
        for j in range(K + 1):
            if not going:
                break
            self.batch.batch_fill_next_token_bitmask(
                [matchers[i] for i in going], out, [i * (K + 1) + j for i in going]
            )
            going = [i for i in going if j < len(drafts[i]) and drafts[i][j] != EOS]
            accepted = xgr.BatchGrammarMatcher.batch_accept_token(
                [matchers[i] for i in going], [drafts[i][j] for i in going]
            )
            going = [i for i, ok in zip(going, accepted) if ok]
            for i in going:
                depth[i] += 1
        rolled = [i for i in range(batch) if depth[i]]
        if rolled:
            xgr.BatchGrammarMatcher.batch_rollback([matchers[i] for i in rolled], [depth[i] for i in rolled])
        return out


def step_times(engine, compiled, text: list[int], batch: int, repeats: int) -> tuple[list[float], np.ndarray]:
    """The step's time, `repeats` times (after one untimed), and the masks of the first timed step."""
    span = max(1, len(text) - K)  # a request at s has s output tokens and K drafts after them
    offsets = [i % span for i in range(batch)]
    engine.begin(compiled, [text] * batch)
    times, first, previous = [], None, [None] * batch
    for step in range(repeats + 1):
        starts = [(o + step) % span for o in offsets]
        for i, s in enumerate(starts):
            if previous[i] is None or s != previous[i] + 1:  # (re)starts: a fresh matcher, through all but one token
                engine.sync(i, text[: max(0, s - 1)])
        previous = starts
        outputs, drafts = [text[:s] for s in starts], [text[s : s + K] for s in starts]
        t0 = time.perf_counter()
        masks = engine.step(outputs, drafts)
        if step:
            times.append(time.perf_counter() - t0)
            first = masks if first is None else first
    return times, first


def compile_times(engine, spec: dict, repeats: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"cold": [], "cached": [], "matcher": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        compiled = engine.compile(spec, cold=True)
        t1 = time.perf_counter()
        engine.compile(spec, cold=False)
        t2 = time.perf_counter()
        engine.matcher(compiled)
        t3 = time.perf_counter()
        out["cold"].append(t1 - t0)
        out["cached"].append(t2 - t1)
        out["matcher"].append(t3 - t2)
    return out


def disagreement(a: np.ndarray, b: np.ndarray) -> tuple[int, int]:
    """(rows whose allowed tokens differ, tokens they differ on in all)."""
    bits_a = np.unpackbits(a.view(np.uint8), axis=1, bitorder="little")[:, :VOCAB]
    bits_b = np.unpackbits(b.view(np.uint8), axis=1, bitorder="little")[:, :VOCAB]
    differ = bits_a != bits_b
    return int(differ.any(axis=1).sum()), int(differ.sum())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    engines = [LLGuidance()]
    try:
        engines.append(XGrammar(engines[0].tok))
    except ImportError as err:
        print(f"xgrammar does not import ({err}): llguidance alone")
    for engine in engines:
        print(f"{engine.name} {version(engine.name)}: importing it imports torch: {imports_torch(engine.name)}")
    cpus = len(os.sched_getaffinity(0))
    print(
        f"{cpus} CPUs, mask threads {THREADS} per engine; {VOCAB}-id synthetic vocabulary, k {K}; median / p90 ms of "
        f"{args.repeats}"
    )
    print("set-up (tokenizer, compiler): " + ", ".join(f"{e.name} {1e3 * e.setup_s:.0f} ms" for e in engines) + "\n")
    print("| constraint | engine | compile cold | compile cached | matcher per request |")
    print("|---|---|---|---|---|")
    compiled = {}
    for kind, spec in KINDS.items():
        for engine in engines:
            times = compile_times(engine, spec, args.repeats)
            cells = " | ".join("{:.3f} / {:.3f}".format(*stats_ms(times[key])) for key in ("cold", "cached", "matcher"))
            print(f"| {kind} | {engine.name} | {cells} |", flush=True)
            compiled[kind, engine.name] = engine.compile(spec, cold=False)
    print(
        "\n| constraint | batch | rows | engine | step ms (median / p90) | rows whose masks differ from "
        f"{engines[0].name}'s |"
    )
    print("|---|---|---|---|---|---|")
    for kind in KINDS:
        text = engines[0].tok(TEXTS[kind].encode()) + [EOS]
        for batch in args.batches:
            reference = None
            for engine in engines:
                times, masks = step_times(engine, compiled[kind, engine.name], text, batch, args.repeats)
                if reference is None:
                    reference, differ = masks, "-"
                else:
                    rows, tokens = disagreement(reference, masks)
                    differ = f"{rows} of {len(masks)} ({tokens} token ids)"
                median, p90 = stats_ms(times)
                print(
                    f"| {kind} | {batch} | {batch * (K + 1)} | {engine.name} | {median:.3f} / {p90:.3f} | {differ} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
