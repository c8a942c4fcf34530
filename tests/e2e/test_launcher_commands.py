"""LocalCluster's command lines: load format for the model servers, a replaced program for one role."""

from specsplit.launcher import LocalCluster


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
        *["--num-blocks", "8"],
    ]
    assert cluster.command("verifier", 1)[2:4] == ["specsplit", "serve"]
