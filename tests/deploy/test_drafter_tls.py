"""Mutual TLS to drafter replicas found by DNS: the certificate is checked against the service name.

In Kubernetes the verifier dials drafter pods by IP (headless service), but their certificate names
the service (`specsplit-drafter`), not each pod's IP. The pool checks the certificate against the
name in `dns:///NAME:PORT`; here the certificate holds only `drafters.test`, never 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import datetime

import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from specsplit.proto import drafter_pb2, drafter_pb2_grpc
from specsplit.rpc.security import TlsFiles
from specsplit.rpc.server import ServiceServer
from specsplit.verifier.channels import make_channel
from specsplit.verifier.drafter_pool import DRAFTER_SERVICE, DrafterPool
from specsplit.verifier.propose_request import ProposeBatch


def _cert(subject: str, key, issuer: str, issuer_key, *, ca: bool, dns: str | None = None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if dns:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(dns)]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def tls_files(dns_name: str) -> TlsFiles:
    """One leaf for both ends (server and client certificate), signed by a fresh CA."""
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _cert("test-ca", ca_key, "test-ca", ca_key, ca=True)
    leaf = _cert(dns_name, key, "test-ca", ca_key, ca=False, dns=dns_name)
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return TlsFiles(leaf.public_bytes(pem), key_pem, ca.public_bytes(pem))


class EchoDrafter(drafter_pb2_grpc.DrafterServicer):
    async def answer(self, request):
        return drafter_pb2.ProposeResponse(drafts=[drafter_pb2.Drafts(token_ids=[9]) for _ in request.requests])

    async def ProposeStream(self, request_iterator, context):
        async for request in request_iterator:
            yield await self.answer(request)


def test_drafters_found_by_dns_are_checked_against_the_service_name():
    tls = tls_files("drafters.test")

    async def body():
        server = ServiceServer("drafter", "127.0.0.1", 0, [DRAFTER_SERVICE], tls=tls, require_client_cert=True)
        drafter_pb2_grpc.add_DrafterServicer_to_server(EchoDrafter(), server.server)
        await server.start()
        await server.mark_serving()
        port = server.port
        plan = ProposeBatch(1, [drafter_pb2.ProposeItem(request_id="r", next_token_ids=[1])], [0, 1], torch.zeros(1, 4))
        by_name = DrafterPool([f"dns:///drafters.test:{port}"], resolver=lambda h, p: [f"127.0.0.1:{p}"], tls=tls)
        ok = await make_channel(None, timeout_s=5, pool=by_name).propose(plan, 1)
        assert ok.ok and ok.drafts == [[9]], ok.error
        by_ip = DrafterPool([f"127.0.0.1:{port}"], tls=tls)  # the certificate does not name the IP
        refused = await make_channel(None, timeout_s=5, pool=by_ip).propose(plan, 1)
        assert not refused.ok and refused.drafts == [[]] and "hostname" in refused.error.lower()
        await by_name.close()
        await by_ip.close()
        await server.server.stop(0)

    asyncio.run(body())
