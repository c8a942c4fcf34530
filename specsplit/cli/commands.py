"""The `specsplit` command: serve one service, bring all three up, generate, train the demo model."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import os
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import NoReturn

# The demo checkpoint is a default only in a source checkout (it is not in the wheel); elsewhere --model is required.
_DEMO = Path(__file__).resolve().parent.parent.parent / "checkpoints" / "demo"
DEFAULT_MODEL = str(_DEMO) if (_DEMO / "config.json").is_file() else None


def _serve(args: argparse.Namespace) -> int:
    from specsplit.rpc import telemetry
    from specsplit.rpc.server import setup_logging

    if args.role == "coordinator":
        from specsplit.coordinator.server import CoordinatorConfig as Config
        from specsplit.coordinator.server import serve
    elif args.role == "verifier":
        from specsplit.verifier.server import VerifierConfig as Config
        from specsplit.verifier.server import serve
    else:
        from specsplit.drafter.server import DrafterConfig as Config
        from specsplit.drafter.server import serve
    config = Config.from_args(args)
    setup_logging(args.role, config.server.log_level)
    http_port = getattr(config, "http_port", None)  # the coordinator's HTTP API serves /metrics
    telemetry.setup(
        args.role,
        metrics_port=config.server.metrics_port,
        metrics_host=config.server.metrics_host,
        prometheus=http_port is not None,
    )
    try:
        asyncio.run(serve(config))
    finally:
        telemetry.shutdown()
    return 0


def up_cluster(args: argparse.Namespace):
    """The LocalCluster `specsplit up` starts (not started yet)."""
    from specsplit.cli.launcher import LocalCluster
    from specsplit.coordinator.server import scheduling_flags

    return LocalCluster(
        args.model,
        num_speculative_tokens=args.num_speculative_tokens,
        host=args.host,
        port=args.port,
        device=args.device,
        dtype=args.dtype,
        load_format=args.load_format,
        placement=args.placement,
        hidden_transport=args.hidden_transport,
        verifier_device=args.verifier_device,
        drafter_device=args.drafter_device,
        verifier_args=["--tensor-parallel-size", str(args.verifier_tp)] if args.verifier_tp != 1 else None,
        drafter_args=["--tensor-parallel-size", str(args.drafter_tp)] if args.drafter_tp != 1 else None,
        metrics_port=args.metrics_port,
        http_port=args.http_port,
        gpu_memory_utilization=args.gpu_memory_utilization,
        coordinator_args=scheduling_flags(
            args.max_num_seqs, args.max_num_batched_tokens, args.adaptive, args.enable_prefix_caching
        ),
        tls_dir=args.tls_dir,
        auth_token_file=args.auth_token_file,
        max_model_len=args.max_model_len,
    )


def _up(args: argparse.Namespace) -> int:
    """Starts the three services and supervises them (`specsplit.cli.supervisor`) until Ctrl-C, SIGTERM or SIGHUP (0),
    or a service given up or the coordinator's exit (1)."""
    from specsplit.cli.supervisor import Supervisor

    cluster = up_cluster(args)
    supervisor = Supervisor(cluster, startup_timeout_s=args.startup_timeout)
    for stop in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: the terminal closed
        signal.signal(stop, lambda signum, frame: supervisor.stop())

    def on_ready() -> None:
        print(f"coordinator listening on {cluster.address}", flush=True)
        if cluster.http_url:
            print(f"OpenAI-compatible HTTP API on {cluster.http_url}/v1", flush=True)
        print(
            f"drafter {cluster.placement.name}: hidden states verifier → drafter by {cluster.hidden_transport}",
            file=sys.stderr,
            flush=True,
        )

    return supervisor.run(on_ready)


def _print_stats(result, out) -> None:
    s = result.stats
    per_pos = ", ".join(f"{a:.2f}" for a in s.acceptance_per_position) or "-"
    print(
        f"\n--- {result.completion_tokens} tokens, finish_reason={result.finish_reason}; "
        f"{s.num_iterations} iterations, drafts {s.num_draft_tokens}, accepted {s.num_accepted_tokens} "
        f"(rate {s.acceptance_rate:.2f}), acceptance per position [{per_pos}], "
        f"mean accepted length {s.mean_accepted_length:.2f} tokens/iteration",
        file=out,
    )


def _start_local(args: argparse.Namespace):
    """Starts the three services for `generate --local`; the demo traces to local span files."""
    from specsplit.cli.launcher import LocalCluster

    log_dir = Path(args.log_dir) if args.log_dir else Path(".specsplit-logs")
    env = {}
    if not any(k.startswith("OTEL_") for k in os.environ):
        trace_dir = (log_dir / "traces").resolve()
        shutil.rmtree(trace_dir, ignore_errors=True)
        env = {"SPECSPLIT_TRACE_DIR": str(trace_dir)}
        os.environ.update(env)  # this process (the client) traces too
    cluster = LocalCluster(
        args.model,
        num_speculative_tokens=args.num_speculative_tokens,
        device=args.device,
        dtype=args.dtype,
        log_dir=log_dir,
        env=env,
    )
    t0 = time.monotonic()
    cluster.start(timeout_s=args.startup_timeout)
    if not args.json:
        print(
            f"[three services up in {time.monotonic() - t0:.1f}s: coordinator {cluster.address}, "
            f"verifier {cluster.services['verifier'].address}, drafter {cluster.services['drafter'].address} "
            f"(hidden states by {cluster.hidden_transport}); logs in {log_dir}/]",
            file=sys.stderr,
        )
    return cluster, env.get("SPECSPLIT_TRACE_DIR")


def _client_security(args: argparse.Namespace) -> dict:
    """`Client`'s `tls_ca` and `token` from `generate`'s --tls-ca and --auth-token-file; UsageError for a file that
    does not read, a token without TLS, or either with --local (its services run without them)."""
    from specsplit.client.errors import UsageError
    from specsplit.rpc.security import read_token

    if args.local and (args.tls_ca or args.auth_token_file):
        raise UsageError("--tls-ca and --auth-token-file are for --address; --local starts its services without them")
    if args.auth_token_file and not args.tls_ca:
        raise UsageError("--auth-token-file needs --tls-ca: a bearer token is never sent in plaintext")
    security = {}
    if args.tls_ca:
        try:
            security["tls_ca"] = Path(args.tls_ca).read_bytes()
        except OSError as err:
            raise UsageError(
                f"cannot read --tls-ca {args.tls_ca} ({err.strerror}); give the CA certificate (PEM) that signed the "
                "coordinator's"
            ) from err
    if args.auth_token_file:
        security["token"] = read_token(args.auth_token_file)
    return security


def _generate(args: argparse.Namespace) -> int:
    from opentelemetry import trace

    from specsplit.client.errors import SpecsplitError
    from specsplit.client.results import GenerationResult, SpecStats
    from specsplit.client.sdk import Client
    from specsplit.rpc import telemetry

    security = _client_security(args)
    cluster, trace_dir = _start_local(args) if args.local else (None, None)
    address = cluster.address if cluster else args.address
    if importlib.util.find_spec("opentelemetry.sdk") is not None:  # the client's spans: the telemetry extra
        telemetry.setup("client")
    tracer = trace.get_tracer("specsplit.client")
    kwargs = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop or None,
    )
    if args.num_speculative_tokens is not None and not args.local:
        kwargs["num_speculative_tokens"] = args.num_speculative_tokens
    try:
        with Client(address, **security) as client, tracer.start_as_current_span("client generate"):
            t0 = time.monotonic()
            ids, text, last = [], [], None
            for delta in client.stream(args.prompt, **kwargs):
                ids.extend(delta.token_ids)
                text.append(delta.text)
                last = delta
                if not args.json:
                    sys.stdout.write(delta.text)
                    sys.stdout.flush()
            elapsed = time.monotonic() - t0
        result = GenerationResult(
            last.request_id,
            ids,
            "".join(text),
            last.finish_reason,
            last.stats or SpecStats(),
            last.prompt_tokens,
            last.completion_tokens,
        )
        if args.json:
            print(json.dumps({**result.to_dict(), "elapsed_s": round(elapsed, 3)}))
        else:
            _print_stats(result, sys.stdout)
            print(f"--- {result.completion_tokens / elapsed:.1f} tokens/s", file=sys.stdout)
    except SpecsplitError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        if cluster is not None:
            cluster.stop()
        telemetry.shutdown()
    if trace_dir and not args.json:
        print(f"--- spans in {trace_dir}/ (view: specsplit trace {trace_dir})", file=sys.stderr)
    return 0


def _trace(args: argparse.Namespace) -> int:
    from specsplit.cli.trace_view import main as trace_main

    return trace_main(args.files, args.request, args.output)


def _train_demo(argv: list[str]) -> int:
    from specsplit.training.train_demo import main as train_main

    return train_main(argv) or 0


ROLES = ("coordinator", "verifier", "drafter")


def _role_arguments(role: str):
    """The `serve ROLE` options, imported from that role alone."""
    if role == "coordinator":
        from specsplit.coordinator.server import add_arguments
    elif role == "verifier":
        from specsplit.verifier.server import add_arguments
    else:
        from specsplit.drafter.server import add_arguments
    return add_arguments


class _Parser(argparse.ArgumentParser):
    """argparse, reporting a mistake as one line: `<prog>: <problem>; see <prog> --help`, exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}; see {self.prog} --help\n")


def _add_up_arguments(up: argparse.ArgumentParser) -> None:
    """`up`'s options."""
    from specsplit.coordinator.server import add_scheduling_arguments
    from specsplit.rpc.placement import add_placement_arguments

    up.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        required=DEFAULT_MODEL is None,
        help="checkpoint directory (default: the demo)",
    )
    up.add_argument(
        "--num-speculative-tokens", type=int, default=3, help="the most drafts a request gets per iteration (k)"
    )
    up.add_argument(
        "--host", default="127.0.0.1", help="the coordinator's address (verifier and drafter bind to loopback)"
    )
    up.add_argument("--port", type=int, default=50051)
    up.add_argument("--device", default="cpu")
    up.add_argument("--dtype", default="float32")
    up.add_argument(
        "--load-format", default="auto", choices=["auto", "dummy"], help="dummy: random weights from config.json"
    )
    up.add_argument("--verifier-device", default=None, help="pins the verifier, e.g. cuda:0 (default: --device)")
    up.add_argument("--drafter-device", default=None, help="pins the drafter, e.g. cuda:1 (default: --device)")
    up.add_argument(
        "--verifier-tp",
        type=int,
        default=1,
        help="the verifier's tensor-parallel ranks, on the devices from --verifier-device on (its "
        "--tensor-parallel-size)",
    )
    up.add_argument(
        "--drafter-tp",
        type=int,
        default=1,
        help="the drafter's tensor-parallel ranks, on the devices from --drafter-device on (its "
        "--tensor-parallel-size), for an MTP module larger than one device",
    )
    add_placement_arguments(up, sockets=False)
    up.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="CUDA: the share of each device verifier and drafter may use together, their KV caches getting what "
        "weights and workspace leave (default 0.9); a drafter on the verifier's device takes 0.1 of it. Not on the CPU",
    )
    up.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="Prometheus metrics on --host: the coordinator's on this port, the verifier's and the drafter's on the "
        "next two",
    )
    up.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="the coordinator's OpenAI-compatible HTTP API on this port of --host (default: off)",
    )
    up.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the most tokens a request may hold, prompt and output (the verifier's; default: the model's context "
        "length)",
    )
    up.add_argument(
        "--auth-token-file",
        default=None,
        help="bearer tokens clients must present on the coordinator's gRPC and HTTP APIs, one per line",
    )
    up.add_argument(
        "--tls-dir",
        default=None,
        help="directory with tls.crt, tls.key, ca.crt: TLS to clients; the three services dial each other at "
        "127.0.0.1 with mutual TLS, so tls.crt must be valid for IP:127.0.0.1 as well as the coordinator's names",
    )
    add_scheduling_arguments(up)
    up.add_argument("--startup-timeout", type=float, default=600.0)


def build_parser(serve_role: str | None = None, up_options: bool = True) -> argparse.ArgumentParser:
    """`serve_role`: the role whose options `serve` gets (the one on the command line); `up_options`: whether `up`
    gets its options, which import the coordinator's module (only when `up` is the command: the base install, the
    client SDK alone, runs `--help`, `generate` and `trace` without the coordinator's dependencies)."""
    from specsplit import __version__

    p = _Parser(prog="specsplit", description=__doc__)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run one service")
    roles = serve.add_subparsers(dest="role", required=True)
    for role in ROLES:
        r = roles.add_parser(role)
        if role == serve_role:  # only the role being started: an image carries one role's dependencies
            from specsplit.rpc.server import add_common_arguments

            r.add_argument("--port", type=int, default=50051 if role == "coordinator" else 0)
            add_common_arguments(r)
            _role_arguments(role)(r)
    serve.set_defaults(func=_serve)

    up = sub.add_parser("up", help="start the three services on this machine")
    if up_options:
        _add_up_arguments(up)
    up.set_defaults(func=_up)

    gen = sub.add_parser("generate", help="generate from a prompt (streams text)")
    where = gen.add_mutually_exclusive_group()
    where.add_argument("--address", default="127.0.0.1:50051")
    where.add_argument("--local", action="store_true", help="start the three services, generate, stop them")
    gen.add_argument(
        "--tls-ca", default=None, help="connect over TLS, trusting this CA certificate (PEM; the coordinator's ca.crt)"
    )
    gen.add_argument(
        "--auth-token-file",
        default=None,
        help="send the first bearer token of this file (the coordinator's --auth-token-file format); needs --tls-ca",
    )
    gen.add_argument("--model", default=DEFAULT_MODEL, help="with --local: checkpoint directory (default: the demo)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--num-speculative-tokens", type=int, default=None)
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--dtype", default="float32")
    gen.add_argument("--log-dir", default=None, help="with --local: where service logs go")
    gen.add_argument("--startup-timeout", type=float, default=600.0)
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    gen.add_argument("prompt")
    gen.set_defaults(func=_generate)

    tr = sub.add_parser("trace", help="draw one request's iterations from span files (SVG) and summarise")
    tr.add_argument("files", nargs="+", help="span files (*.jsonl) or directories holding them")
    tr.add_argument("--request", default=None, help="request id (default: the latest request)")
    tr.add_argument("--output", "-o", default="trace.svg")
    tr.set_defaults(func=_trace)

    sub.add_parser("train-demo", help="train the demo checkpoint (specsplit/training/)", add_help=False)
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line parsed; `serve ROLE` imports that role's options only. A placement and
    hidden-state transport that do not go together exit 2, as any bad option does."""
    serve_role = argv[1] if argv[:1] == ["serve"] and len(argv) > 1 and argv[1] in ROLES else None
    parser = build_parser(serve_role, up_options=argv[:1] == ["up"])
    args = parser.parse_args(argv)
    if getattr(args, "placement", None) is not None:
        from specsplit.rpc.placement import resolve_placement

        try:
            resolve_placement(args.placement, "cpu", args.hidden_transport)
        except ValueError as err:
            parser.error(str(err))
    return args


# What each command needs beyond the base install (the client SDK, which runs `--help`, `--version`,
# `generate --address` and `trace`): the extra that brings it.
_EXTRAS = {
    ("serve", "coordinator"): "coordinator",
    ("serve", "verifier"): "worker",
    ("serve", "drafter"): "worker",
    ("up",): "coordinator,worker",
    ("generate", "--local"): "coordinator,worker",
    ("train-demo",): "worker",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    code = _run(argv)
    if argv[:1] == ["serve"]:
        _end_process(code)
    return code


def _end_process(code: int) -> NoReturn:
    """A service that has stopped (its sockets removed, telemetry flushed) ends here, without the interpreter's
    teardown: there, native extensions' objects still alive at exit (Triton's) are reported as leaks, dozens of
    lines of noise after every clean stop."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run(argv: list[str]) -> int:
    try:
        return _main(argv)
    except ModuleNotFoundError as err:  # an install without the command's extra: say which, not a traceback
        if (err.name or "specsplit").split(".")[0] == "specsplit":
            raise
        command = argv[:2] if argv[:1] == ["serve"] else argv[:1]
        key = ("generate", "--local") if command == ["generate"] and "--local" in argv else tuple(command)
        extra = _EXTRAS.get(key)
        if extra is None:
            raise
        print(
            f"specsplit {' '.join(command)}: this command needs the specsplit[{extra}] extra (no module named "
            f"{err.name!r}); pip install 'specsplit[{extra}]'",
            file=sys.stderr,
        )
        return 2


def _main(argv: list[str]) -> int:
    if argv[:1] == ["train-demo"]:
        return _train_demo(argv[1:])
    args = parse_args(argv)
    if args.command == "up" or (args.command == "generate" and args.local):
        # The services' modules, looked up (not imported) here: one line from this command, not one per child.
        for name in ("transformers", "torch", "triton", "opentelemetry.sdk"):
            if importlib.util.find_spec(name) is None:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    if args.command == "generate" and args.local:
        if args.model is None:
            print(
                "specsplit generate --local: give --model DIR (the demo checkpoint is only in a source checkout)",
                file=sys.stderr,
            )
            return 2
        if args.num_speculative_tokens is None:
            args.num_speculative_tokens = 3
    from specsplit.client.errors import UsageError

    try:
        if args.command == "up":  # before three processes start, each to fail on its own
            from specsplit.rpc.security import check_loopback_tls, load_tokens
            from specsplit.rpc.server import check_can_listen, check_flag_ranges

            check_flag_ranges(args, max_model_len=(1, None))
            check_can_listen(args.host, args.port)
            if args.http_port is not None:
                check_can_listen(args.host, args.http_port, "--http-port")
            load_tokens(args.auth_token_file)
            if args.tls_dir:
                check_loopback_tls(args.tls_dir)
        return args.func(args)
    except UsageError as err:
        return _refuse(args, err)


def _refuse(args: argparse.Namespace, err: Exception) -> int:
    """A mistake at start-up: one line on stderr, `specsplit <command>: <problem>; <fix>`, and exit code 2;
    the traceback above it only with `--log-level debug`."""
    if getattr(args, "log_level", "").upper() == "DEBUG":
        traceback.print_exception(err)
    command = " ".join(["specsplit", args.command, *([args.role] if args.command == "serve" else [])])
    print(f"{command}: {' '.join(str(err).split())}", file=sys.stderr)
    return 2
