"""benchmarks/lib/weight_bytes.py: the weight bytes of the real shapes (counted from config.json as the loader holds
them), the expected routed experts a step touches, and the one-GPU memory plan behind benchmarks/lib/shapes.py's
DeepSeek-V3 layer count, and the cuts one H100 holds."""

import pytest

from benchmarks.lib.shapes import DEEPSEEK_V3_H100_LAYERS, DEEPSEEK_V3_H200_LAYERS, GLM_45_AIR_H100_LAYERS, SHAPES
from benchmarks.lib.weight_bytes import LayerBytes, model_bytes, plan_shares
from specsplit.runtime.kv_cache_size import GIB

H200 = int(139.8 * GIB)  # the H200's total memory as torch reports it (its memory plans print 139.8 GiB)
H100 = int(78 * GIB)  # an H100's, rounded down (torch reports 79.1 GiB for the 80 GB part)


def test_weights_of_the_fp8_shapes_as_counted_by_hand():
    glm = model_bytes(SHAPES["glm-4.5-air-fp8"])
    # 45 MoE layers of 129 experts x 3 x 4096 x 1408 bytes (+ attention), a dense layer, bf16 embedding and head.
    assert glm.verifier_weights == pytest.approx(108.2e9, rel=2e-3)
    assert glm.drafter_weights == pytest.approx(4.89e9, rel=5e-3)
    dsv3 = model_bytes(SHAPES["deepseek-v3-fp8"])
    assert dsv3.layers[3].held() == pytest.approx(11.53e9, rel=2e-3)  # 257 experts of 3 x 7168 x 2048 + MLA
    assert dsv3.drafter_weights == pytest.approx(15.44e9, rel=2e-3)
    # bf16 doubles the decoder layers' bytes (the embedding and head are bf16 either way).
    assert model_bytes(SHAPES["glm-4.5-air"]).layers[1].held() == pytest.approx(2 * glm.layers[1].held(), rel=1e-3)


def test_routed_experts_touched_grow_with_tokens_to_all_of_them():
    layer = LayerBytes(fixed=10, expert=100, num_experts=128, top_k=8)
    assert layer.experts_touched(1) == pytest.approx(8)
    assert layer.experts_touched(32) == pytest.approx(128 * (1 - (120 / 128) ** 32))
    assert 127 < layer.experts_touched(128) < 128
    assert layer.active(1) == pytest.approx(10 + 800)
    dense = LayerBytes(fixed=10, expert=0, num_experts=0, top_k=0)
    assert dense.active(64) == 10


def test_iteration_bytes_add_the_drafter_steps_to_the_verify_step():
    glm = model_bytes(SHAPES["glm-4.5-air-fp8"])
    assert glm.iteration(1, 0, 0.0) == glm.verify_step(1)
    # k 3, 1.6 accepted: step 0 over round(2.6) rows, two later steps over one.
    assert glm.iteration(1, 3, 1.6) == pytest.approx(glm.verify_step(4) + glm.draft_step(3) + 2 * glm.draft_step(1))


def test_deepseek_v3_is_cut_to_the_most_layers_one_h200_holds():
    def plan(layers: int):
        sizes = model_bytes(dict(SHAPES["deepseek-v3-fp8"], num_hidden_layers=layers))
        return plan_shares(sizes, H200, 0.9, 0.1, kv_tokens=32 * (64 + 32 + 4), max_step_tokens=512)

    fits = plan(DEEPSEEK_V3_H200_LAYERS)
    assert fits.fits and not plan(DEEPSEEK_V3_H200_LAYERS + 1).fits
    # The MTP layer's 257 experts do not fit up's 0.1 for a co-located drafter: its share is raised.
    assert fits.drafter > 0.1 and fits.drafter_need <= fits.room(fits.drafter)
    assert fits.verifier + fits.drafter == pytest.approx(0.9)
    assert "cut the shape's layers" in plan(DEEPSEEK_V3_H200_LAYERS + 1).refusal()
    glm = plan_shares(model_bytes(SHAPES["glm-4.5-air-fp8"]), H200, 0.9, 0.1, 32 * (64 + 32 + 4), 512)
    assert glm.fits and (glm.verifier, glm.drafter) == (0.8, 0.1)  # up's defaults as they are


@pytest.mark.parametrize(
    "name, layers, dense", [("deepseek-v3", DEEPSEEK_V3_H100_LAYERS, 3), ("glm-4.5-air", GLM_45_AIR_H100_LAYERS, 1)]
)
def test_the_h100_cuts_hold_the_most_layers_78_gib_fits(name, layers, dense):
    """`<shape>-fp8-h100`: the FP8 MoE shape with the most layers whose verifier and co-located drafter (as
    `benchmarks/e2e.py --services-only` plans them) fit 78 GiB; MoE layers beyond the dense ones."""

    def plan(n: int):
        sizes = model_bytes(dict(SHAPES[f"{name}-fp8"], num_hidden_layers=n))
        return plan_shares(sizes, H100, 0.9, 0.1, kv_tokens=32 * (64 + 32 + 4), max_step_tokens=512)

    cut = SHAPES[f"{name}-fp8-h100"]
    assert cut["num_hidden_layers"] == layers > dense and cut["quantization_config"]["quant_method"] == "fp8"
    assert {k: v for k, v in cut.items() if k != "num_hidden_layers"} == {
        k: v for k, v in SHAPES[f"{name}-fp8"].items() if k != "num_hidden_layers"
    }
    assert plan(layers).fits and not plan(layers + 1).fits
