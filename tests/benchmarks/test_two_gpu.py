"""benchmarks/two_gpu.py on CPU, the --shape path: random weights, forced acceptance through the wrapped
drafter on every placement, and the lossless check against the target-only run of the same dtype."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "two_gpu.py"
CPU = ["--verifier-device", "cpu", "--drafter-device", "cpu", "--dtype", "float32"]


def test_shape_runs_end_to_end_with_forced_acceptance_and_stays_lossless(tmp_path):
    out = tmp_path / "two_gpu.json"
    args = [*CPU, "--transports", "nccl", "--batches", "2", "--new-tokens", "8", "--iters", "5", "--warmup", "2"]
    args += ["--repeats", "1", "--shape", "qwen2-tiny", "--load-format", "dummy", "--alpha", "0.8", "--out", str(out)]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["e2e_model"] == dict(model=None, shape="qwen2-tiny", load_format="dummy", alpha=0.8, dtype="float32")
    # The transfer part is unchanged: the demo width and the 7B width, for the one transport.
    assert sorted({(r["transport"], r["hidden_size"]) for r in result["transfer"]}) == [("nccl", 320), ("nccl", 3584)]
    assert [(r["mode"], r["batch"]) for r in result["e2e"]] == [("two_devices/nccl", 2), ("one_device/grpc", 2)]
    for r in result["e2e"]:
        assert r["tokens_per_s"] > 0
        # Random-weight drafts over an 8192-token vocabulary are (almost) never accepted: acceptance
        # well above zero means the forced drafter ran with an oracle matching the measured outputs. (Not near
        # alpha: 16 positions, and the forced coin is one per prompt and position, the same in every run — with
        # this seed about half of them come up "reject".)
        assert r["acceptance_rate"] > 0.15 and r["accepted_per_iteration"] > 0.3, r
    assert [c["mode"] for c in result["lossless"]] == ["two_devices/nccl", "one_device/grpc"]
    for c in result["lossless"]:
        assert c == dict(mode=c["mode"], dtype="float32", prompts=2, identical=2, outputs=2)
    assert proc.stdout.count("2/2 prompts identical (float32") == 2
    assert "e2e: qwen2-tiny (dummy weights), float32, forced acceptance alpha=0.8" in proc.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--shape", "qwen2-tiny", "--alpha", "0.8"], "--shape has no weights: add --load-format dummy"),
        (["--shape", "qwen2-tiny", "--load-format", "dummy"], "--shape drafts with random weights: add --alpha"),
        (["--alpha", "0.8"], "--alpha forces acceptance on --shape runs only"),
    ],
)
def test_shape_needs_dummy_weights_and_alpha(args, message, monkeypatch, capsys):
    """In this process (the script's arguments are checked before it starts anything): exit code 2 and the
    message on stderr, as argparse ends the script."""
    from benchmarks import two_gpu

    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *CPU, *args])
    with pytest.raises(SystemExit) as exit_:
        two_gpu.main()
    stderr = capsys.readouterr().err
    assert exit_.value.code == 2 and message in stderr, stderr[-2000:]
