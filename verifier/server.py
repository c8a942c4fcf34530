"""`specsplit serve verifier`: loads the target, allocates its KV cache, serves Verify."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from protos import common_pb2, verifier_pb2
from specsplit.grpc_server import ServiceServer, add_service, announce, run_until_signal
from specsplit.security import load_tls

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument(
        "--drafter",
        default=None,
        help="drafter replicas: comma-separated HOST:PORT and/or dns:///NAME:PORT (re-resolved every 5 s); "
        "none: no speculation",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    p.add_argument("--num-blocks", type=int, default=1024, help="KV cache blocks")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's context length")
    p.add_argument("--sampler", default="auto", choices=["auto", "reference", "triton"])
    p.add_argument("--drafter-timeout", type=float, default=30.0, help="seconds per Propose call")
    p.add_argument(
        "--attention",
        default="auto",
        choices=["auto", "torch", "triton"],
        help="decode/verify attention: the Triton paged kernel or per-request SDPA (auto: Triton on CUDA)",
    )
    p.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="run decode/verify steps eagerly (CUDA graphs are on by default on CUDA with the Triton attention)",
    )


def attention_kernel_option(choice: str) -> bool | None:
    """--attention → the runners' `attention_kernel` (None: decided by the device)."""
    return {"auto": None, "torch": False, "triton": True}[choice]


def model_info(model_dir: str, config, args: argparse.Namespace, max_model_len: int) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(
        model=Path(model_dir).resolve().name,
        architecture=config.architecture,
        vocab_size=config.vocab_size,
        max_model_len=max_model_len,
        num_speculative_tokens=0,
        eos_token_ids=config.eos_token_ids,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        dtype=args.dtype,
        hidden_size=config.hidden_size,
    )


async def serve(args: argparse.Namespace) -> None:
    import torch

    from models.loader import load_target
    from verifier.drafter_client import DrafterClient
    from verifier.runner import VerifierRunner
    from verifier.servicer import VerifierServicer

    service = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
    tls = load_tls(args.tls_dir)
    server = ServiceServer(
        "verifier",
        args.host,
        args.port,
        [service],
        tls=tls,
        require_client_cert=True,
        max_message_bytes=args.max_message_mb * 2**20,
    )
    drafter = DrafterClient(args.drafter, args.drafter_timeout, tls=tls)
    servicer = VerifierServicer(drafter, args.device)
    add_service(server.server, verifier_pb2.DESCRIPTOR.services_by_name["Verifier"], servicer)
    await server.start()  # health says NOT_SERVING until the weights are loaded
    dtype = getattr(torch, args.dtype)
    loop = asyncio.get_running_loop()
    model = await loop.run_in_executor(None, lambda: load_target(args.model, dtype=dtype, device=args.device))
    config = model.config
    kv_cache = model.make_kv_cache(args.num_blocks, args.block_size)
    max_model_len = min(
        config.max_position_embeddings,
        args.max_model_len or config.max_position_embeddings,
        args.num_blocks * args.block_size,
    )
    runner = await loop.run_in_executor(  # captures the CUDA graphs: seconds
        None,
        lambda: VerifierRunner(
            model,
            kv_cache,
            args.sampler,
            attention_kernel=attention_kernel_option(args.attention),
            cuda_graphs=None if args.cuda_graphs else False,
            max_model_len=max_model_len,
        ),
    )
    servicer.ready(runner, model_info(args.model, config, args, max_model_len))
    await server.mark_serving()
    announce("verifier", server.address)
    log.info(
        "serving %s (%s) on %s, KV cache %d blocks x %d tokens",
        args.model,
        config.architecture,
        args.device,
        args.num_blocks,
        args.block_size,
    )
    await run_until_signal(
        server, drafter.close, grace_s=args.shutdown_grace, delay_s=args.shutdown_delay, on_drain=servicer.drain
    )
