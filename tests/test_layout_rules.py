"""docs/design.md §8: the client SDK and the coordinator never import torch; services never import each other."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_client_sdk_and_coordinator_import_without_torch():
    code = (
        "import sys; import specsplit, specsplit.cli.commands, specsplit.coordinator.server, "
        "specsplit.coordinator.engine; from specsplit import Client, AsyncClient; "
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


def test_nothing_but_init_and_main_sits_flat_in_the_package():
    """Every module belongs to the package of its part (docs/design.md §8): client/, cli/, rpc/, runtime/, ..."""
    flat = sorted(path.name for path in (ROOT / "specsplit").glob("*.py"))
    assert flat == ["__init__.py", "__main__.py"], f"modules at the top level of specsplit/: {flat}"


def test_client_cli_and_rpc_modules_import_without_torch():
    """Every module of client/, cli/ and rpc/ imports without torch, triton or transformers (docs/design.md §8)."""
    modules = []
    for package in ("client", "cli", "rpc"):
        paths = sorted((ROOT / "specsplit" / package).glob("*.py"))
        assert any(path.name != "__init__.py" for path in paths), f"no modules in specsplit/{package}/"
        modules += [f"specsplit.{package}.{path.stem}".removesuffix(".__init__") for path in paths]
    code = (
        "import importlib, sys\n"
        "for module in sys.argv[1:]:\n"
        "    importlib.import_module(module)\n"
        "    bad = [m for m in ('torch', 'triton', 'transformers') if m in sys.modules]\n"
        "    if bad:\n"
        "        sys.exit(f'{module} imports {bad}')\n"
    )
    out = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr


# Where protobuf messages may be built or read (docs/design.md §8 rule 4): the services' servicers and servers, the
# RPC handles that carry an iteration across a seam and their wire conversions, the hidden-state transports, the
# client SDK and the client-facing input (gRPC validation, the HTTP API, `specsplit.LLM`'s arguments, validated as the
# coordinator validates a GenerateRequest).
PROTO_EDGES = (
    r"specsplit/proto/.*",
    r"specsplit/(coordinator|verifier|drafter)/(servicer|server)\.py",
    r"specsplit/(coordinator|verifier)/wire\.py",
    r"specsplit/coordinator/(verify_stream|validation)\.py",
    r"specsplit/coordinator/http/.*",
    r"specsplit/verifier/(drafter_channel|socket_channel|pool_channel|propose_request|drafter_pool)\.py",
    r"specsplit/transport/.*",
    r"specsplit/(client|rpc)/.*",
    r"specsplit/engine/llm\.py",
)


def test_protobuf_stays_at_the_edges():
    """The iteration's code (engine loop, scheduler, the verifier's step and worker, runners, models, kernels, runtime)
    works on dataclasses; only the edges above import specsplit.proto."""
    pattern = re.compile(r"^\s*(from specsplit\.proto\b|from specsplit import proto\b|import specsplit\.proto\b)", re.M)
    importers = {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "specsplit").rglob("*.py")
        if pattern.search(path.read_text())
    }
    inside = sorted(p for p in importers if not any(re.fullmatch(edge, p) for edge in PROTO_EDGES))
    assert inside == [], f"protobuf imported inside the iteration's code: {inside}"
    # The rule has teeth: the iteration's own modules are among those checked, and exist.
    for core in ("coordinator/engine.py", "verifier/step.py", "verifier/worker.py", "engine/local.py"):
        assert (ROOT / "specsplit" / core).exists(), core


def test_nothing_but_main_imports_the_cli():
    """What the services share with `up` lives in rpc/ (docs/design.md §8 rule 7): no module outside specsplit/cli/
    but __main__.py imports it, so a service never depends on the command that starts it."""
    pattern = re.compile(r"^\s*(from specsplit\.cli\b|import specsplit\.cli\b|from specsplit import cli\b)", re.M)
    importers = sorted(
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "specsplit").rglob("*.py")
        if "cli" not in path.relative_to(ROOT / "specsplit").parts[:1] and pattern.search(path.read_text())
    )
    assert importers == ["specsplit/__main__.py"], importers


def test_kernels_import_only_torch_and_triton():
    """docs/design.md §8 rule 3: specsplit/kernels/ imports torch, triton, the standard library and itself only."""
    import ast

    for path in sorted((ROOT / "specsplit" / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                root = name.split(".")[0]
                ok = root in ("torch", "triton") or root in sys.stdlib_module_names
                ok = ok or name == "specsplit.kernels" or name.startswith("specsplit.kernels.")
                assert ok, f"{path.relative_to(ROOT)} imports {name}"
