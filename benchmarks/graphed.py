"""Benchmark helper: a call on fixed input tensors, captured once in a CUDA graph and replayed.

This is how a sampler runs inside a CUDA-graphed engine step (inputs in static buffers), and it takes
Python and launch overhead out of the measurement, for our sampler and vLLM's alike.
"""

from collections.abc import Callable

import torch


def captured(fn: Callable[[], object], warmup: int = 2) -> Callable[[], object]:
    """Runs ``fn`` ``warmup`` times on a side stream (compiles kernels, allocates workspaces), then
    captures one call; the returned function replays it and returns the captured call's outputs."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay() -> object:
        graph.replay()
        return out

    return replay
