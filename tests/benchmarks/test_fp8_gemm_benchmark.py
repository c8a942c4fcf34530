"""benchmarks/fp8_gemm.py's CPU smoke mode: every candidate configuration for the tiny shapes runs under the
Triton interpreter and matches the torch reference; the JSON lands in --out."""

import json

import pytest
import torch

from benchmarks.fp8_gemm import main


def test_fp8_gemm_benchmark_checks_every_candidate_on_cpu(tmp_path, capsys):
    assert main(["--device", "cpu", "--tiny", "--m", "1,16", "--shapes", "split", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "fp8_gemm.json").read_text())["rows"]
    assert [(r["shape"], r["m"]) for r in rows] == [("split", 1), ("split", 16)]
    configs = [c for r in rows for c in r["configs"]]
    assert all(c["ok"] and c["err"] < 1e-2 for c in configs)
    assert any(c["config"]["split_k"] > 1 for c in configs)  # the split-K path ran too
    assert any(c["config"]["prequantize"] for c in configs)  # and the separate activation quantization
    assert any(c["config"]["swap_ab"] for c in configs) and any(not c["config"]["swap_ab"] for c in configs)
    assert "0 configurations failed" in capsys.readouterr().out


def test_report_prints_pasteable_configs_and_the_fastest_of_each_operand_order(monkeypatch):
    """The GPU run's report from rows with stand-in times (no GPU here): the CONFIGS block is valid Python that
    builds the fastest configuration of each (N, K, M bucket), and the default / x-rows / W-rows columns."""
    import argparse

    import benchmarks.fp8_gemm as sweep
    from specsplit.kernels.fp8_gemm_configs import Fp8GemmConfig

    monkeypatch.setattr(sweep, "FLUSH_BYTES", 1)  # one copy of each weight
    times = iter(range(10, 10_000))  # every timing slower than the last: the first FP8 candidate wins
    args = argparse.Namespace(device="cpu", tiny=True, quick=False, m=[3])
    rows = sweep.bench_shape("split", 96, 512, args, sweep.TINY_NUM_SMS, lambda fn: next(times) / 1e3)
    text = sweep.report(rows, "cpu")
    block = text.split("```python\n")[1].split("```")[0]
    namespace = {"Fp8GemmConfig": Fp8GemmConfig}
    exec(block.replace("CONFIGS: dict[tuple[int, int, int], Fp8GemmConfig]", "CONFIGS"), namespace)
    (row,) = rows
    assert namespace["CONFIGS"] == {(96, 512, 4): sweep._config(row["best"])} and row["best"] is row["configs"][0]
    line = next(line for line in text.splitlines() if line.startswith("| split | 96 x 512 | 3 |"))
    default_us, x_rows_us, w_rows_us = (float(cell) for cell in line.strip(" |").split(" | ")[-3:])
    assert (
        min(x_rows_us, w_rows_us) == row["best"]["us"] < max(x_rows_us, w_rows_us) and default_us >= row["best"]["us"]
    )


def test_compile_jobs_cover_every_kernel_variant_once_and_run():
    """The sweep's parallel precompilation: one job per launch configuration (K split or not) and K's
    specialization, each of which runs (here under the interpreter, in this process)."""
    import benchmarks.fp8_gemm as sweep

    jobs = sweep.compile_jobs({"a": (96, 512), "b": (200, 512)}, [1, 3], sweep.TINY_NUM_SMS, quick=True)
    # --quick: the default configuration per (shape, M); the same variant for both shapes is one job.
    defaults = {sweep.candidates(n, 512, m, sweep.TINY_NUM_SMS, False, True)[0] for n in (96, 200) for m in (1, 3)}
    assert len(jobs) == len({(c.block_m, c.block_n, c.split_k > 1, c.prequantize) for c in defaults}) >= 1
    assert sweep.compile_kernels(jobs, "cpu") == 0


@pytest.mark.parametrize(
    "shape, prefix, layers", [("glm-4.5-air-fp8", "glm45air.", 2), ("deepseek-v3-fp8", "dsv3.", 4)]
)
def test_the_swept_shapes_are_the_fp8_linears_the_models_run(tmp_path, shape, prefix, layers):
    """The sweep tunes the (N, K) of every FP8 linear the target and its MTP layer run once the loader has fused
    their projections (the dense MLP's and the shared experts' gate/up among them), and no other: a linear the
    models run unfused, or one the sweep lacks, would take `default_config` untuned. Built on the meta device as
    the loader builds a dummy FP8 model (a few layers: one of each kind)."""
    from benchmarks.fp8_gemm import SHAPES
    from benchmarks.lib.shapes import write_shape
    from specsplit.models import loader
    from specsplit.models.fp8_linear import Fp8Linear, dequantize_fp8_linears, use_fp8_linears
    from specsplit.models.layers import fuse_projections
    from specsplit.models.meta_init import on_meta

    path = write_shape(shape, tmp_path / shape)
    config_json = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config_json, "num_hidden_layers": layers}))
    config, quantization = loader.load_config(path), loader.load_quantization(path)
    run = set()
    for model_class in loader.FAMILIES[type(config)]:  # the target, then the MTP layer
        with on_meta():
            model = model_class(config)
        names = loader._fp8_linears_of_dummy(model, quantization)
        use_fp8_linears(model, names, quantization.block_n, quantization.block_k)
        dequantize_fp8_linears(model, torch.bfloat16, keep_fp8=True)  # as on CUDA: MLA's kv_b_proj leaves
        fuse_projections(model)
        run |= {(m.out_features, m.in_features) for m in model.modules() if isinstance(m, Fp8Linear)}
    assert run == {nk for name, nk in SHAPES.items() if name.startswith(prefix)}
