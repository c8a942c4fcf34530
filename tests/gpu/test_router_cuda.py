"""On a CUDA GPU, the router kernel (`specsplit.kernels.router`) picks the torch ops' experts with their weights at
GLM-4.5-Air's and DeepSeek-V3's router sizes, batch 1 to 512, and replays from a CUDA graph.

    SPECSPLIT_GPU_TESTS=1 python -m pytest -m gpu tests/gpu
"""

from __future__ import annotations

import pytest
import torch

from specsplit.kernels.router import route_reference, route_triton

pytestmark = pytest.mark.gpu
ROUTERS = {  # experts, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor
    "glm-4.5-air": (128, 8, 1, 1, True, 1.0),
    "deepseek-v3": (256, 8, 8, 4, True, 2.5),
}


@pytest.mark.parametrize("name", list(ROUTERS))
@pytest.mark.parametrize("num_tokens", [1, 32, 512])
def test_the_kernel_routes_as_the_torch_ops_on_the_gpu(name, num_tokens):
    experts, *args = ROUTERS[name]
    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    logits = torch.randn(num_tokens, experts, generator=g, device="cuda") * 2
    bias = torch.randn(experts, generator=g, device="cuda") * 0.1
    ids, weights = route_triton(logits, bias, *args)
    want_ids, want_weights = route_reference(logits, bias, *args)
    # Sigmoids may differ in their last bit between the kernel and torch: compare the chosen sets where a near-tie
    # could swap two neighbours, and the weights of the same experts.
    same = (ids == want_ids).all(dim=1)
    assert same.float().mean() > 0.99, f"{(~same).sum()} of {num_tokens} rows differ"
    torch.testing.assert_close(weights[same], want_weights[same], atol=1e-6, rtol=1e-5)


def test_the_kernel_replays_from_a_cuda_graph():
    experts, *args = ROUTERS["deepseek-v3"]
    logits = torch.randn(32, experts, device="cuda")
    bias = torch.randn(experts, device="cuda") * 0.1
    route_triton(logits, bias, *args)  # compiled before the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ids, weights = route_triton(logits, bias, *args)
    torch.cuda.current_stream().wait_stream(stream)
    logits.copy_(torch.randn(32, experts, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    want_ids, want_weights = route_reference(logits, bias, *args)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=1e-5)
