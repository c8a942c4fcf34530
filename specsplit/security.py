"""Transport security and client authentication.

TLS material is read from files, the way Kubernetes mounts a `kubernetes.io/tls` secret plus a CA:
a directory with `tls.crt`, `tls.key` and `ca.crt` (`--tls-dir`). Every service then
- serves TLS with `tls.crt`/`tls.key`;
- internal services (verifier, drafter) require a client certificate signed by `ca.crt` (mutual
  TLS): a peer without the right certificate is refused during the handshake;
- dials its peers over TLS, verifying them against `ca.crt` and presenting `tls.crt` as its own
  client certificate.
The client-facing coordinator port asks for no client certificate; clients authenticate with a
bearer token (`authorization: Bearer …` metadata) checked against `--auth-token-file`.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

import grpc

from specsplit.errors import UsageError


@dataclass(frozen=True)
class TlsFiles:
    cert: bytes
    key: bytes
    ca: bytes

    @classmethod
    def from_dir(cls, directory: str | Path) -> TlsFiles:
        d = Path(directory)
        missing = [n for n in ("tls.crt", "tls.key", "ca.crt") if not (d / n).is_file()]
        if missing:
            raise UsageError(
                f"--tls-dir {d}: missing {', '.join(missing)}; give a directory with tls.crt, tls.key, ca.crt"
            )
        return cls((d / "tls.crt").read_bytes(), (d / "tls.key").read_bytes(), (d / "ca.crt").read_bytes())

    def server_credentials(self, require_client_cert: bool) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.ca if require_client_cert else None,
            require_client_auth=require_client_cert,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


def load_tls(directory: str | None) -> TlsFiles | None:
    return TlsFiles.from_dir(directory) if directory else None


def load_tokens(path: str | None) -> frozenset[str]:
    """One bearer token per line; blank lines and # comments are ignored."""
    if not path:
        return frozenset()
    give = "give a file of bearer tokens, one per line"
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise UsageError(f"cannot read --auth-token-file {path} ({err.strerror}); {give}") from err
    tokens = frozenset(t.strip() for t in lines if t.strip() and not t.strip().startswith("#"))
    if not tokens:
        raise UsageError(f"--auth-token-file {path} holds no token; {give}")
    return tokens


def bearer_token_valid(authorization: str | None, tokens: frozenset[str]) -> bool:
    """Whether an `authorization` value is `Bearer <one of tokens>` (compared in constant time); both APIs use it."""
    if not isinstance(authorization, str) or not authorization.startswith("Bearer "):
        return False
    given = authorization[len("Bearer ") :].strip()
    return any(hmac.compare_digest(given, t) for t in tokens)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without a valid `authorization: Bearer <token>` with UNAUTHENTICATED.

    Health checks and reflection stay open so probes need no secret.
    """

    OPEN = ("/grpc.health.v1.Health/", "/grpc.reflection.")

    def __init__(self, tokens: frozenset[str]):
        self._tokens = tokens

        async def deny_unary(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
            yield  # pragma: no cover - makes this an async generator

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny_unary)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny_stream)

    def _valid(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                return bearer_token_valid(value, self._tokens)
        return False

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(self.OPEN) or self._valid(handler_call_details.invocation_metadata):
            return await continuation(handler_call_details)
        return self._deny_stream if method.endswith("/Generate") else self._deny_unary
