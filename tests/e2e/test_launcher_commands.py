"""LocalCluster's command lines: load format for the model servers, a replaced program for one role,
the hidden-state transport (`auto` resolved before any command is built), the verifier → drafter
control path (`--drafter-rpc`, with the drafter's `--propose-socket` for local)."""

import os

import pytest

from specsplit.cli import parse_args
from specsplit.launcher import LocalCluster, resolve_hidden_transport


def transport_flags(cluster: LocalCluster) -> dict[str, str]:
    flags = {}
    for role in ("verifier", "drafter"):
        cmd = cluster.command(role, 1234)
        flags[role] = cmd[cmd.index("--hidden-transport") + 1]
    assert "--hidden-transport" not in cluster.command("coordinator", 1234, "127.0.0.1:1")
    return flags


def test_model_servers_get_the_load_format_and_the_coordinator_does_not():
    cluster = LocalCluster("ckpt", load_format="dummy")
    for role in ("verifier", "drafter"):
        cmd = cluster.command(role, 1234)
        assert cmd[cmd.index("--load-format") + 1] == "dummy"
    assert "--load-format" not in cluster.command("coordinator", 1234, "127.0.0.1:1")


def test_role_command_replaces_the_program_and_keeps_the_roles_arguments():
    wrapper = ["python", "benchmarks/forced_drafter.py", "--alpha", "0.8"]
    cluster = LocalCluster("ckpt", role_commands={"drafter": wrapper}, drafter_args=["--num-blocks", "8"])
    cmd = cluster.command("drafter", 1234)
    assert cmd[: len(wrapper)] == wrapper
    assert cmd[len(wrapper) :] == [
        *["--host", "127.0.0.1", "--port", "1234", "--model", "ckpt"],
        *["--device", "cpu", "--dtype", "float32", "--load-format", "auto", "--hidden-transport", "grpc"],
        *["--propose-socket", cluster.socket_path("drafter"), "--num-blocks", "8"],
    ]
    assert cluster.command("verifier", 1)[2:4] == ["specsplit", "serve"]
    cluster.stop()  # removes the socket's directory


def test_auto_transport_is_grpc_on_cpu():
    cluster = LocalCluster("ckpt")  # the default: auto
    assert cluster.hidden_transport == "grpc"
    assert transport_flags(cluster) == {"verifier": "grpc", "drafter": "grpc"}


@pytest.mark.parametrize(
    "devices",
    [
        {"device": "cuda"},
        {"device": "cuda:0"},
        {"verifier_device": "cuda:0", "drafter_device": "cuda:1"},  # two GPUs of this host
    ],
)
def test_auto_transport_is_cuda_ipc_when_verifier_and_drafter_are_on_cuda(devices):
    cluster = LocalCluster("ckpt", **devices)
    assert cluster.hidden_transport == "cuda_ipc"
    assert transport_flags(cluster) == {"verifier": "cuda_ipc", "drafter": "cuda_ipc"}


def test_auto_transport_is_grpc_when_either_side_is_on_the_cpu():
    assert LocalCluster("ckpt", verifier_device="cuda:0", drafter_device="cpu").hidden_transport == "grpc"
    assert LocalCluster("ckpt", verifier_device="cpu", drafter_device="cuda:0").hidden_transport == "grpc"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"with_drafter": False},  # no drafter: cuda_ipc would refuse to start
        {"with_drafter": False, "verifier_args": ["--drafter", "127.0.0.1:1,127.0.0.1:2"]},  # several replicas
        {"verifier_args": ["--drafter=127.0.0.1:1"]},  # a drafter that is not this cluster's
    ],
)
def test_auto_transport_is_grpc_unless_the_verifier_talks_to_the_clusters_own_drafter(kwargs):
    cluster = LocalCluster("ckpt", device="cuda:0", **kwargs)
    assert cluster.hidden_transport == "grpc"
    assert transport_flags(cluster)["verifier"] == "grpc"


@pytest.mark.parametrize("name", ["grpc", "cuda_ipc", "nccl"])
@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_explicit_transport_passes_through_unchanged(name, device):
    cluster = LocalCluster("ckpt", device=device, hidden_transport=name)
    assert cluster.hidden_transport == name
    assert transport_flags(cluster) == {"verifier": name, "drafter": name}


def test_unknown_transport_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"unknown hidden-state transport 'shm'; choose one of auto, grpc, cuda_ipc"):
        LocalCluster("ckpt", hidden_transport="shm")
    with pytest.raises(ValueError, match="unknown hidden-state transport"):
        resolve_hidden_transport("CUDA_IPC", "cuda:0", "cuda:0")


def test_up_defaults_to_auto_and_the_servers_to_grpc_without_auto():
    assert parse_args(["up"]).hidden_transport == "auto"
    assert parse_args(["up", "--hidden-transport", "nccl"]).hidden_transport == "nccl"
    for role in ("verifier", "drafter"):
        assert parse_args(["serve", role, "--model", "ckpt"]).hidden_transport == "grpc"
        with pytest.raises(SystemExit):  # a server only ever takes a concrete transport
            parse_args(["serve", role, "--model", "ckpt", "--hidden-transport", "auto"])


def test_up_passes_the_scheduling_flags_to_the_coordinator():
    from specsplit.cli import up_cluster

    cmd = up_cluster(parse_args(["up", "--max-num-seqs", "32", "--max-num-batched-tokens", "1024"])).command(
        "coordinator", 1234, "127.0.0.1:1"
    )
    assert cmd[cmd.index("--max-num-seqs") + 1] == "32" and cmd[cmd.index("--max-num-batched-tokens") + 1] == "1024"
    with pytest.raises(SystemExit):
        parse_args(["up", "--micro-batches", "2"])  # removed: one iteration in flight


@pytest.mark.parametrize("rpc", ["local", "stream"])
def test_up_gives_the_rpcs_to_the_callers_and_sockets_to_the_servers_only_for_local(rpc):
    from specsplit.cli import up_cluster

    args = ["up"] if rpc == "local" else ["up", "--drafter-rpc", rpc, "--verifier-rpc", rpc]  # local: the default
    cluster = up_cluster(parse_args(args))
    coordinator = cluster.command("coordinator", 1233, "127.0.0.1:1")
    verifier = cluster.command("verifier", 1234, "127.0.0.1:1")
    drafter = cluster.command("drafter", 1235)
    assert coordinator[coordinator.index("--verifier-rpc") + 1] == rpc
    assert verifier[verifier.index("--drafter-rpc") + 1] == rpc
    sockets = []
    for cmd, flag in ((drafter, "--propose-socket"), (verifier, "--verify-socket")):
        if rpc == "local":
            sockets.append(cmd[cmd.index(flag) + 1])
        else:
            assert flag not in cmd
    assert all(len(path) < 108 and path.endswith(".sock") for path in sockets) and len(set(sockets)) == len(sockets)
    cluster.stop()
    assert not any(os.path.exists(os.path.dirname(path)) for path in sockets)  # stop() removes their directory
    # Services started by hand keep gRPC's streams: their peers may be on other hosts.
    assert parse_args(["serve", "verifier", "--model", "ckpt"]).drafter_rpc == "stream"
    assert parse_args(["serve", "coordinator", "--model", "m", "--verifier", "v:1"]).verifier_rpc == "stream"
