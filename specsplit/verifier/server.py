"""`specsplit serve verifier`: loads the target, allocates its KV cache, serves Verify."""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from specsplit.client.errors import UsageError
from specsplit.proto import common_pb2, verifier_pb2
from specsplit.rpc.local_stream import LocalStreamServer, serve_or_exit, socket_dir
from specsplit.rpc.placement import Placement, add_placement_arguments, resolve_placement
from specsplit.rpc.process import end_with_parent
from specsplit.rpc.security import load_tls
from specsplit.rpc.server import (
    ServerOptions,
    ServiceServer,
    add_service,
    announce,
    check_flag_ranges,
    freeze_start_up_heap,
    run_until_signal,
)
from specsplit.runtime.serve_options import ModelOptions, add_model_arguments, apply_eager_option
from specsplit.runtime.slow_steps import SlowStepWatch
from specsplit.runtime.start_up_checks import check_model_server, check_tensor_parallel, checkpoint_mistakes
from specsplit.runtime.tensor_parallel import add_tensor_parallel_arguments

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
    p.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV cache blocks (default: on CUDA from --gpu-memory-utilization, which this overrides; on the CPU 1024)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's context length")
    p.add_argument("--drafter-timeout", type=float, default=30.0, help="seconds per Propose call")
    add_placement_arguments(p)
    add_tensor_parallel_arguments(p, "specsplit/verifier/ranks.py")
    t = p.add_argument_group("hidden-state transport (verifier → drafter)")
    t.add_argument(
        "--transport-address",
        default="127.0.0.1:0",
        help="nccl: HOST:PORT of the rendezvous this verifier hosts, as the drafter dials it (port 0: any free port)",
    )
    t.add_argument("--transport-timeout", type=float, default=30.0, help="nccl: seconds any transfer may wait")
    t.add_argument(
        "--transport-connect-timeout",
        type=float,
        default=300.0,
        help="seconds to wait at start-up for the drafter to open the transport (then the first Propose does)",
    )


@dataclass(frozen=True)
class VerifierConfig:
    """`specsplit serve verifier`'s options (`add_arguments`), checked, with the placement resolved for its
    device."""

    server: ServerOptions
    model: ModelOptions
    placement: Placement
    socket_dir: str | None  # None: a private directory under $TMPDIR
    drafter: str | None  # replicas, comma-separated; None: no speculation
    num_blocks: int | None  # None: from --gpu-memory-utilization on CUDA, 1024 on the CPU
    block_size: int
    max_model_len: int | None  # None: the model's context length
    drafter_timeout: float
    transport_address: str  # nccl: the rendezvous this verifier hosts
    transport_timeout: float
    transport_connect_timeout: float
    tensor_parallel_size: int = 1
    tensor_parallel_address: str = "127.0.0.1:0"
    tensor_parallel_timeout: float = 300.0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> VerifierConfig:
        """The parsed command line; UsageError for a value out of range or a port taken."""
        config = cls(
            server=ServerOptions.from_args(args),
            model=ModelOptions.from_args(args),
            placement=resolve_placement(args.placement, args.device, args.hidden_transport),
            socket_dir=args.socket_dir,
            drafter=args.drafter,
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            drafter_timeout=args.drafter_timeout,
            transport_address=args.transport_address,
            transport_timeout=args.transport_timeout,
            transport_connect_timeout=args.transport_connect_timeout,
            tensor_parallel_size=args.tensor_parallel_size,
            tensor_parallel_address=args.tensor_parallel_address,
            tensor_parallel_timeout=args.tensor_parallel_timeout,
        )
        check_flag_ranges(
            config,
            num_blocks=(1, None),
            block_size=(1, None),
            max_model_len=(1, None),
            drafter_timeout=(0, None),
            transport_timeout=(0, None),
            transport_connect_timeout=(0, None),
            tensor_parallel_size=(1, None),
            tensor_parallel_timeout=(0, None),
        )
        return config


def model_info(
    config: VerifierConfig, model_config, max_model_len: int, num_blocks: int, verify_socket: str = ""
) -> common_pb2.ModelInfo:
    """What GetModelInfo answers: the target `model_config` as this verifier serves it, with its KV cache's
    `num_blocks`."""
    return common_pb2.ModelInfo(
        model=Path(config.model.checkpoint).resolve().name,
        architecture=model_config.architecture,
        vocab_size=model_config.vocab_size,
        max_model_len=max_model_len,
        num_speculative_tokens=0,
        eos_token_ids=model_config.eos_token_ids,
        block_size=config.block_size,
        num_blocks=num_blocks,
        dtype=config.model.dtype,
        hidden_size=model_config.hidden_size,
        verify_socket=verify_socket,
    )


async def serve(config: VerifierConfig) -> None:
    end_with_parent()  # started by a LocalCluster: ends with it
    model_options, placement = config.model, config.placement
    check_model_server(model_options, drafter=False)  # before torch loads: a plain mistake is told at once
    check_tensor_parallel(model_options, config.tensor_parallel_size)
    import torch

    from specsplit.runtime.device import device_executor, use_device
    from specsplit.runtime.tensor_parallel import end_followers, start_followers
    from specsplit.transport import make_sender
    from specsplit.verifier.channels import make_channel
    from specsplit.verifier.drafter_channel import TransportConfigError
    from specsplit.verifier.loading import load_and_size
    from specsplit.verifier.ranks import follower_main
    from specsplit.verifier.servicer import VerifierServicer
    from specsplit.verifier.worker import VerifierWorker

    service = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
    tls = load_tls(config.server.tls_dir)
    server = ServiceServer(
        "verifier",
        config.server.host,
        config.server.port,
        [service],
        tls=tls,
        require_client_cert=True,
        max_message_bytes=config.server.max_message_bytes,
    )
    try:
        transport = make_sender(
            placement.hidden_transport,
            rendezvous=config.transport_address,
            timeout_s=config.transport_timeout,
            device_hand_off=placement.device_hand_off,
        )
        drafter = make_channel(
            config.drafter, config.drafter_timeout, tls=tls, rpc=placement.drafter_rpc, transport=transport
        )
    except ValueError as err:  # a --drafter target that is not HOST:PORT
        raise UsageError(str(err)) from err
    # Loading, graph capture and transport set-up run on the loop's default executor: on the device too.
    use_device(model_options.device)
    asyncio.get_running_loop().set_default_executor(device_executor(model_options.device, 4, "model"))
    servicer = VerifierServicer(drafter, model_options.device, SlowStepWatch("verifier", model_options.slow_step_s))
    add_service(server.server, verifier_pb2.DESCRIPTOR.services_by_name["Verifier"], servicer)
    await server.start()  # health says NOT_SERVING until the weights are loaded
    sockets = socket_dir(config.socket_dir, "verifier")
    # The event loop serves it, ending idle connections once the servicer drains.
    socket_server = LocalStreamServer(
        sockets.path("verifier.sock"),
        verifier_pb2.VerifyRequest.FromString,
        servicer.handle_stream_request,
        servicer.draining,
        config.server.max_message_bytes,
    )
    # Opened now: a bad path fails before minutes of loading.
    local = await serve_or_exit(socket_server, "--socket-dir", lambda: server.stop(0), sockets)
    step_path = apply_eager_option(model_options.eager)
    loop = asyncio.get_running_loop()
    followers = None
    if config.tensor_parallel_size > 1:

        async def close() -> None:
            await local.close()
            sockets.remove()

        try:
            followers = await start_followers(config, follower_main, server, close)
        except UsageError:
            await close()
            raise
    try:
        with checkpoint_mistakes(model_options.checkpoint):
            model, kv_cache, runner, max_model_len = await loop.run_in_executor(  # graphs captured: seconds
                None, lambda: load_and_size(config, step_path)
            )
    except UsageError:
        if followers is not None:
            followers.kill()
        await local.close()
        sockets.remove()
        raise
    model_config = model.config
    info = model_info(config, model_config, max_model_len, kv_cache.num_blocks, local.path)
    if config.drafter:
        try:
            dtype = getattr(torch, model_options.dtype)
            example = torch.zeros(1, model_config.hidden_size, dtype=dtype, device=model_options.device)
            await drafter.open_transport(example, config.transport_connect_timeout, info)
        except TransportConfigError:
            if followers is not None:
                followers.kill()
            await drafter.close()
            await local.close()
            sockets.remove()
            await server.stop(0)
            raise
    if followers is not None:
        from specsplit.models.parallel import wait_for_ranks

        await loop.run_in_executor(None, wait_for_ranks)  # every rank loaded and warmed up
    device = model_options.device
    worker = VerifierWorker(
        runner,
        vocab_size=info.vocab_size,
        max_model_len=max_model_len,
        device=device,
        tokenizer_dir=model_options.checkpoint,
    )
    servicer.ready(worker, info)
    freeze_start_up_heap()
    await server.mark_serving()
    announce("verifier", server.address)
    if followers is not None:
        log.info("tensor parallel: %d ranks, from %s on", config.tensor_parallel_size, model_options.device)
    log.info(
        "serving %s (%s) on %s, KV cache %d blocks x %d tokens, drafter %s (hidden states by %s), VerifyStream "
        "also on %s",
        model_options.checkpoint,
        model_config.architecture,
        model_options.device,
        kv_cache.num_blocks,
        config.block_size,
        placement.name,
        placement.hidden_transport,
        local.path,
    )

    async def on_stop() -> None:
        await local.close()
        sockets.remove()
        await drafter.close()
        if followers is not None:
            await loop.run_in_executor(None, end_followers)
            followers.stop()

    await run_until_signal(
        server,
        on_stop,
        grace_s=config.server.shutdown_grace,
        delay_s=config.server.shutdown_delay,
        on_drain=servicer.drain,
    )
