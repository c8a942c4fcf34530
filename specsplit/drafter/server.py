"""`specsplit serve drafter`: loads the MTP module (+ shared embedding and head), serves Propose."""

from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
from dataclasses import dataclass
from pathlib import Path

from specsplit.client.errors import UsageError
from specsplit.proto import common_pb2, drafter_pb2
from specsplit.rpc.local_stream import serve_if_possible, serve_or_exit, socket_dir
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
from specsplit.rpc.threaded_stream import ThreadedLocalStreamServer
from specsplit.runtime.serve_options import ModelOptions, add_model_arguments, apply_eager_option
from specsplit.runtime.slow_steps import SlowStepWatch
from specsplit.runtime.start_up_checks import check_model_server, check_tensor_parallel, checkpoint_mistakes
from specsplit.runtime.tensor_parallel import add_tensor_parallel_arguments

log = logging.getLogger(__name__)

# The draft vocabulary's ids (`--draft-vocab-size`; 0: every id), chosen from docs/performance.md, "Draft vocabulary".
DEFAULT_DRAFT_VOCAB_SIZE = 0


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
    p.add_argument(
        "--draft-vocab-size",
        type=int,
        default=None,
        help="ids the MTP head projects onto, chosen by how often the drafter sees them (0 or at least the "
        f"vocabulary: every id; default {DEFAULT_DRAFT_VOCAB_SIZE or 'every id'}, every id with tensor-parallel "
        "ranks; specsplit/drafter/draft_vocab.py)",
    )
    p.add_argument(
        "--draft-vocab-file",
        default=None,
        help="token ids that seed the draft vocabulary, most frequent first (whitespace-separated or a JSON list); "
        "before the checkpoint tokenizer's merge order",
    )
    add_tensor_parallel_arguments(p, "specsplit/drafter/ranks.py")


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
    draft_vocab_size: int = DEFAULT_DRAFT_VOCAB_SIZE
    draft_vocab_file: str | None = None
    tensor_parallel_size: int = 1
    tensor_parallel_address: str = "127.0.0.1:0"
    tensor_parallel_timeout: float = 300.0

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
            draft_vocab_size=resolve_draft_vocab_size(args.draft_vocab_size, args.tensor_parallel_size),
            draft_vocab_file=args.draft_vocab_file,
            tensor_parallel_size=args.tensor_parallel_size,
            tensor_parallel_address=args.tensor_parallel_address,
            tensor_parallel_timeout=args.tensor_parallel_timeout,
        )
        check_flag_ranges(
            config,
            num_blocks=(1, None),
            block_size=(1, None),
            draft_top_k=(1, None),
            draft_vocab_size=(0, None),
            tensor_parallel_size=(1, None),
            tensor_parallel_timeout=(0, None),
        )
        return config


def resolve_draft_vocab_size(asked: int | None, tensor_parallel_size: int) -> int:
    """`--draft-vocab-size`, or its default: every id for a tensor-parallel drafter, whose head is split by
    vocabulary rows (asking for one there is refused)."""
    if tensor_parallel_size == 1:
        return DEFAULT_DRAFT_VOCAB_SIZE if asked is None else asked
    if asked:
        raise UsageError("--draft-vocab-size needs --tensor-parallel-size 1 (the head is split by vocabulary rows)")
    return 0


async def serve(config: DrafterConfig) -> None:
    end_with_parent()  # started by a LocalCluster: ends with it
    model_options, placement = config.model, config.placement
    check_model_server(model_options, drafter=True)  # before torch loads: a plain mistake is told at once
    check_tensor_parallel(model_options, config.tensor_parallel_size)

    from specsplit.drafter.loading import load_and_size
    from specsplit.drafter.ranks import follower_main
    from specsplit.drafter.servicer import DrafterServicer
    from specsplit.runtime.device import device_executor, use_device
    from specsplit.runtime.tensor_parallel import end_followers, start_followers
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
    # ProposeStream also on a Unix socket, each connection's thread running its Proposes itself: a co-located
    # verifier's control path, and a pooled one's wherever the socket is on its host (`PoolChannel`). Pooled, the
    # file is named for this process alone: a verifier takes it where the path exists on its host, and another pod's
    # same-named file must not pass for it.
    sockets = socket_dir(config.socket_dir, "drafter")
    name = "drafter.sock" if placement.drafter_rpc == "local" else f"drafter-{secrets.token_hex(6)}.sock"
    socket_server = ThreadedLocalStreamServer(
        sockets.path(name),
        drafter_pb2.ProposeRequest.FromString,
        servicer.handle_local_request,
        servicer.draining,
        config.server.max_message_bytes,
        name="propose-socket",
        thread_init=servicer.init_thread,
        thread_exit=servicer.connection_closed,
    )
    # Opened now: a bad path fails before minutes of loading (co-located; pooled, gRPC's stream serves without it).
    if placement.drafter_rpc == "local":
        local = await serve_or_exit(socket_server, "--socket-dir", lambda: server.stop(0), sockets)
    else:
        local = await serve_if_possible(socket_server, sockets)
    step_path = apply_eager_option(model_options.eager)
    loop = asyncio.get_running_loop()

    async def close() -> None:
        if local is not None:
            await local.close()
            sockets.remove()

    followers = None
    try:
        if config.tensor_parallel_size > 1:
            followers = await start_followers(config, follower_main, server, close)
        with checkpoint_mistakes(model_options.checkpoint):
            mtp, runner = await loop.run_in_executor(  # graphs captured: seconds
                None, lambda: load_and_size(config, step_path)
            )
    except UsageError:
        if followers is not None:
            followers.kill()
        await close()
        raise
    if followers is not None:
        from specsplit.models.parallel import wait_for_ranks

        await loop.run_in_executor(None, wait_for_ranks)  # every rank loaded and warmed up
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
        runner, info, make_receiver(placement.hidden_transport, model_options.device, model_config.hidden_size)
    )
    freeze_start_up_heap()
    await server.mark_serving()
    announce("drafter", server.address)
    log.info(
        "serving MTP of %s on %s%s (%s, hidden states by %s%s)",
        model_options.checkpoint,
        model_options.device,
        f" (rank 0 of {config.tensor_parallel_size})" if followers is not None else "",
        placement.name,
        placement.hidden_transport,
        f", ProposeStream also on {info.propose_socket}" if local else "",
    )

    async def on_stop() -> None:
        await close()
        if followers is not None:  # once no Propose runs: the followers' last call
            await loop.run_in_executor(None, servicer.locked, end_followers)
            followers.stop()

    await run_until_signal(
        server,
        on_stop,
        grace_s=config.server.shutdown_grace,
        delay_s=config.server.shutdown_delay,
        on_drain=servicer.drain,
    )
