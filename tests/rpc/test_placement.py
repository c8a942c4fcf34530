"""Placements, not switches: `--placement colocated|pooled` sets every hop's path alike for `up`,
`serve verifier` and `serve drafter` (`specsplit/rpc/placement.py`), and LocalCluster's command lines
carry it to both model servers."""

import os

import pytest

from specsplit.cli.commands import parse_args, up_cluster
from specsplit.cli.launcher import LocalCluster
from specsplit.rpc.placement import DEFAULT_PLACEMENT, Placement, resolve_placement


@pytest.mark.parametrize(
    ("name", "device", "transport", "expected"),
    [
        ("colocated", "cuda", None, Placement("colocated", "cuda_ipc")),
        ("colocated", "cuda:1", None, Placement("colocated", "cuda_ipc")),
        ("colocated", "cpu", None, Placement("colocated", "grpc")),
        ("pooled", "cuda:0", None, Placement("pooled", "grpc")),
        ("pooled", "cuda:0", "nccl", Placement("pooled", "nccl")),
        ("pooled", "cpu", "grpc", Placement("pooled", "grpc")),
    ],
)
def test_a_placement_resolves_to_one_transport_per_device(name, device, transport, expected):
    assert resolve_placement(name, device, transport) == expected


def test_what_each_placement_implies():
    colocated, pooled = resolve_placement("colocated", "cuda:0"), resolve_placement("pooled", "cuda:0")
    assert (colocated.drafter_rpc, colocated.device_hand_off) == ("local", True)
    assert (pooled.drafter_rpc, pooled.device_hand_off) == ("stream", False)
    assert resolve_placement("colocated", "cpu").device_hand_off is False  # no CUDA, no hand-off


@pytest.mark.parametrize(
    ("name", "transport", "match"),
    [
        ("colocated", "nccl", "applies to a pooled drafter"),
        ("colocated", "grpc", "applies to a pooled drafter"),
        ("pooled", "cuda_ipc", "grpc or nccl"),
        ("sidecar", None, "unknown placement 'sidecar'; choose one of colocated, pooled"),
    ],
)
def test_bad_placements_are_refused_naming_the_fix(name, transport, match):
    with pytest.raises(ValueError, match=match):
        resolve_placement(name, "cuda:0", transport)


@pytest.mark.parametrize(
    "argv",
    [
        ["up"],
        ["serve", "verifier", "--model", "ckpt"],
        ["serve", "drafter", "--model", "ckpt"],
    ],
)
def test_up_and_serve_default_to_the_same_placement(argv):
    args = parse_args(argv)
    assert args.placement == DEFAULT_PLACEMENT == "colocated" and args.hidden_transport is None


@pytest.mark.parametrize("command", [["up"], ["serve", "verifier", "--model", "ckpt"]])
def test_a_transport_for_a_colocated_drafter_exits_2_on_the_command_line(command, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args([*command, "--hidden-transport", "nccl"])
    assert exc.value.code == 2
    assert "--hidden-transport applies to a pooled drafter" in capsys.readouterr().err
    assert parse_args([*command, "--placement", "pooled", "--hidden-transport", "nccl"]).hidden_transport == "nccl"


@pytest.mark.parametrize(
    "removed",
    [
        ["--drafter-rpc", "local"],
        ["--verify-socket", "/tmp/v.sock"],
        ["--no-device-hand-off"],
        ["--hidden-transport", "cuda_ipc"],
    ],
)
def test_the_per_hop_switches_are_gone(removed):
    with pytest.raises(SystemExit):
        parse_args(["serve", "verifier", "--model", "ckpt", *removed])


def flags(cmd: list[str], *names: str) -> list[str | None]:
    return [cmd[cmd.index(n) + 1] if n in cmd else None for n in names]


@pytest.mark.parametrize(
    ("kwargs", "transport"),
    [
        ({}, "grpc"),  # co-located on the CPU
        ({"device": "cuda:0"}, "cuda_ipc"),
        ({"verifier_device": "cuda:0", "drafter_device": "cuda:1"}, "cuda_ipc"),  # two GPUs of this host
    ],
)
def test_a_colocated_cluster_gives_both_model_servers_the_placement_and_one_socket_directory(kwargs, transport):
    cluster = LocalCluster("ckpt", **kwargs)
    assert cluster.hidden_transport == transport
    verifier, drafter = cluster.command("verifier", 1234, "127.0.0.1:1"), cluster.command("drafter", 1235)
    for cmd in (verifier, drafter):
        assert flags(cmd, "--placement", "--hidden-transport") == ["colocated", None]
        assert flags(cmd, "--socket-dir") == [cluster.socket_dir]
    socket_dir = cluster.socket_dir
    assert len(os.path.join(socket_dir, "verifier.sock")) < 108 and os.path.isdir(socket_dir)
    coordinator = cluster.command("coordinator", 1233, "127.0.0.1:1234")
    assert "--placement" not in coordinator and "--verifier-rpc" not in coordinator  # its default: the socket
    cluster.stop()
    assert not os.path.exists(socket_dir)


def test_a_pooled_cluster_passes_its_transport():
    cluster = LocalCluster("ckpt", device="cuda:0", placement="pooled", hidden_transport="nccl")
    assert cluster.hidden_transport == "nccl"
    for cmd in (cluster.command("verifier", 1), cluster.command("drafter", 2)):
        assert flags(cmd, "--placement", "--hidden-transport") == ["pooled", "nccl"]
    cluster.stop()  # the socket directory its commands made
    assert LocalCluster("ckpt", device="cuda:0", placement="pooled").hidden_transport == "grpc"


def test_up_with_a_tensor_parallel_verifier_splits_the_share_of_the_device_its_drafter_is_on():
    """--verifier-tp 2 from cuda:0: a pooled drafter on cuda:1 shares rank 1's device, one on cuda:2 has its own."""
    args = ["up", "--device", "cuda:0", "--verifier-tp", "2", "--placement", "pooled"]
    assert up_cluster(parse_args([*args, "--drafter-device", "cuda:1"])).memory_shares == {
        "verifier": 0.8,
        "drafter": 0.1,
    }
    assert up_cluster(parse_args([*args, "--drafter-device", "cuda:2"])).memory_shares == {
        "verifier": 0.9,
        "drafter": 0.9,
    }


def test_a_colocated_drafter_on_another_kind_of_device_is_refused():
    with pytest.raises(ValueError, match="put both on CUDA devices or both on the CPU, or use placement pooled"):
        LocalCluster("ckpt", verifier_device="cuda:0", drafter_device="cpu")
    assert LocalCluster("ckpt", verifier_device="cuda:0", drafter_device="cpu", placement="pooled")


def test_only_the_coordinator_listens_on_the_host_up_is_given():
    cluster = up_cluster(parse_args(["up", "--host", "0.0.0.0", "--port", "50051"]))
    assert flags(cluster.command("coordinator", 50051, "127.0.0.1:1"), "--host") == ["0.0.0.0"]
    for role in ("verifier", "drafter"):
        assert flags(cluster.command(role, 1, "127.0.0.1:2"), "--host") == ["127.0.0.1"]
    cluster.stop()


def test_role_command_replaces_the_program_and_keeps_the_roles_arguments():
    wrapper = ["python", "benchmarks/lib/forced_drafter.py", "--alpha", "0.8"]
    cluster = LocalCluster("ckpt", role_commands={"drafter": wrapper}, drafter_args=["--num-blocks", "8"])
    cmd = cluster.command("drafter", 1234)
    assert cmd[: len(wrapper)] == wrapper
    assert cmd[len(wrapper) :] == [
        *["--host", "127.0.0.1", "--port", "1234", "--model", "ckpt"],
        *["--device", "cpu", "--dtype", "float32", "--load-format", "auto"],
        *["--placement", "colocated", "--socket-dir", cluster.socket_dir, "--num-blocks", "8"],
    ]
    assert cluster.command("verifier", 1)[2:4] == ["specsplit", "serve"]
    cluster.stop()


def test_up_passes_the_scheduling_flags_to_the_coordinator():
    cluster = up_cluster(parse_args(["up", "--max-num-seqs", "32", "--max-num-batched-tokens", "1024"]))
    cmd = cluster.command("coordinator", 1234, "127.0.0.1:1")
    cluster.stop()
    assert flags(cmd, "--max-num-seqs", "--max-num-batched-tokens") == ["32", "1024"]
    with pytest.raises(SystemExit):
        parse_args(["up", "--micro-batches", "2"])  # removed: one iteration in flight


def test_model_servers_get_the_load_format_and_the_coordinator_does_not():
    cluster = LocalCluster("ckpt", load_format="dummy")
    for role in ("verifier", "drafter"):
        assert flags(cluster.command(role, 1234), "--load-format") == ["dummy"]
    assert "--load-format" not in cluster.command("coordinator", 1234, "127.0.0.1:1")
    cluster.stop()


def test_up_serves_each_services_metrics_on_its_own_port():
    cluster = up_cluster(parse_args(["up", "--metrics-port", "9464"]))
    ports = {role: flags(cluster.command(role, 1, "127.0.0.1:2"), "--metrics-port")[0] for role in cluster.extra}
    assert ports == {"coordinator": "9464", "verifier": "9465", "drafter": "9466"}
    cluster.stop()
    cluster = up_cluster(parse_args(["up"]))
    assert "--metrics-port" not in cluster.command("verifier", 1)
    cluster.stop()


def test_up_gives_a_verifier_and_a_drafter_on_one_gpu_shares_that_add_up_below_1():
    def shares(*argv: str) -> dict[str, list[str]]:
        cluster = up_cluster(parse_args(["up", *argv]))
        found = {role: flags(cluster.command(role, 1), "--gpu-memory-utilization") for role in ("verifier", "drafter")}
        cluster.stop()
        return found

    assert shares() == {"verifier": [None], "drafter": [None]}  # the CPU: --num-blocks' default
    assert shares("--device", "cuda") == {"verifier": ["0.8"], "drafter": ["0.1"]}
    assert shares("--device", "cuda:0", "--gpu-memory-utilization", "0.6") == {"verifier": ["0.5"], "drafter": ["0.1"]}
    pooled = ["--placement", "pooled", "--verifier-device", "cuda:0", "--drafter-device", "cuda:1"]
    assert shares(*pooled) == {"verifier": ["0.9"], "drafter": ["0.9"]}
