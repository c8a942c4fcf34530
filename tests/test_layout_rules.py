"""docs/design.md §8: the client SDK and the coordinator never import torch; services never import each other."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_client_sdk_and_coordinator_import_without_torch():
    code = (
        "import sys; import specsplit, specsplit.cli, specsplit.coordinator.server, specsplit.coordinator.engine; "
        "from specsplit import Client, AsyncClient; "
        "bad = [m for m in ('torch', 'triton', 'transformers') if m in sys.modules]; "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == ""


def test_services_meet_only_through_protos():
    services = ("coordinator", "verifier", "drafter")
    for a in services:
        for path in (ROOT / "specsplit" / a).rglob("*.py"):
            text = path.read_text()
            for b in services:
                if a != b:
                    pattern = rf"^\s*(from|import) specsplit\.{b}(\.|\s|$)|^\s*from specsplit import {b}\b"
                    assert not re.search(pattern, text, re.M), f"{path} imports {b}"
