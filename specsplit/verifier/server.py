"""`specsplit serve verifier`: loads the target, allocates its KV cache, serves Verify."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path

from specsplit.grpc_server import ServiceServer, add_service, announce, freeze_start_up_heap, run_until_signal
from specsplit.local_stream import DRAFTER_RPCS, LocalStreamServer, serve_or_exit
from specsplit.models.serve_options import add_model_arguments, apply_eager_option
from specsplit.proto import common_pb2, verifier_pb2
from specsplit.security import load_tls
from specsplit.slow_steps import SlowStepWatch
from specsplit.transport import TRANSPORTS

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
    p.add_argument(
        "--drafter-rpc",
        default="stream",
        choices=DRAFTER_RPCS,
        help="stream: one persistent ProposeStream per drafter replica; "
        "local: the ProposeStream on the Unix socket a drafter on this host serves (its --propose-socket), "
        "without gRPC: the fastest control path for co-located services",
    )
    p.add_argument(
        "--verify-socket",
        default=None,
        metavar="PATH",
        help="also serve VerifyStream on this Unix socket, without gRPC, for a coordinator on this host started "
        "with --verifier-rpc local (the socket is created 0600)",
    )
    t = p.add_argument_group("hidden-state transport (verifier → drafter)")
    t.add_argument(
        "--hidden-transport",
        default="grpc",
        choices=TRANSPORTS,
        help="grpc: bytes inside Propose (any placement, several replicas); cuda_ipc: a GPU buffer ring shared "
        "with one drafter on this host; nccl: torch.distributed send to one drafter (same host or RDMA)",
    )
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
        "--device-hand-off",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="cuda_ipc to a drafter on this GPU: greedy decode steps send their Propose as soon as the step is "
        "queued, and the drafter's device waits for the sampled tokens (--no-device-hand-off: the verifier "
        "waits for them on the host first)",
    )
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
    try:
        transport = make_sender(
            args.hidden_transport,
            rendezvous=args.transport_address,
            backend=None if args.transport_backend == "auto" else args.transport_backend,
            timeout_s=args.transport_timeout,
            num_slots=args.transport_slots,
            device_hand_off=args.device_hand_off,
        )
        drafter = DrafterClient(args.drafter, args.drafter_timeout, tls=tls, rpc=args.drafter_rpc, transport=transport)
    except (TransportConfigError, ValueError) as err:
        log.error("%s", err)
        raise SystemExit(2) from err
    # Loading, graph capture and transport set-up run on the loop's default executor: on the device too.
    use_device(args.device)
    asyncio.get_running_loop().set_default_executor(device_executor(args.device, 4, "model"))
    servicer = VerifierServicer(drafter, args.device, SlowStepWatch("verifier", args.slow_step_s))
    add_service(server.server, verifier_pb2.DESCRIPTOR.services_by_name["Verifier"], servicer)
    await server.start()  # health says NOT_SERVING until the weights are loaded
    socket_server = None
    if args.verify_socket:  # the event loop serves it, ending idle connections once the servicer drains
        socket_server = LocalStreamServer(
            os.path.abspath(args.verify_socket),
            verifier_pb2.VerifyRequest.FromString,
            servicer.handle_stream_request,
            servicer.draining,
            args.max_message_mb * 2**20,
        )
    # Opened now: a bad path fails before minutes of loading.
    local = await serve_or_exit(socket_server, "--verify-socket", lambda: server.stop(0))
    dtype = getattr(torch, args.dtype)
    step_path = apply_eager_option(args)
    loop = asyncio.get_running_loop()
    model = await loop.run_in_executor(
        None, lambda: load_target(args.model, dtype=dtype, device=args.device, load_format=args.load_format)
    )
    config = model.config
    kv_cache = model.make_kv_cache(args.num_blocks, args.block_size)
    max_model_len = min(
        config.max_position_embeddings,
        args.max_model_len or config.max_position_embeddings,
        args.num_blocks * args.block_size,
    )
    if args.drafter:
        try:
            example = torch.zeros(1, config.hidden_size, dtype=dtype, device=args.device)
            await drafter.open_transport(example, args.transport_connect_timeout)
        except TransportConfigError as err:
            log.error("%s", err)
            await drafter.close()
            if local is not None:
                await local.close()
            await server.stop(0)
            raise SystemExit(2) from err
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
    servicer.ready(runner, model_info(args.model, config, args, max_model_len, local.path if local else ""))
    freeze_start_up_heap()
    await server.mark_serving()
    announce("verifier", server.address)
    log.info(
        "serving %s (%s) on %s, KV cache %d blocks x %d tokens, hidden transport %s",
        args.model,
        config.architecture,
        args.device,
        args.num_blocks,
        args.block_size,
        args.hidden_transport,
    )

    async def on_stop() -> None:
        if local is not None:
            await local.close()
        await drafter.close()

    await run_until_signal(
        server, on_stop, grace_s=args.shutdown_grace, delay_s=args.shutdown_delay, on_drain=servicer.drain
    )
