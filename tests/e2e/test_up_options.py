"""`specsplit up` run as a user runs it, with `--auth-token-file`, `--tls-dir`, `--max-model-len` and
`--metrics-port`: the coordinator's gRPC and HTTP APIs refuse a plaintext or unauthenticated client and serve an
authenticated TLS one (through the services' mutual TLS to each other, drafts included); `specsplit generate
--tls-ca --auth-token-file` works against it; the model length served is `--max-model-len`; every service's
metrics listen on `up`'s --host alone. A certificate the services cannot use between them, or a token file that
does not read, is refused in one line before anything starts."""

from __future__ import annotations

import datetime
import http.client
import json
import pathlib
import ssl
import subprocess
import sys

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from specsplit import Client, SpecsplitError
from specsplit.rpc.process import free_port

from .certs import make_ca, write_tls_dir
from .proc import children, wait_listening_on
from .up_process import Up

TOKEN = "up-s3cret"
MAX_MODEL_LEN = 40  # the tiny checkpoint's context is 512 tokens


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("up-pki")
    ca_cert, ca_key = make_ca("specsplit-up-ca")
    tokens = root / "tokens.txt"
    tokens.write_text(f"# the clients of this up\n{TOKEN}\n")
    (root / "ca.crt").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    return {
        "root": root,
        "tls_dir": write_tls_dir(root / "service", ca_cert, ca_key, "specsplit"),
        "ca": root / "ca.crt",
        "tokens": tokens,
        "ca_cert": ca_cert,
        "ca_key": ca_key,
    }


@pytest.fixture(scope="module")
def up(tiny_checkpoint, pki, tmp_path_factory):
    metrics_port, http_port = free_port(), free_port()
    args = ["--auth-token-file", str(pki["tokens"]), "--tls-dir", str(pki["tls_dir"])]
    args += ["--max-model-len", str(MAX_MODEL_LEN), "--metrics-port", str(metrics_port), "--http-port", str(http_port)]
    args.append("--no-adaptive")  # drafts every iteration: the drafter reached over mutual TLS shows in the stats
    logs = tmp_path_factory.mktemp("up-logs")
    (logs / "model").symlink_to(tiny_checkpoint)  # a path of its own: Up finds its services by it
    running = Up(logs / "model", logs, args)
    running.metrics_port, running.http_port = metrics_port, http_port
    yield running
    running.close()


def test_the_api_serves_an_authenticated_tls_client_only(up, pki):
    ca = pki["ca"].read_bytes()
    with Client(up.address, timeout=60, tls_ca=ca, token=TOKEN) as client:
        out = client.generate(prompt_token_ids=[5, 6, 7], max_tokens=6, ignore_eos=True)
    assert len(out.token_ids) == 6 and out.stats.num_draft_tokens > 0  # verifier and drafter answered over mTLS
    with Client(up.address, timeout=10) as plaintext, pytest.raises(SpecsplitError) as err:
        plaintext.model_info()
    assert err.value.code is grpc.StatusCode.UNAVAILABLE
    for token in (None, "wrong-token"):
        with Client(up.address, timeout=10, tls_ca=ca, token=token) as client, pytest.raises(SpecsplitError) as err:
            client.generate(prompt_token_ids=[5, 6], max_tokens=2)
        assert err.value.code is grpc.StatusCode.UNAUTHENTICATED

    def post(token: str | None) -> int:
        context = ssl.create_default_context(cafile=str(pki["ca"]))
        conn = http.client.HTTPSConnection("127.0.0.1", up.http_port, context=context, timeout=60)
        body = {"model": "tiny-llama", "prompt": [5, 6, 7], "max_tokens": 2}
        headers = {"content-type": "application/json", **({"authorization": f"Bearer {token}"} if token else {})}
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        status = conn.getresponse().status
        conn.close()
        return status

    assert (post(None), post(TOKEN)) == (401, 200)


def _generate_cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "specsplit", "generate", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_generate_takes_the_ca_and_the_token_file(up, pki):
    ok = _generate_cli(
        "--address",
        up.address,
        "--tls-ca",
        str(pki["ca"]),
        "--auth-token-file",
        str(pki["tokens"]),
        "--max-tokens",
        "8",
        "--json",
        "hi",
    )
    assert ok.returncode == 0, ok.stderr[-3000:]
    out = json.loads(ok.stdout)
    with Client(up.address, timeout=60, tls_ca=pki["ca"].read_bytes(), token=TOKEN) as client:
        assert out["token_ids"] == client.generate("hi", max_tokens=8).token_ids
    refused = _generate_cli("--address", up.address, "--tls-ca", str(pki["ca"]), "--max-tokens", "8", "hi")  # no token
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    for args in (["--auth-token-file", str(pki["tokens"])], ["--local", "--tls-ca", str(pki["ca"])]):
        mistake = _generate_cli(*args, "hi")
        lines = mistake.stderr.strip().splitlines()
        assert mistake.returncode == 2 and len(lines) == 1 and lines[0].startswith("specsplit generate: "), lines


def test_the_model_length_served_is_max_model_len(up, pki):
    with Client(up.address, timeout=60, tls_ca=pki["ca"].read_bytes(), token=TOKEN) as client:
        assert client.model_info().max_model_len == MAX_MODEL_LEN
        prompt = [5] * (MAX_MODEL_LEN - 10)
        assert len(client.generate(prompt_token_ids=prompt, max_tokens=10, ignore_eos=True).token_ids) == 10
        for too_long in ({"prompt_token_ids": prompt, "max_tokens": 11}, {"prompt_token_ids": [5] * MAX_MODEL_LEN}):
            with pytest.raises(SpecsplitError) as err:
                client.generate(**too_long)
            assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT and "max_model_len" in str(err.value)


def test_every_services_metrics_listen_on_ups_host_alone(up):
    services = children(up.proc.pid)
    for offset, role in enumerate(("coordinator", "verifier", "drafter")):  # --metrics-port P, P+1, P+2
        pids = [pid for pid, cmd in services.items() if f"specsplit serve {role} " in cmd]
        assert len(pids) == 1, (role, services)
        assert wait_listening_on(pids[0], up.metrics_port + offset) == {"127.0.0.1"}, role


def _tls_dir_named_only(directory: pathlib.Path, ca_cert, ca_key, dns_name: str) -> pathlib.Path:
    """A TLS directory whose certificate (from the CA, for server and client use) names `dns_name` alone."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(dns_name)]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / "tls.key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    (directory / "ca.crt").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    return directory


@pytest.mark.parametrize("mistake", ["certificate-without-127.0.0.1", "token-file-missing"])
def test_a_tls_dir_or_token_file_up_cannot_use_is_refused_in_one_line(tiny_checkpoint, pki, mistake):
    """Refused before any service starts: a certificate for the coordinator's public name alone would fail the
    services' handshakes with each other at 127.0.0.1 (the coordinator would wait for its verifier until
    --startup-timeout)."""
    if mistake == "certificate-without-127.0.0.1":
        tls_dir = _tls_dir_named_only(pki["root"] / "public-name", pki["ca_cert"], pki["ca_key"], "specsplit.example")
        args, named = ["--tls-dir", str(tls_dir)], "127.0.0.1"
    else:
        args, named = ["--auth-token-file", str(pki["root"] / "no-such-file")], "no-such-file"
    out = subprocess.run(
        [sys.executable, "-m", "specsplit", "up", "--model", str(tiny_checkpoint), "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith("specsplit up: ") and named in lines[0], lines[0]
