"""Docker HEALTHCHECK for a specsplit service: exit 0 when its `grpc.health.v1` says SERVING.

    python healthcheck.py [HOST:PORT] [SERVICE]     (defaults: 127.0.0.1:50051, "" = the server)

Kubernetes does not use this (it probes gRPC health natively); `docker run` and compose do.
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str]) -> int:
    address = argv[0] if argv else "127.0.0.1:50051"
    service = argv[1] if len(argv) > 1 else ""
    request = health_pb2.HealthCheckRequest(service=service)
    try:
        with grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(request, timeout=3.0).status
    except grpc.RpcError as err:
        print(f"{address} {service or '(server)'}: {err.code().name} {err.details()}", file=sys.stderr)
        return 1
    if status != health_pb2.HealthCheckResponse.SERVING:
        print(
            f"{address} {service or '(server)'}: {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
