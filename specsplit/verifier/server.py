"""`specsplit serve verifier`: loads the target, allocates its KV cache, serves Verify."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from specsplit.errors import UsageError
from specsplit.grpc_server import (
    ServiceServer,
    add_service,
    announce,
    check_flag_ranges,
    freeze_start_up_heap,
    run_until_signal,
)
from specsplit.local_stream import LocalStreamServer, serve_or_exit, socket_dir
from specsplit.models.serve_options import add_model_arguments, apply_eager_option
from specsplit.models.start_up_checks import check_model_server, checkpoint_mistakes
from specsplit.placement import add_placement_arguments, placement_of
from specsplit.proto import common_pb2, verifier_pb2
from specsplit.security import load_tls
from specsplit.slow_steps import SlowStepWatch

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument(
        "--drafter",
        default=None,
        help="drafter replicas: comma-separated HOST:PORT and/or dns:///NAME:PORT (re-resolved every 5 s); "
        "none: no speculation",
    )
    add_model_arguments(p)
    p.add_argument("--num-blocks", type=int, default=1024, help="KV cache blocks")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's context length")
    p.add_argument("--drafter-timeout", type=float, default=30.0, help="seconds per Propose call")
    add_placement_arguments(p)
    t = p.add_argument_group("hidden-state transport (verifier → drafter)")
    t.add_argument(
        "--transport-address",
        default="127.0.0.1:0",
        help="nccl: HOST:PORT of the rendezvous this verifier hosts, as the drafter dials it (port 0: any free port)",
    )
    t.add_argument(
        "--transport-backend",
        default="auto",
        choices=["auto", "nccl", "gloo"],
        help="nccl: torch.distributed backend (auto: nccl on CUDA, gloo on CPU)",
    )
    t.add_argument("--transport-timeout", type=float, default=30.0, help="nccl: seconds any transfer may wait")
    t.add_argument("--transport-slots", type=int, default=4, help="cuda_ipc: buffers in the ring")
    t.add_argument(
        "--transport-connect-timeout",
        type=float,
        default=300.0,
        help="seconds to wait at start-up for the drafter to open the transport (then the first Propose does)",
    )


def model_info(
    model_dir: str, config, args: argparse.Namespace, max_model_len: int, verify_socket: str = ""
) -> common_pb2.ModelInfo:
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
        verify_socket=verify_socket,
    )


async def serve(args: argparse.Namespace) -> None:
    check_model_server(args, drafter=False)  # before torch loads: a plain mistake is told at once
    check_flag_ranges(
        args,
        max_model_len=(1, None),
        drafter_timeout=(0, None),
        transport_timeout=(0, None),
        transport_slots=(1, None),
        transport_connect_timeout=(0, None),
    )
    import torch

    from specsplit.models.device import device_executor, use_device
    from specsplit.models.loader import load_target
    from specsplit.transport import make_sender
    from specsplit.verifier.drafter_client import DrafterClient, TransportConfigError
    from specsplit.verifier.runner import VerifierRunner
    from specsplit.verifier.servicer import VerifierServicer

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
    placement = placement_of(args, args.device)
    try:
        transport = make_sender(
            placement.hidden_transport,
            rendezvous=args.transport_address,
            backend=None if args.transport_backend == "auto" else args.transport_backend,
            timeout_s=args.transport_timeout,
            num_slots=args.transport_slots,
            device_hand_off=placement.device_hand_off,
        )
        drafter = DrafterClient(
            args.drafter, args.drafter_timeout, tls=tls, rpc=placement.drafter_rpc, transport=transport
        )
    except ValueError as err:  # a --drafter target that is not HOST:PORT
        raise UsageError(str(err)) from err
    # Loading, graph capture and transport set-up run on the loop's default executor: on the device too.
    use_device(args.device)
    asyncio.get_running_loop().set_default_executor(device_executor(args.device, 4, "model"))
    servicer = VerifierServicer(drafter, args.device, SlowStepWatch("verifier", args.slow_step_s))
    add_service(server.server, verifier_pb2.DESCRIPTOR.services_by_name["Verifier"], servicer)
    await server.start()  # health says NOT_SERVING until the weights are loaded
    sockets = socket_dir(args.socket_dir, "verifier")
    # The event loop serves it, ending idle connections once the servicer drains.
    socket_server = LocalStreamServer(
        sockets.path("verifier.sock"),
        verifier_pb2.VerifyRequest.FromString,
        servicer.handle_stream_request,
        servicer.draining,
        args.max_message_mb * 2**20,
    )
    # Opened now: a bad path fails before minutes of loading.
    local = await serve_or_exit(socket_server, "--socket-dir", lambda: server.stop(0), sockets)
    dtype = getattr(torch, args.dtype)
    step_path = apply_eager_option(args)
    loop = asyncio.get_running_loop()
    try:
        with checkpoint_mistakes(args.model):
            model = await loop.run_in_executor(
                None, lambda: load_target(args.model, dtype=dtype, device=args.device, load_format=args.load_format)
            )
    except UsageError:
        await local.close()
        sockets.remove()
        raise
    config = model.config
    kv_cache = model.make_kv_cache(args.num_blocks, args.block_size)
    max_model_len = min(
        config.max_position_embeddings,
        args.max_model_len or config.max_position_embeddings,
        args.num_blocks * args.block_size,
    )
    info = model_info(args.model, config, args, max_model_len, local.path)
    if args.drafter:
        try:
            example = torch.zeros(1, config.hidden_size, dtype=dtype, device=args.device)
            await drafter.open_transport(example, args.transport_connect_timeout, info)
        except TransportConfigError:
            await drafter.close()
            await local.close()
            sockets.remove()
            await server.stop(0)
            raise
    runner = await loop.run_in_executor(  # captures the CUDA graphs: seconds
        None,
        lambda: VerifierRunner(
            model,
            kv_cache,
            "reference" if args.eager else "auto",
            **step_path,
            max_model_len=max_model_len,
        ),
    )
    servicer.ready(runner, info)
    freeze_start_up_heap()
    await server.mark_serving()
    announce("verifier", server.address)
    log.info(
        "serving %s (%s) on %s, KV cache %d blocks x %d tokens, drafter %s (hidden states by %s), VerifyStream "
        "also on %s",
        args.model,
        config.architecture,
        args.device,
        args.num_blocks,
        args.block_size,
        placement.name,
        placement.hidden_transport,
        local.path,
    )

    async def on_stop() -> None:
        await local.close()
        sockets.remove()
        await drafter.close()

    await run_until_signal(
        server, on_stop, grace_s=args.shutdown_grace, delay_s=args.shutdown_delay, on_drain=servicer.drain
    )
