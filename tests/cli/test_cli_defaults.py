"""The demo checkpoint is the CLI's default model only in a source checkout; elsewhere --model is asked for."""

import pytest

from specsplit.cli import commands as cli


def test_in_a_checkout_the_demo_checkpoint_is_the_default():
    assert cli.DEFAULT_MODEL is not None and cli.DEFAULT_MODEL.endswith("checkpoints/demo")
    assert cli.parse_args(["up"]).model == cli.DEFAULT_MODEL


def test_outside_a_checkout_up_and_generate_local_ask_for_a_model(monkeypatch, capsys):
    monkeypatch.setattr(cli, "DEFAULT_MODEL", None)
    with pytest.raises(SystemExit) as exit_:
        cli.parse_args(["up"])
    assert exit_.value.code == 2 and "--model" in capsys.readouterr().err
    assert cli.parse_args(["up", "--model", "m"]).model == "m"
    assert cli.main(["generate", "--local", "hello"]) == 2
    assert "give --model DIR" in capsys.readouterr().err


def test_serve_imports_only_the_role_it_starts():
    import subprocess
    import sys

    code = (
        "import sys; from specsplit.cli.commands import parse_args; parse_args(['serve', 'coordinator', '--model', "
        "'m', '--verifier', 'v:1']); print(sorted(m for m in ('torch', 'specsplit.verifier.server', "
        "'specsplit.drafter.server') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
