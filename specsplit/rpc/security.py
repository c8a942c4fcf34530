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

Under `specsplit up` the three services dial each other at 127.0.0.1 with that mutual TLS, so `up --tls-dir`
checks first that `tls.crt` holds for 127.0.0.1, as server and as client (`check_loopback_tls`).
"""

from __future__ import annotations

import hmac
import socket
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

from specsplit.client.errors import UsageError


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


def check_loopback_tls(directory: str | Path, host: str = "127.0.0.1") -> None:
    """Raises UsageError unless the files in `directory` let two services of this machine talk mutual TLS at `host`
    as gRPC does: `tls.crt` signed by `ca.crt`, valid for `host` (a subject alternative name) and for both server
    and client use, with `tls.key` its key. A TLS handshake between two in-process ends of a socket pair tells."""
    d = Path(directory)
    TlsFiles.from_dir(d)  # the three files are there
    cert, key, ca = (str(d / name) for name in ("tls.crt", "tls.key", "ca.crt"))
    give = f"give --tls-dir a certificate signed by ca.crt for server and client use, with IP:{host} among its names"
    server, client = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        for context in (server, client):
            context.load_cert_chain(cert, key)
            context.load_verify_locations(ca)
    except (ssl.SSLError, OSError) as err:
        raise UsageError(f"--tls-dir {d}: the files do not load ({err}); {give}") from err
    server.verify_mode = ssl.CERT_REQUIRED  # as the verifier and the drafter ask their callers
    ends = socket.socketpair()
    server_error: list[Exception] = []

    def serve_one() -> None:
        try:
            with server.wrap_socket(ends[0], server_side=True) as tls:
                tls.recv(1)  # after the handshake: the client's certificate has been checked
        except (ssl.SSLError, OSError) as err:
            server_error.append(err)

    for end in ends:
        end.settimeout(10)
    thread = threading.Thread(target=serve_one, daemon=True)
    thread.start()
    try:
        with client.wrap_socket(ends[1], server_hostname=host) as tls:
            tls.sendall(b"x")
    except (ssl.SSLError, OSError) as err:
        thread.join(10)
        reason = getattr(err, "verify_message", None) or err
        raise UsageError(
            f"--tls-dir {d}: a service dialling {host} does not accept tls.crt ({reason}); {give}"
        ) from err
    thread.join(10)
    if server_error:
        reason = getattr(server_error[0], "verify_message", None) or server_error[0]
        raise UsageError(
            f"--tls-dir {d}: a service does not accept tls.crt as a client certificate ({reason}); {give}"
        ) from server_error[0]


def _token_lines(path: str) -> list[str]:
    """The tokens of an `--auth-token-file`, in order: one per line; blank lines and # comments are ignored."""
    give = "give a file of bearer tokens, one per line"
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise UsageError(f"cannot read --auth-token-file {path} ({err.strerror}); {give}") from err
    tokens = [t.strip() for t in lines if t.strip() and not t.strip().startswith("#")]
    if not tokens:
        raise UsageError(f"--auth-token-file {path} holds no token; {give}")
    return tokens


def load_tokens(path: str | None) -> frozenset[str]:
    """The bearer tokens a server accepts: one per line; blank lines and # comments are ignored."""
    return frozenset(_token_lines(path)) if path else frozenset()


def read_token(path: str) -> str:
    """The bearer token a client sends: the first in a file of the server's format (`load_tokens`)."""
    return _token_lines(path)[0]


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
