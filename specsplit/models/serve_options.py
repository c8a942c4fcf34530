"""Command-line options both model servers (verifier and drafter) take: where and in what dtype the
weights live, how they load, and how decode / verify / draft steps run. argparse only."""

from __future__ import annotations

import argparse

from specsplit.slow_steps import DEFAULT_SLOW_STEP_S


def add_model_arguments(p: argparse.ArgumentParser, steps: str) -> None:
    """``steps``: what the attention and graph options apply to, for the help text."""
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    p.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="auto: the checkpoint's safetensors; dummy: seeded random weights from config.json (benchmarks)",
    )
    p.add_argument(
        "--attention",
        default="auto",
        choices=["auto", "torch", "triton"],
        help=f"{steps} attention: the Triton paged kernel or per-request SDPA (auto: Triton on CUDA)",
    )
    p.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help=f"run {steps} eagerly (CUDA graphs are on by default on CUDA with the Triton attention)",
    )
    p.add_argument(
        "--slow-step-s",
        type=_seconds,
        default=DEFAULT_SLOW_STEP_S,
        help="log the Python stack of a model step (verifier: forward + sampling; drafter: a Propose) still "
        "running after this many seconds, and count it in specsplit.slow_steps (0: off)",
    )
    add_kernel_arguments(p)


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also NaN
        raise argparse.ArgumentTypeError(f"must be >= 0 (0: off), got {text}")
    return value


def add_kernel_arguments(p: argparse.ArgumentParser) -> None:
    """--[no-]layer-kernels and --[no-]gemv (also benchmarks/decode_step.py's); `apply_layer_kernels_option`."""
    p.add_argument(
        "--layer-kernels",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Triton kernels for residual-add + RMSNorm, rotary and silu-mul on CUDA (--no-layer-kernels: torch ops)",
    )
    p.add_argument(
        "--gemv",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Triton GEMV for the linears of steps of <= 32 tokens on CUDA: by default for the shapes measured "
        "faster than cuBLAS (specsplit/kernels/gemv_configs.py); --gemv: every shape; --no-gemv: cuBLAS",
    )


def attention_kernel_option(args: argparse.Namespace) -> bool | None:
    """--attention → the runners' `attention_kernel` (None: decided by the device)."""
    return {"auto": None, "torch": False, "triton": True}[args.attention]


def apply_layer_kernels_option(args: argparse.Namespace) -> None:
    """--[no-]layer-kernels and --[no-]gemv → specsplit.models.layer_ops (imported here: it needs torch)."""
    from specsplit.models.layer_ops import enable_gemv, enable_layer_kernels

    enable_layer_kernels(args.layer_kernels)
    enable_gemv(args.gemv)


def cuda_graphs_option(args: argparse.Namespace) -> bool | None:
    """--no-cuda-graphs → the runners' `cuda_graphs` (None: decided by the device and the kernel)."""
    return None if args.cuda_graphs else False
