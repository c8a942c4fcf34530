"""Command-line options both model servers (verifier and drafter) take: where and in what dtype the
weights live, how they load, and the one switch that runs their steps on torch ops alone; and their
typed form, `ModelOptions`. Torch-free until `apply_eager_option`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from specsplit.runtime.slow_steps import DEFAULT_SLOW_STEP_S


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    p.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="auto: the checkpoint's safetensors; dummy: seeded random weights from config.json (benchmarks)",
    )
    p.add_argument(
        "--eager",
        action="store_true",
        help="torch ops only: SDPA attention, no CUDA graphs, no Triton layer kernels or GEMV, the rejection "
        "sampler's torch reference (an escape hatch; by default on CUDA the Triton kernels and graphs run)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=_fraction,
        default=None,
        help="CUDA: the fraction of the device's memory this server may use (weights, CUDA graphs, workspace "
        "and the KV cache, which gets the rest); default 0.9; two servers on one device need shares that add "
        "up below 1. Not on --device cpu. --num-blocks overrides it",
    )
    p.add_argument(
        "--slow-step-s",
        type=_seconds,
        default=DEFAULT_SLOW_STEP_S,
        help="log the Python stack of a model step (verifier: forward + sampling; drafter: a Propose) still "
        "running after this many seconds, and count it in specsplit.slow_steps (0: off)",
    )


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also NaN
        raise argparse.ArgumentTypeError(f"must be >= 0 (0: off), got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:  # also NaN
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1], got {text}")
    return value


@dataclass(frozen=True)
class ModelOptions:
    """`--model` and `add_model_arguments`' values."""

    checkpoint: str  # --model: the checkpoint directory
    device: str
    dtype: str
    load_format: str  # auto: the checkpoint's safetensors; dummy: seeded random weights
    eager: bool
    slow_step_s: float  # 0: off
    gpu_memory_utilization: float | None = None  # CUDA: the device's share this server may use; None: 0.9

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ModelOptions:
        return cls(
            checkpoint=args.model,
            device=args.device,
            dtype=args.dtype,
            load_format=args.load_format,
            eager=args.eager,
            slow_step_s=args.slow_step_s,
            gpu_memory_utilization=args.gpu_memory_utilization,
        )


def apply_eager_option(eager: bool) -> dict[str, bool | None]:
    """--eager → specsplit.models.layer_ops (imported here: it needs torch), and the runners' keyword
    arguments `attention_kernel` and `cuda_graphs` (None: decided by the device)."""
    from specsplit.models.layer_ops import enable_gemv, enable_layer_kernels

    enable_layer_kernels(not eager)
    enable_gemv(False if eager else None)
    off = False if eager else None
    return {"attention_kernel": off, "cuda_graphs": off}
