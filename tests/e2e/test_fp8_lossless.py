"""Block-scaled FP8 checkpoints (target and MTP layer in FP8) decode losslessly: greedy output equals
transformers' generate on the dequantized checkpoint, for a tiny Qwen3 through the three services and
a tiny DeepSeek-V3 (MLA + MoE) through `specsplit.LLM` (the services' iteration in one process: a
second cluster would cost CI another ~20 s of start-up). `serve verifier` refuses another quantization
at start-up with one line (the other kinds: tests/models/test_fp8_checkpoint.py, on the load functions
start-up uses).

On the CPU the FP8 linears are dequantized at load (`specsplit.models.fp8_linear`), so the target served
is exactly the dequantized checkpoint's and the output is lossless against it; the W8A8 kernel path is
what tests/gpu/test_fp8_cuda.py checks on the GPU.
"""

import json
import random
import shutil
import subprocess
import sys

import torch

from specsplit.cli.launcher import LocalCluster
from tests.e2e.helpers import generate_concurrently
from tests.fixtures.fp8 import write_fp8_checkpoint
from tests.fixtures.tiny import write_tiny_checkpoint
from tests.fixtures.tiny_deepseek_v3 import write_served_tiny_deepseek

MAX_TOKENS = 16
PROMPT_LENGTHS = [1, 5, 17, 70]  # 70: two prefill chunks (budget 64)


def _write(kind: str, root):
    if kind == "qwen3":  # blocks that do not divide q/k/v or gate/up rows: fused layers keep per-row scales
        src, block = write_tiny_checkpoint(root / "src", architecture="qwen3", seed=1), (24, 32)
    else:  # target and MTP layer (MoE) in FP8; kv_a's 40 rows end in a partial block
        src = write_served_tiny_deepseek(root / "src")
        block = (16, 32)
    return write_fp8_checkpoint(src, root / "fp8", root / "dequantized", block)


def _hf_greedy_ignoring_eos(dequantized):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()

    def generate(prompt_ids: list[int], n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:  # carried past an EOS as ignore_eos does
            with torch.no_grad():
                ids = torch.tensor([prompt_ids + out])
                new = model.generate(
                    ids, max_new_tokens=n - len(out), do_sample=False, pad_token_id=model.generation_config.eos_token_id
                )
            out += new[0, ids.shape[1] :].tolist()
        return out[:n]

    return generate


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 300) for _ in range(n)] for n in PROMPT_LENGTHS]


def test_fp8_qwen3_through_the_services_equals_transformers_on_the_dequantized(tmp_path):
    fp8, dequantized = _write("qwen3", tmp_path)
    hf_greedy = _hf_greedy_ignoring_eos(dequantized)
    with LocalCluster(
        fp8,
        num_speculative_tokens=3,
        log_dir=tmp_path / "logs",
        # a fixed k: the test counts on the FP8 MTP layer's drafts (adaptive speculation may choose none)
        coordinator_args=["--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--no-adaptive"],
    ) as cluster:
        outs = generate_concurrently(cluster.address, _prompts(), MAX_TOKENS)
    for i, prompt in enumerate(_prompts()):
        assert outs[i].token_ids == hf_greedy(prompt, MAX_TOKENS), f"prompt {i} (len {len(prompt)})"
    assert sum(o.stats.num_draft_tokens for o in outs.values()) > 0  # the FP8 MTP layer drafted


def test_fp8_deepseek_v3_target_and_mtp_equal_transformers_on_the_dequantized(tmp_path):
    from specsplit import LLM

    fp8, dequantized = _write("deepseek_v3", tmp_path)
    llm = LLM(fp8, num_speculative_tokens=3, max_num_batched_tokens=64)
    results = llm.generate(_prompts(), max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    hf_greedy = _hf_greedy_ignoring_eos(dequantized)
    for result, prompt in zip(results, _prompts()):
        assert result.token_ids == hf_greedy(prompt, MAX_TOKENS), f"prompt of length {len(prompt)}"
    assert sum(r.stats.num_accepted_tokens for r in results) > 0  # the FP8 MoE MTP layer's drafts were accepted


def test_serve_verifier_refuses_another_quantization_with_one_line(tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(write_tiny_checkpoint(tmp_path / "src"), path)
    quantization = {"quant_method": "awq", "bits": 4, "group_size": 128}
    config = json.loads((path / "config.json").read_text()) | {"quantization_config": quantization}
    (path / "config.json").write_text(json.dumps(config))
    out = subprocess.run(
        [sys.executable, "-m", "specsplit", "serve", "verifier", "--model", str(path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "quant_method 'awq'" in lines[0] and "supported: unquantized weights, or block-scaled FP8" in lines[0]
