"""`specsplit serve drafter`: loads the MTP module (+ shared embedding and head), serves Propose."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable
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
from specsplit.local_stream import serve_or_exit, socket_dir
from specsplit.models.serve_options import add_model_arguments, apply_eager_option
from specsplit.models.start_up_checks import check_model_server, checkpoint_mistakes
from specsplit.placement import add_placement_arguments, placement_of
from specsplit.proto import common_pb2, drafter_pb2
from specsplit.security import load_tls
from specsplit.slow_steps import SlowStepWatch
from specsplit.threaded_stream import ThreadedLocalStreamServer

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory (with MTP weights)")
    add_model_arguments(p)
    add_placement_arguments(p)
    p.add_argument("--num-blocks", type=int, default=1024, help="MTP KV cache blocks")
    p.add_argument("--block-size", type=int, default=16, help="tokens per MTP KV cache block")
    p.add_argument(
        "--draft-top-k",
        type=int,
        default=16,
        help="support of q for sampled drafts (temperature > 0): the K most likely tokens",
    )


async def serve(args: argparse.Namespace, wrap_runner: Callable | None = None) -> None:
    """`wrap_runner(runner)`, when given, replaces the runner before serving (benchmarks only:
    `benchmarks/forced_drafter.py`)."""
    check_model_server(args, drafter=True)  # before torch loads: a plain mistake is told at once
    check_flag_ranges(args, draft_top_k=(1, None))
    import torch

    from specsplit.drafter.runner import DrafterRunner
    from specsplit.drafter.servicer import DrafterServicer
    from specsplit.models.device import device_executor, use_device
    from specsplit.models.loader import load_mtp
    from specsplit.transport import make_receiver

    service = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name
    server = ServiceServer(
        "drafter",
        args.host,
        args.port,
        [service],
        tls=load_tls(args.tls_dir),
        require_client_cert=True,
        max_message_bytes=args.max_message_mb * 2**20,
    )
    # Loading, graph capture and transport set-up run on the loop's default executor: on the device too.
    use_device(args.device)
    asyncio.get_running_loop().set_default_executor(device_executor(args.device, 4, "model"))
    servicer = DrafterServicer(args.device, SlowStepWatch("drafter", args.slow_step_s))
    add_service(server.server, drafter_pb2.DESCRIPTOR.services_by_name["Drafter"], servicer)
    await server.start()  # health says NOT_SERVING until the weights are loaded
    placement = placement_of(args, args.device)
    socket_server, sockets = None, None
    if placement.drafter_rpc == "local":  # each connection's thread runs its Proposes itself
        sockets = socket_dir(args.socket_dir, "drafter")
        socket_server = ThreadedLocalStreamServer(
            sockets.path("drafter.sock"),
            drafter_pb2.ProposeRequest.FromString,
            servicer.handle_local_request,
            servicer.draining,
            args.max_message_mb * 2**20,
            name="propose-socket",
            thread_init=servicer.init_thread,
        )
    # Opened now: a bad path fails before minutes of loading.
    local = await serve_or_exit(socket_server, "--socket-dir", lambda: server.stop(0), sockets)
    dtype = getattr(torch, args.dtype)
    step_path = apply_eager_option(args)
    loop = asyncio.get_running_loop()
    try:
        with checkpoint_mistakes(args.model):
            mtp = await loop.run_in_executor(
                None, lambda: load_mtp(args.model, dtype=dtype, device=args.device, load_format=args.load_format)
            )
    except UsageError:
        if local is not None:
            await local.close()
            sockets.remove()
        raise
    config = mtp.config
    info = common_pb2.ModelInfo(
        model=Path(args.model).resolve().name,
        architecture=config.architecture,
        vocab_size=config.vocab_size,
        max_model_len=config.max_position_embeddings,
        eos_token_ids=config.eos_token_ids,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        dtype=args.dtype,
        hidden_size=config.hidden_size,
        hidden_transport=placement.hidden_transport,
        propose_socket=local.path if local else "",
    )
    cache = mtp.make_kv_cache(args.num_blocks, args.block_size)
    runner = await loop.run_in_executor(  # captures the CUDA graphs: seconds
        None,
        lambda: DrafterRunner(
            mtp,
            cache,
            args.draft_top_k,
            **step_path,
        ),
    )
    servicer.ready(
        wrap_runner(runner) if wrap_runner else runner,
        info,
        make_receiver(placement.hidden_transport, args.device, config.hidden_size),
    )
    freeze_start_up_heap()
    await server.mark_serving()
    announce("drafter", server.address)
    log.info(
        "serving MTP of %s on %s (%s, hidden states by %s%s)",
        args.model,
        args.device,
        placement.name,
        placement.hidden_transport,
        f", ProposeStream also on {info.propose_socket}" if local else "",
    )

    async def on_stop() -> None:
        if local is not None:
            await local.close()
            sockets.remove()

    await run_until_signal(
        server,
        on_stop,
        grace_s=args.shutdown_grace,
        delay_s=args.shutdown_delay,
        on_drain=servicer.drain,
    )
