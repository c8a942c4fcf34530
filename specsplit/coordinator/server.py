"""`specsplit serve coordinator`: loads the tokenizer, waits for the verifier, serves clients."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from dataclasses import dataclass

import grpc

from specsplit.client.errors import UsageError
from specsplit.coordinator.config import MAX_SPECULATIVE_TOKENS, SchedulerConfig
from specsplit.coordinator.engine import Engine
from specsplit.coordinator.generation_config import GRPC_DEFAULTS, OPENAI_DEFAULTS
from specsplit.coordinator.scheduler import Scheduler
from specsplit.coordinator.servicer import CoordinatorServicer
from specsplit.coordinator.verify_stream import RpcVerifier
from specsplit.coordinator.vllm_metrics import set_model_name
from specsplit.proto import common_pb2, coordinator_pb2, verifier_pb2_grpc
from specsplit.rpc.local_stream import VERIFIER_RPCS
from specsplit.rpc.process import end_with_parent
from specsplit.rpc.security import BearerTokenInterceptor, load_tls, load_tokens
from specsplit.rpc.server import (
    ServerOptions,
    ServiceServer,
    add_service,
    announce,
    check_can_listen,
    check_flag_ranges,
    freeze_start_up_heap,
    peer_channel,
    run_until_signal,
)

log = logging.getLogger(__name__)


def add_scheduling_arguments(p: argparse.ArgumentParser) -> None:
    """The scheduler's flags; `specsplit up` takes them too and passes them on (`scheduling_flags`)."""
    p.add_argument("--max-num-seqs", type=int, default=16, help="requests decoded together")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument(
        "--adaptive",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="adaptive speculation: each request's draft count chosen per iteration, up to --num-speculative-tokens, "
        "from its acceptance and the measured step times (default: off, every request gets that many drafts each "
        "iteration: through the services a fixed k measured better; docs/performance.md, 'Adaptive speculation')",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of full blocks a prompt shares with earlier requests, in the verifier's target KV and the "
        "drafter's MTP KV (default: on; --no-enable-prefix-caching computes every prompt from scratch)",
    )


def scheduling_flags(
    max_num_seqs: int, max_num_batched_tokens: int, adaptive: bool = False, enable_prefix_caching: bool = True
) -> list[str]:
    """`add_scheduling_arguments`' values as command-line flags again."""
    flags = ["--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", str(max_num_batched_tokens)]
    if adaptive:
        flags.append("--adaptive")
    return flags if enable_prefix_caching else [*flags, "--no-enable-prefix-caching"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory (the tokenizer is read from it)")
    p.add_argument("--verifier", required=True, help="verifier address HOST:PORT")
    p.add_argument(
        "--verifier-rpc",
        default="local",
        choices=VERIFIER_RPCS,
        help="local: VerifyStream on the Unix socket the verifier serves, without gRPC (the coordinator runs beside "
        "its verifier: same host or pod); stream: gRPC's VerifyStream, for a coordinator elsewhere (slower)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=3,
        help="the drafts every request gets per iteration (k; with --adaptive, the most it gets)",
    )
    add_scheduling_arguments(p)
    p.add_argument("--max-waiting", type=int, default=1024, help="queued requests before RESOURCE_EXHAUSTED")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for the verifier")
    p.add_argument("--auth-token-file", default=None, help="bearer tokens clients must present, one per line")
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health, "
        "/metrics) on this port of --host, beside gRPC (default: off)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model name the HTTP API answers to (default: the checkpoint directory's name)",
    )


@dataclass(frozen=True)
class CoordinatorConfig:
    """`specsplit serve coordinator`'s options (`add_arguments`), checked."""

    server: ServerOptions
    checkpoint: str  # --model: the tokenizer's checkpoint directory
    verifier: str  # HOST:PORT
    verifier_rpc: str  # local or stream
    num_speculative_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_waiting: int
    startup_timeout: float
    auth_token_file: str | None
    http_port: int | None = None
    served_model_name: str | None = None
    adaptive: bool = False
    enable_prefix_caching: bool = True

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> CoordinatorConfig:
        """The parsed command line; UsageError for a value out of range or a port taken."""
        config = cls(
            server=ServerOptions.from_args(args),
            checkpoint=args.model,
            verifier=args.verifier,
            verifier_rpc=args.verifier_rpc,
            num_speculative_tokens=args.num_speculative_tokens,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_waiting=args.max_waiting,
            startup_timeout=args.startup_timeout,
            auth_token_file=args.auth_token_file,
            http_port=args.http_port,
            served_model_name=args.served_model_name,
            adaptive=args.adaptive,
            enable_prefix_caching=args.enable_prefix_caching,
        )
        check_flag_ranges(
            config,
            num_speculative_tokens=(0, MAX_SPECULATIVE_TOKENS),
            max_num_seqs=(1, None),
            max_num_batched_tokens=(1, None),
            max_waiting=(0, None),
            startup_timeout=(0, None),
        )
        if config.http_port is not None:
            check_can_listen(config.server.host, config.http_port, "--http-port")
        return config


def verifier_refusal(rpc: str, address: str, info: common_pb2.ModelInfo) -> str | None:
    """Why this coordinator cannot use the verifier that answered `info` (held by another coordinator, or not
    reachable by its `--verifier-rpc`), or None."""
    if info.coordinator_id:
        return (
            f"the verifier {address} serves another coordinator ({info.coordinator_id}), whose stream to it is open; "
            "one coordinator per verifier: stop that one first, or start a verifier for this one"
        )
    if rpc == "local" and not os.path.exists(info.verify_socket):
        return (
            f"the verifier {address} serves VerifyStream on {info.verify_socket or 'no socket'!r}, which is not on "
            "this host: run the coordinator beside its verifier (same host or pod, sharing its --socket-dir), or "
            "use --verifier-rpc stream"
        )
    return None


async def _wait_for_model_info(stub: verifier_pb2_grpc.VerifierStub, timeout_s: float) -> common_pb2.ModelInfo:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=5.0, wait_for_ready=True)
        except grpc.RpcError as err:
            if time.monotonic() > deadline:
                raise UsageError(
                    f"the verifier did not answer within {timeout_s:.0f}s ({err.details()}); check --verifier "
                    "(HOST:PORT of a running verifier) or give a longer --startup-timeout"
                ) from err
            await asyncio.sleep(0.2)


def load_tokenizer(model: str):
    """The tokenizer of checkpoint directory `model` (never from the hub); UsageError where none loads."""
    give = "give --model the checkpoint directory that holds the tokenizer"
    if not os.path.isdir(model):
        raise UsageError(f"checkpoint directory {model!r} does not exist; {give}")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError) as err:
        raise UsageError(f"no tokenizer loads from {model!r} (tokenizer.json, tokenizer_config.json); {give}") from err


async def serve(config: CoordinatorConfig) -> None:
    end_with_parent()  # started by a LocalCluster: ends with it
    tokenizer = load_tokenizer(config.checkpoint)
    servicer = CoordinatorServicer(tokenizer, GRPC_DEFAULTS.with_generation_config(config.checkpoint))
    service = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name
    tls = load_tls(config.server.tls_dir)
    tokens = load_tokens(config.auth_token_file)
    server = ServiceServer(
        "coordinator",
        config.server.host,
        config.server.port,
        [service],
        tls=tls,
        interceptors=[BearerTokenInterceptor(tokens)] if tokens else None,
        max_message_bytes=config.server.max_message_bytes,
    )
    add_service(server.server, coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"], servicer)
    await server.start()
    http = await _start_http(config, tokenizer, tokens) if config.http_port is not None else None
    channel = peer_channel(config.verifier, tls)
    stub = verifier_pb2_grpc.VerifierStub(channel)
    info = await server.unless_stopped(_wait_for_model_info(stub, config.startup_timeout))
    if info is None:  # SIGTERM or SIGINT while waiting for the verifier
        log.info("coordinator: stopped before its verifier answered")
        await channel.close()
        if http is not None:
            await http.stop()
        await server.stop(0)
        return
    refusal = verifier_refusal(config.verifier_rpc, config.verifier, info)
    if refusal:
        await channel.close()
        await server.stop(0)
        if http is not None:
            await http.stop()
        raise UsageError(refusal)
    k = config.num_speculative_tokens
    model_info = common_pb2.ModelInfo()
    model_info.CopyFrom(info)
    model_info.num_speculative_tokens = k
    eos = list(info.eos_token_ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    scheduler_config = SchedulerConfig(
        max_model_len=info.max_model_len,
        block_size=info.block_size,
        num_blocks=info.num_blocks,
        num_speculative_tokens=k,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=max(config.max_num_batched_tokens, k + 1),
        max_waiting=config.max_waiting,
        adaptive=config.adaptive,
        enable_prefix_caching=config.enable_prefix_caching,
    )
    scheduler = Scheduler(scheduler_config, eos)
    engine = Engine(scheduler, RpcVerifier(stub, scheduler.eos_token_ids, rpc=config.verifier_rpc), tokenizer)
    engine.start()
    servicer.ready(engine, model_info)
    model_name = config.served_model_name or model_info.model
    set_model_name(model_name)  # the model_name label of the vLLM-named series
    if http is not None:
        http.api.ready(engine, model_info, model_name)
    freeze_start_up_heap()
    await server.mark_serving()
    if http is not None:
        announce("coordinator HTTP API", f"{config.server.host}:{config.http_port}")
    announce("coordinator", server.address)

    def on_drain() -> None:
        if http is not None:  # as gRPC: unhealthy at once, new requests refused after --shutdown-delay
            http.api.draining = True
            asyncio.get_running_loop().call_later(config.server.shutdown_delay, setattr, http.api, "refusing", True)

    async def on_stop() -> None:
        if http is not None:
            await http.stop()
        await engine.stop()
        await channel.close()

    await run_until_signal(
        server,
        on_stop,
        grace_s=config.server.shutdown_grace,
        delay_s=config.server.shutdown_delay,
        on_drain=on_drain,
    )


async def _start_http(config: CoordinatorConfig, tokenizer, tokens: frozenset[str]):
    """The OpenAI-compatible HTTP API, listening (its routes answer 503 until the verifier answered)."""
    from specsplit.coordinator.http.app import HttpApi
    from specsplit.coordinator.http.server import HttpServer

    api = HttpApi(tokenizer, tokens, OPENAI_DEFAULTS.with_generation_config(config.checkpoint))
    http = HttpServer(api, config.server.host, config.http_port, config.server.tls_dir, config.server.shutdown_grace)
    await http.start()
    return http
