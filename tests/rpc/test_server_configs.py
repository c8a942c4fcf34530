"""`serve ROLE`'s command line becomes one typed, checked config (`<Role>Config.from_args`), the only
reader of the parsed flags; the model servers' configs hold the placement resolved for their device."""

from __future__ import annotations

import pytest

from specsplit.cli.commands import parse_args
from specsplit.client.errors import UsageError
from specsplit.coordinator.server import CoordinatorConfig, scheduling_flags
from specsplit.drafter.server import DrafterConfig
from specsplit.rpc.placement import Placement
from specsplit.rpc.server import ServerOptions
from specsplit.runtime.serve_options import ModelOptions
from specsplit.runtime.slow_steps import DEFAULT_SLOW_STEP_S
from specsplit.verifier.server import VerifierConfig

# --port 0: the coordinator's default, 50051, may be taken on a test machine.
SERVER_DEFAULTS = ServerOptions(
    host="127.0.0.1",
    port=0,
    log_level="INFO",
    metrics_port=None,
    metrics_host="127.0.0.1",  # --host's
    tls_dir=None,
    shutdown_grace=30.0,
    shutdown_delay=0.0,
    max_message_mb=256,
)


def model_defaults(device: str = "cpu") -> ModelOptions:
    return ModelOptions(
        checkpoint="ckpt",
        device=device,
        dtype="float32",
        load_format="auto",
        eager=False,
        slow_step_s=DEFAULT_SLOW_STEP_S,
    )


def test_the_coordinators_defaults_are_the_command_lines():
    config = CoordinatorConfig.from_args(
        parse_args(["serve", "coordinator", "--model", "ckpt", "--verifier", "127.0.0.1:1", "--port", "0"])
    )
    assert config == CoordinatorConfig(
        server=SERVER_DEFAULTS,
        checkpoint="ckpt",
        verifier="127.0.0.1:1",
        verifier_rpc="local",
        num_speculative_tokens=3,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        max_waiting=1024,
        startup_timeout=600.0,
        auth_token_file=None,
        adaptive=False,  # a fixed k unless --adaptive (docs/design.md §9: what measured best through the services)
    )
    assert config.server.max_message_bytes == 256 * 2**20
    args = ["serve", "coordinator", "--model", "ckpt", "--verifier", "127.0.0.1:1", "--port", "0", "--adaptive"]
    assert CoordinatorConfig.from_args(parse_args(args)).adaptive
    up = parse_args(["up", "--adaptive"])  # `up` passes it on to the coordinator it starts
    assert "--adaptive" in scheduling_flags(up.max_num_seqs, up.max_num_batched_tokens, up.adaptive)
    assert "--adaptive" not in scheduling_flags(16, 512)


def test_the_verifiers_defaults_are_the_command_lines():
    config = VerifierConfig.from_args(parse_args(["serve", "verifier", "--model", "ckpt"]))
    assert config == VerifierConfig(
        server=SERVER_DEFAULTS,
        model=model_defaults(),
        placement=Placement("colocated", "grpc"),
        socket_dir=None,
        drafter=None,
        num_blocks=None,  # on CUDA from --gpu-memory-utilization, on the CPU 1024
        block_size=16,
        max_model_len=None,
        drafter_timeout=30.0,
        transport_address="127.0.0.1:0",
        transport_timeout=30.0,
        transport_connect_timeout=300.0,
    )


def test_the_drafters_defaults_are_the_command_lines():
    config = DrafterConfig.from_args(parse_args(["serve", "drafter", "--model", "ckpt"]))
    assert config == DrafterConfig(
        server=SERVER_DEFAULTS,
        model=model_defaults(),
        placement=Placement("colocated", "grpc"),
        socket_dir=None,
        num_blocks=None,  # on CUDA from --gpu-memory-utilization, on the CPU 1024
        block_size=16,
        draft_top_k=16,
    )


@pytest.mark.parametrize("config_class", [VerifierConfig, DrafterConfig], ids=["verifier", "drafter"])
@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--device", "cuda:1"], Placement("colocated", "cuda_ipc")),
        (["--device", "cuda:1", "--placement", "pooled"], Placement("pooled", "grpc")),
        (["--device", "cuda:1", "--placement", "pooled", "--hidden-transport", "nccl"], Placement("pooled", "nccl")),
    ],
    ids=["colocated", "pooled", "pooled-nccl"],
)
def test_a_model_server_resolves_its_placement_for_its_device(config_class, flags, expected):
    role = "verifier" if config_class is VerifierConfig else "drafter"
    config = config_class.from_args(parse_args(["serve", role, "--model", "ckpt", "--eager", *flags]))
    assert config.placement == expected
    assert config.model == ModelOptions("ckpt", "cuda:1", "float32", "auto", True, DEFAULT_SLOW_STEP_S)


def test_a_value_out_of_range_is_refused_naming_its_flag():
    with pytest.raises(UsageError, match=r"^--draft-top-k 0 is out of range; give a value >= 1$"):
        DrafterConfig.from_args(parse_args(["serve", "drafter", "--model", "ckpt", "--draft-top-k", "0"]))
    with pytest.raises(UsageError, match=r"^--max-message-mb 0 is out of range; give a value in 1-2047$"):
        VerifierConfig.from_args(parse_args(["serve", "verifier", "--model", "ckpt", "--max-message-mb", "0"]))


@pytest.mark.parametrize("flag", [["--transport-slots", "8"], ["--transport-backend", "gloo"]])
def test_the_removed_transport_flags_are_refused(flag):
    with pytest.raises(SystemExit) as refused:
        parse_args(["serve", "verifier", "--model", "ckpt", *flag])
    assert refused.value.code == 2
