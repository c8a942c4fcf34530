"""Structured output's benchmarks: `benchmarks/e2e.py --structured json` (every cell also under a JSON schema, checked
against the constrained target-only output and the schema, forced acceptance following the constrained output), the
synthetic tokenizer it gives a random-weight shape, the summary of its invocations, and
`benchmarks/grammar_engines.py` without xgrammar, and the drafter's mask benchmark (`benchmarks/draft_masks.py`)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.lib.forced_acceptance import KEY_LEN, ForcedAcceptanceRunner, Oracle, prompt_request_id
from benchmarks.lib.structured import SPECS, write_tokenizer
from benchmarks.structured_output import SyntheticTokenizer
from specsplit.drafter.runner import ProposeItem

ROOT = Path(__file__).resolve().parents[2]
E2E = ROOT / "benchmarks" / "e2e.py"
MODES = ["target_only", "in_process", "services_colocated"]


def _matcher(tokenizer_dir: Path):
    """A fresh llguidance matcher of the JSON schema as the coordinator compiles it, over the checkpoint's tokenizer."""
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    from specsplit.client.sdk import structured_output_pb
    from specsplit.coordinator.structured_output import compile_grammar

    tokenizer = llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True))
    grammar = compile_grammar(structured_output_pb(SPECS["json"]))
    return tokenizer, lambda: llguidance.LLMatcher(tokenizer, grammar)


def test_every_cell_also_runs_under_the_json_schema_and_its_outputs_follow_it(tmp_path):
    out = tmp_path / "e2e.json"
    args = ["--shape", "qwen2-tiny", "--load-format", "dummy", "--alpha", "0.8", "--batches", "2", "--ks", "3"]
    args += ["--new-tokens", "12", "--repeats", "1", "--warmup-tokens", "4", "--num-blocks", "256"]
    args += ["--structured", "json", "--out", str(out)]
    proc = subprocess.run([sys.executable, str(E2E), *args], capture_output=True, text=True, timeout=300)
    logs = re.search(r"logs in (\S+)\]", proc.stderr)  # the run's work directory (checkpoint, oracle, logs)
    work = Path(logs.group(1)) if logs else None
    try:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "lossless: yes" in proc.stdout and "json: yes" in proc.stdout
        result = json.loads(out.read_text())
        assert [(r["batch"], r["k"], r["mode"]) for r in result["rows"]] == [
            (2, k, f"{mode}{suffix}") for k, mode in zip([0, 3, 3], MODES) for suffix in ("", "+json")
        ]
        rows = {r["mode"]: r for r in result["rows"]}
        for mode in MODES:
            constrained, plain = rows[f"{mode}+json"], rows[mode]
            assert constrained["format_problems"] == [] and "format_problems" not in plain
            assert constrained["structured_cost"] == pytest.approx(
                constrained["tokens_per_s"] / plain["tokens_per_s"] - 1
            )
            assert len(constrained["structured_cost_runs"]) == 1 and plain["structured_cost"] is None
        # Constrained requests were forced from the constrained target's continuation with their unconstrained
        # twins' coins: the same drafts accepted at every position (the unconstrained continuation would have been
        # left at the first token, the drafts then the grammar-masked MTP's own).
        services, services_json = rows["services_colocated"], rows["services_colocated+json"]
        assert services["accepted_per_iteration"] > 0.5
        assert services_json["acceptance_per_position"] == services["acceptance_per_position"]
        assert rows["services_colocated+json"]["speedup"] == pytest.approx(
            rows["target_only+json"]["seconds"] / rows["services_colocated+json"]["seconds"]
        )
        assert "| 2 | 3 | services_colocated+json |" in proc.stdout.split("Structured output:")[1]

        # The outputs themselves (every cell's equals the constrained target-only output, checked above): JSON
        # text under the schema, token by token, which the unconstrained outputs are not.
        oracle = json.loads((work / "oracle.json").read_text())
        tokenizer, matcher = _matcher(work / "qwen2-tiny")
        assert tokenizer.vocab_size == 8192  # the synthetic vocabulary, the model's size
        for constrained, plain in zip(oracle["constrained"], oracle["sequences"]):
            assert constrained[:64] == plain[:64] and len(constrained) == 64 + 12
            output = constrained[64:]
            assert 0 not in output  # not ended: 12 tokens follow the schema without closing it
            assert matcher().try_consume_tokens(output) == len(output)
            assert tokenizer.decode_bytes(output).startswith(b'{"')
            assert matcher().try_consume_tokens(plain[64:]) < len(plain) - 64
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)


def test_structured_needs_the_in_process_engine():
    proc = subprocess.run(
        [sys.executable, str(E2E), "--shape", "qwen2-tiny", "--load-format", "dummy", "--services-only"]
        + ["--structured", "json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--structured runs beside the in-process engine" in proc.stderr


def test_the_synthetic_tokenizer_loads_as_the_checkpoints_and_decodes_to_its_bytes(tmp_path):
    import llguidance.hf
    from transformers import AutoTokenizer

    tok = write_tokenizer(tmp_path, 4096)
    assert len(tok.tokens) == 4096  # the model's vocabulary where it is smaller than the synthetic one
    hf = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert hf.eos_token_id == 0 and len(hf) == 4096
    ll = llguidance.hf.from_tokenizer(hf)
    assert ll.vocab_size == 4096 and ll.eos_tokens == [0]
    differ = [i for i in range(1, 4096) if ll.decode_bytes([i]) != tok.tokens[i]]
    assert differ == [256]  # the lone byte 0xff, llguidance's mark of special tokens (never in JSON text)
    text = b'{"name": "read_lines", "size": 4096}'
    assert b"".join(tok.tokens[i] for i in tok(text)) == text
    assert hf.decode(tok(text)) == text.decode()


def test_the_synthetic_tokenizer_is_the_mask_benchmarks_at_the_7b_vocabulary(tmp_path):
    tok = write_tokenizer(tmp_path, 152064)
    assert tok.tokens == SyntheticTokenizer(151_936).tokens


class FakeRunner:
    """Drafts token 0 always (the 'MTP')."""

    def propose(self, items, hidden_states):
        return SimpleNamespace(drafts=[[0] * item.num_spec_tokens for item in items])

    def free(self, request_ids):
        pass


def _drafts(runner, seq: list[int], grammar: str | None, prompt: int = 20) -> list[list[int]]:
    """Each Propose's drafts as the request (prompt 0 of the oracle) emits `seq` one token per iteration."""
    rid = prompt_request_id(0, f"t{grammar}")
    out = [runner.propose([ProposeItem(rid, 0, seq[1 : prompt + 1], 3, grammar=grammar)], None).drafts[0]]
    for n in range(prompt + 1, prompt + 6):  # position n's token emitted
        out.append(runner.propose([ProposeItem(rid, n - 1, seq[n : n + 1], 3, grammar=grammar)], None).drafts[0])
    return out


def test_requests_with_a_grammar_are_forced_from_the_constrained_continuations_with_the_same_coins(tmp_path):
    prompt = list(range(1, 21))
    plain = prompt + [100 + i for i in range(40)]
    constrained = prompt + [500 + i for i in range(40)]
    Oracle([plain], 1000, [constrained]).save(tmp_path / "oracle.json")
    oracle = Oracle.load(tmp_path / "oracle.json")
    assert oracle.constrained == [constrained]
    runner = ForcedAcceptanceRunner(FakeRunner(), oracle, 0.5, seed=3)
    kept = {}
    for grammar, seq in ((None, plain), ("a grammar", constrained)):
        drafts = _drafts(runner, seq, grammar)
        # Each draft: the continuation's token at its position (kept), else the MTP's 0.
        for j, ds in enumerate(drafts):
            for i, d in enumerate(ds):
                assert d in (0, seq[21 + j + i]), (grammar, j, i)
        kept[grammar] = [[d != 0 for d in ds] for ds in drafts]
    assert runner.num_lost == 0
    assert kept[None] == kept["a grammar"]  # the same coins
    assert any(map(any, kept[None])) and not all(map(all, kept[None]))
    # Without constrained continuations, a request with a grammar keeps the MTP's drafts.
    alone = ForcedAcceptanceRunner(FakeRunner(), Oracle([plain], 1000), 1.0)
    assert _drafts(alone, constrained, "a grammar") == [[0, 0, 0]] * 6
    with pytest.raises(ValueError, match="same prompts"):
        Oracle([plain], 1000, [[7] * (KEY_LEN + 1) + constrained[KEY_LEN + 1 :]])


def _summary_rows(path: Path, kind_rate: dict[str, float]) -> None:
    rows = []
    for mode, tps in kind_rate.items():
        twin = kind_rate.get(mode.partition("+")[0])
        cost = tps / twin - 1 if "+" in mode else None
        rows.append({"batch": 32, "k": 0 if mode.startswith("target") else 3, "mode": mode, "tokens_per_s": tps})
        rows[-1]["structured_cost"] = cost
    path.write_text(json.dumps({"rows": rows, "lossless_failures": [], "complete": True}))


def test_the_summary_compares_constrained_modes_with_constrained_target_only_and_their_twins(tmp_path):
    rates = {"target_only": 100.0, "target_only+json": 80.0, "services_colocated": 200.0}
    _summary_rows(tmp_path / "s-1.json", rates | {"services_colocated+json": 180.0})
    _summary_rows(tmp_path / "s-2.json", rates | {"services_colocated+json": 190.0})
    out = subprocess.run(
        [sys.executable, "benchmarks/lib/e2e_summary.py", str(tmp_path), "s"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    ).stdout
    lines = out.splitlines()
    assert "| s | 32 | services_colocated+json | 2 | 180–190 | 2.25–2.38x | 2/2 |" in lines
    assert "| s | 32 | services_colocated | 2 | 200–200 | 2.00–2.00x | 2/2 |" in lines
    assert "| s | 32 | services_colocated+json | 2 | -10.0 % – -5.0 % |" in lines
    assert "| s | 32 | target_only+json | 2 | -20.0 % – -20.0 % |" in lines


def test_the_grammar_engine_benchmark_measures_llguidance_alone_without_xgrammar():
    code = (
        "import runpy, sys; sys.modules['xgrammar'] = None; sys.argv = sys.argv[1:]; "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    script = str(ROOT / "benchmarks" / "grammar_engines.py")
    proc = subprocess.run(
        [sys.executable, "-c", code, script, "--batches", "2", "--repeats", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "xgrammar does not import" in proc.stdout
    assert "llguidance 1." in proc.stdout and "importing it imports torch: False" in proc.stdout
    steps = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "| 2 | 8 |" in line]
    assert [line.split(" | ")[0:4] for line in steps] == [
        ["| " + kind, "2", "8", "llguidance"] for kind in ("json schema", "regex", "choice", "grammar (GBNF)")
    ]
    compiled = [line for line in proc.stdout.splitlines() if line.endswith("|") and "| llguidance |" in line]
    assert len(compiled) == 8 and "xgrammar |" not in proc.stdout


def test_the_mask_benchmark_gives_every_column_of_a_batch():
    """`benchmarks/structured_output.py` as documented, at a small batch: one row with every column timed, the
    drafter's propose with every step masked and as served among them."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "structured_output.py"), "--batches", "2", "--repeats", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 2 | 3 |")]
    assert len(rows) == 1 and len(rows[0].strip("|").split("|")) == 9
    assert all(float(cell) > 0 for cell in rows[0].strip("|").split("|")[2:])


def test_the_drafters_mask_benchmark_times_each_part_of_a_propose_for_both_grammars():
    """`benchmarks/draft_masks.py`: per grammar (the drafter's, the exact one) and executor threads, a row per part of a
    Propose (matchers, each step's masks and wide check, rollback, the whole), the parts adding up to the whole; then
    a fresh matcher's first mask at lengths into the schema's bounded string."""
    script = ROOT / "benchmarks" / "draft_masks.py"
    args = ["--batch", "2", "--proposes", "3", "--rounds", "2", "--threads", "1", "0"]
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tables: list[list[list[str]]] = []  # runs of table lines, each without its header and rule
    for line in proc.stdout.splitlines():
        if not line.startswith("|"):
            tables.append([])
        elif not line.startswith("|---"):
            tables[-1].append([cell.strip() for cell in line.split("|")[1:-1]])
    rows, first = [table[1:] for table in tables if table]
    cells = {(grammar, threads) for grammar, threads, *_ in rows}
    labels = ("default", "1", "none, in turn")
    assert cells == {(grammar, threads) for grammar in ("drafter's", "exact") for threads in labels}
    for cell in cells:
        parts = {part: float(mean) for grammar, threads, part, _, mean, *_ in rows if (grammar, threads) == cell}
        assert len(parts) == 3 + 2 * 3 and parts["propose"] > 0
        whole = pytest.approx(parts["propose"], rel=0.05, abs=0.01)
        assert sum(v for part, v in parts.items() if part != "propose") == whole
    # A fresh matcher's first mask inside the name: near its 64-character bound the exact grammar allows the few ids
    # that still fit, the drafter's (the bound left out) every string token.
    allowed = {(grammar, int(length)): int(ids) for grammar, length, _, _, ids in first}
    assert allowed[("exact", 60)] < allowed[("exact", 10)] <= allowed[("drafter's", 10)] == allowed[("drafter's", 60)]


def test_the_mask_benchmarks_fill_in_turn_writes_the_executors_masks():
    """`draft_masks.py --threads 0` times each row filled in turn on the calling thread: the same masks as llguidance's
    executor fills, row for row, at matchers in several states of the benchmark's schema."""
    import llguidance
    import llguidance.numpy
    import numpy as np

    from benchmarks.draft_masks import fill_in_turn, walks
    from benchmarks.structured_output import SCHEMA, synthetic_grammars
    from specsplit.client.sdk import structured_output_pb
    from specsplit.coordinator.structured_output import compile_grammar

    grammars, _ = synthetic_grammars()
    grammar = compile_grammar(structured_output_pb({"json": SCHEMA}))
    paths = walks(grammars, grammar, 3, 12, seed=1)
    jobs = []
    for row, cut in enumerate([0, 1, 5, 9, 12]):
        matcher = llguidance.LLMatcher(grammars.tokenizer, grammar)
        matcher.consume_tokens(paths[row % 3][:cut])
        jobs.append((matcher, row))
    by_executor = np.zeros((len(jobs), grammars.words), dtype=np.int32)
    in_turn = np.zeros_like(by_executor)
    llguidance.numpy.fill_next_token_bitmask_par(grammars.executor, jobs, by_executor)
    fill_in_turn(grammars.executor, jobs, in_turn)
    assert len({bytes(row) for row in in_turn}) > 2  # the states differ
    np.testing.assert_array_equal(in_turn, by_executor)


def test_the_propose_outputs_benchmark_times_both_ways_of_carrying_the_outputs_at_each_length():
    """`benchmarks/propose_outputs.py`: per output length, a row for the outputs' tails (as served) and one for whole
    outputs, each with the Propose's parts (the verifier's build, serialization, parsing, the drafter's matchers) and
    their whole; its Proposes' outputs follow the grammar (the script checks that no matcher refused one or lacked
    it)."""
    script = ROOT / "benchmarks" / "propose_outputs.py"
    args = ["--batch", "2", "--lengths", "16", "64", "--proposes", "3", "--rounds", "2"]
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in proc.stdout.splitlines() if line.startswith("| ")]
    table = {(length, mode): [float(v) for v in cells] for length, mode, *cells in rows[1:]}
    assert set(table) == {(length, mode) for length in ("16", "64") for mode in ("tails", "whole")}
    assert all(len(cells) == 5 and cells[-1] > 0 for cells in table.values())


def test_the_host_speed_benchmark_times_each_kind_of_host_work():
    """`benchmarks/host_speed.py`: one row per kind of host work, each a positive median in microseconds."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "host_speed.py")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert len(rows) == 7 and rows[0] == ["work", "median µs"]
    assert all(float(us) > 0 for _, us in rows[1:])
