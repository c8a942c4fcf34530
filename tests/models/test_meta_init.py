"""`on_meta()`: modules built on the meta device without their random initialisation, so that loading a model
never imports torch._dynamo (about 1 s of every model server's start on a CPU)."""

import subprocess
import sys
import threading
from pathlib import Path

import torch
from torch import nn

from specsplit.models.meta_init import on_meta

DEMO = Path(__file__).resolve().parents[2] / "checkpoints" / "demo"


def test_loading_the_demo_target_and_mtp_imports_no_dynamo():
    code = (
        "import sys\n"
        "from specsplit.models.loader import load_mtp, load_target\n"
        f"load_target({str(DEMO)!r}); load_mtp({str(DEMO)!r})\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_inside_modules_are_on_meta_and_outside_and_in_other_threads_they_are_initialised():
    built = {}

    def other_thread():
        built["other"] = nn.Linear(8, 8)

    with on_meta():
        linear, embedding, norm = nn.Linear(8, 16), nn.Embedding(32, 8, padding_idx=0), nn.LayerNorm(8)
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
    assert {p.device.type for m in (linear, embedding, norm) for p in m.parameters()} == {"meta"}
    assert linear.weight.shape == (16, 8) and embedding.weight.shape == (32, 8)
    outside = nn.Linear(8, 8)
    for m in (outside, built["other"]):  # the mode holds for the thread inside it only
        assert m.weight.device.type == "cpu" and m.weight.std() > 0
    torch.nn.init.zeros_(outside.weight)
    assert outside.weight.abs().sum() == 0
