"""`specsplit serve drafter`: loads the MTP module (+ shared embedding and head), serves Propose."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specsplit.errors import UsageError
from specsplit.grpc_server import (
    ServerOptions,
    ServiceServer,
    add_service,
    announce,
    check_flag_ranges,
    freeze_start_up_heap,
    run_until_signal,
)
from specsplit.local_stream import serve_or_exit, socket_dir
from specsplit.models.serve_options import ModelOptions, add_model_arguments, apply_eager_option
from specsplit.models.start_up_checks import check_model_server, checkpoint_mistakes
from specsplit.placement import Placement, add_placement_arguments, resolve_placement
from specsplit.proto import common_pb2, drafter_pb2
from specsplit.security import load_tls
from specsplit.slow_steps import SlowStepWatch
from specsplit.threaded_stream import ThreadedLocalStreamServer

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory (with MTP weights)")
    add_model_arguments(p)
    add_placement_arguments(p)
    p.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="MTP KV cache blocks (default: on CUDA from --gpu-memory-utilization, which this overrides; on the "
        "CPU 1024); hold at least as many tokens as the verifier's cache, or requests past that go without drafts",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per MTP KV cache block")
    p.add_argument(
        "--draft-top-k",
        type=int,
        default=16,
        help="support of q for sampled drafts (temperature > 0): the K most likely tokens",
    )


@dataclass(frozen=True)
class DrafterConfig:
    """`specsplit serve drafter`'s options (`add_arguments`), checked, with the placement resolved for its
    device."""

    server: ServerOptions
    model: ModelOptions
    placement: Placement
    socket_dir: str | None  # None: a private directory under $TMPDIR
    num_blocks: int | None  # None: from --gpu-memory-utilization on CUDA, 1024 on the CPU
    block_size: int
    draft_top_k: int

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DrafterConfig:
        """The parsed command line; UsageError for a value out of range or a port taken."""
        config = cls(
            server=ServerOptions.from_args(args),
            model=ModelOptions.from_args(args),
            placement=resolve_placement(args.placement, args.device, args.hidden_transport),
            socket_dir=args.socket_dir,
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            draft_top_k=args.draft_top_k,
        )
        check_flag_ranges(config, num_blocks=(1, None), block_size=(1, None), draft_top_k=(1, None))
        return config


def _load_and_size(config: DrafterConfig, step_path: dict):
    """On the device's thread: the MTP module loaded, then its KV cache sized (`--num-blocks`, or on CUDA from
    `--gpu-memory-utilization`: room for one request of the model's context length at least) and its runner
    built on it. Returns (module, runner)."""
    import torch

    from specsplit.drafter.runner import DrafterRunner
    from specsplit.models.kv_cache_size import CPU_NUM_BLOCKS
    from specsplit.models.loader import load_mtp
    from specsplit.models.memory_profile import DeviceBaseline, device_memory_lock, size_kv_cache

    options = config.model
    on_cuda = torch.device(options.device).type == "cuda"
    num_blocks = config.num_blocks if config.num_blocks is not None or on_cuda else CPU_NUM_BLOCKS
    with device_memory_lock(config.socket_dir if on_cuda else None):
        baseline = DeviceBaseline.take(options.device) if on_cuda else None
        dtype = getattr(torch, options.dtype)
        mtp = load_mtp(options.checkpoint, dtype=dtype, device=options.device, load_format=options.load_format)
        _, runner, _ = size_kv_cache(
            lambda n: mtp.make_kv_cache(n, config.block_size),
            lambda cache: DrafterRunner(mtp, cache, config.draft_top_k, **step_path),
            block_size=config.block_size,
            num_blocks=num_blocks,
            fraction=options.gpu_memory_utilization,
            max_model_len=mtp.config.max_position_embeddings,
            baseline=baseline,
            max_model_len_flag=None,  # the model's context length: the drafter has no flag for it
        )
    return mtp, runner


async def serve(config: DrafterConfig, wrap_runner: Callable | None = None) -> None:
    """`wrap_runner(runner)`, when given, replaces the runner before serving (benchmarks only:
    `benchmarks/forced_drafter.py`)."""
    model_options, placement = config.model, config.placement
    check_model_server(model_options, drafter=True)  # before torch loads: a plain mistake is told at once

    from specsplit.drafter.servicer import DrafterServicer
    from specsplit.models.device import device_executor, use_device
    from specsplit.transport import make_receiver

    service = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name
    server = ServiceServer(
        "drafter",
        config.server.host,
        config.server.port,
        [service],
        tls=load_tls(config.server.tls_dir),
        require_client_cert=True,
        max_message_bytes=config.server.max_message_bytes,
    )
    # Loading, graph capture and transport set-up run on the loop's default executor: on the device too.
    use_device(model_options.device)
    asyncio.get_running_loop().set_default_executor(device_executor(model_options.device, 4, "model"))
    servicer = DrafterServicer(model_options.device, SlowStepWatch("drafter", model_options.slow_step_s))
    add_service(server.server, drafter_pb2.DESCRIPTOR.services_by_name["Drafter"], servicer)
    await server.start()  # health says NOT_SERVING until the weights are loaded
    socket_server, sockets = None, None
    if placement.drafter_rpc == "local":  # each connection's thread runs its Proposes itself
        sockets = socket_dir(config.socket_dir, "drafter")
        socket_server = ThreadedLocalStreamServer(
            sockets.path("drafter.sock"),
            drafter_pb2.ProposeRequest.FromString,
            servicer.handle_local_request,
            servicer.draining,
            config.server.max_message_bytes,
            name="propose-socket",
            thread_init=servicer.init_thread,
            thread_exit=servicer.connection_closed,
        )
    # Opened now: a bad path fails before minutes of loading.
    local = await serve_or_exit(socket_server, "--socket-dir", lambda: server.stop(0), sockets)
    step_path = apply_eager_option(model_options.eager)
    loop = asyncio.get_running_loop()
    try:
        with checkpoint_mistakes(model_options.checkpoint):
            mtp, runner = await loop.run_in_executor(  # graphs captured: seconds
                None, lambda: _load_and_size(config, step_path)
            )
    except UsageError:
        if local is not None:
            await local.close()
            sockets.remove()
        raise
    model_config = mtp.config
    info = common_pb2.ModelInfo(
        model=Path(model_options.checkpoint).resolve().name,
        architecture=model_config.architecture,
        vocab_size=model_config.vocab_size,
        max_model_len=model_config.max_position_embeddings,
        eos_token_ids=model_config.eos_token_ids,
        block_size=config.block_size,
        num_blocks=runner.kv_cache.num_blocks,
        dtype=model_options.dtype,
        hidden_size=model_config.hidden_size,
        hidden_transport=placement.hidden_transport,
        propose_socket=local.path if local else "",
    )
    servicer.ready(
        wrap_runner(runner) if wrap_runner else runner,
        info,
        make_receiver(placement.hidden_transport, model_options.device, model_config.hidden_size),
    )
    freeze_start_up_heap()
    await server.mark_serving()
    announce("drafter", server.address)
    log.info(
        "serving MTP of %s on %s (%s, hidden states by %s%s)",
        model_options.checkpoint,
        model_options.device,
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
        grace_s=config.server.shutdown_grace,
        delay_s=config.server.shutdown_delay,
        on_drain=servicer.drain,
    )
