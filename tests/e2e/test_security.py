"""Mutual TLS between services, TLS + bearer tokens on the client APIs (gRPC and HTTP), message size limits."""

import http.client
import json
import ssl
import urllib.parse

import grpc
import pytest
from cryptography.hazmat.primitives import serialization
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specsplit import Client, SpecsplitError
from specsplit.cli.launcher import LocalCluster
from specsplit.proto import common_pb2, verifier_pb2_grpc
from specsplit.rpc.process import free_port

from .certs import make_ca, make_leaf, write_tls_dir

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca_cert, ca_key = make_ca("specsplit-test-ca")
    rogue_cert, rogue_key = make_ca("rogue-ca")
    return {
        "tls_dir": write_tls_dir(root / "service", ca_cert, ca_key, "specsplit"),
        "ca": ca_cert.public_bytes(serialization.Encoding.PEM),
        "good": make_leaf(ca_cert, ca_key, "good-client"),
        "rogue": make_leaf(rogue_cert, rogue_key, "rogue-client"),
        "root": root,
    }


@pytest.fixture(scope="module")
def secure_cluster(tiny_checkpoint, pki):
    tokens = pki["root"] / "tokens.txt"
    tokens.write_text(f"# clients\n{TOKEN}\n")
    with LocalCluster(
        tiny_checkpoint,
        num_speculative_tokens=2,
        log_dir=pki["root"] / "logs",
        tls_dir=pki["tls_dir"],
        coordinator_args=["--auth-token-file", str(tokens), "--max-message-mb", "1", "--no-adaptive"],
        http_port=free_port(),
    ) as c:
        yield c


def test_tls_client_with_token_generates_through_mutual_tls_services(secure_cluster, pki):
    with Client(secure_cluster.address, timeout=60, tls_ca=pki["ca"], token=TOKEN) as client:
        out = client.generate(prompt_token_ids=[5, 6, 7], max_tokens=8, ignore_eos=True)
    assert len(out.token_ids) == 8 and out.stats.num_draft_tokens > 0  # the drafter was reached over mTLS


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_missing_or_wrong_token_is_unauthenticated(secure_cluster, pki, token):
    creds = grpc.ssl_channel_credentials(root_certificates=pki["ca"])
    if token is not None:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    from specsplit.proto import coordinator_pb2, coordinator_pb2_grpc

    with grpc.secure_channel(secure_cluster.address, creds) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(coordinator_pb2.GenerateRequest(prompt_token_ids=[5], max_tokens=2), timeout=10))
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=10)
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        # probes need no token
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_http_api_without_the_token_is_401_and_with_it_serves_over_tls(secure_cluster, pki, token):
    """The HTTP API takes the gRPC API's --auth-token-file and --tls-dir: HTTPS, bearer tokens on /v1 (probes and
    scrapers need none)."""
    context = ssl.create_default_context(cadata=pki["ca"].decode())
    url = urllib.parse.urlsplit(secure_cluster.http_url)

    def call(method: str, path: str, auth: str | None, body: dict | None = None) -> tuple[int, dict | str]:
        conn = http.client.HTTPSConnection(url.hostname, url.port, context=context, timeout=60)
        headers = {"content-type": "application/json", **({"authorization": f"Bearer {auth}"} if auth else {})}
        conn.request(method, path, json.dumps(body) if body else None, headers)
        resp = conn.getresponse()
        data = resp.read().decode()
        conn.close()
        return resp.status, json.loads(data) if data.startswith("{") else data

    body = {"model": "tiny-llama", "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}
    status, data = call("POST", "/v1/completions", token, body)
    assert status == 401 and data["error"]["type"] == "authentication_error"
    assert call("GET", "/v1/models", token)[0] == 401
    assert call("GET", "/health", None) == (200, {"status": "ok"})
    status, data = call("POST", "/v1/completions", TOKEN, body)
    assert status == 200 and data["usage"]["completion_tokens"] == 4


def test_plaintext_client_cannot_talk_to_a_tls_coordinator(secure_cluster):
    with Client(secure_cluster.address, timeout=5) as client, pytest.raises(SpecsplitError) as err:
        client.model_info()
    assert err.value.code is grpc.StatusCode.UNAVAILABLE


def _verifier_info(address: str, ca: bytes, cert_key: tuple[bytes, bytes] | None):
    creds = grpc.ssl_channel_credentials(
        root_certificates=ca,
        certificate_chain=cert_key[0] if cert_key else None,
        private_key=cert_key[1] if cert_key else None,
    )
    with grpc.secure_channel(address, creds) as ch:
        return verifier_pb2_grpc.VerifierStub(ch).GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=5)


@pytest.mark.parametrize("who", ["no-cert", "rogue-cert"])
def test_internal_services_refuse_peers_without_the_right_client_certificate(secure_cluster, pki, who):
    cert = None if who == "no-cert" else pki["rogue"]
    for role in ("verifier", "drafter"):
        with pytest.raises(grpc.RpcError) as err:
            _verifier_info(secure_cluster.services[role].address, pki["ca"], cert)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE


def test_internal_service_accepts_a_peer_with_a_certificate_from_the_ca(secure_cluster, pki):
    assert _verifier_info(secure_cluster.services["verifier"].address, pki["ca"], pki["good"]).vocab_size > 0


def test_message_over_the_size_limit_is_resource_exhausted(secure_cluster, pki):
    with Client(secure_cluster.address, timeout=30, tls_ca=pki["ca"], token=TOKEN) as client:
        with pytest.raises(SpecsplitError) as err:
            client.generate("x" * 1_500_000, max_tokens=2)  # a 1.5 MB message > 1 MiB
        assert err.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert client.generate(prompt_token_ids=[5, 6], max_tokens=2).token_ids  # still serving
