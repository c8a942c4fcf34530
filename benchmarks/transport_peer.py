"""The drafter half of the hidden-state transfer microbenchmark (`benchmarks/two_gpu.py`): a gRPC
Drafter that only takes the rows (by the transport under test) and answers once they are usable on
its device. Run as a child process: `python benchmarks/transport_peer.py TRANSPORT DEVICE HIDDEN PORT`."""

from __future__ import annotations

import sys
from concurrent import futures
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402
import torch  # noqa: E402

from specsplit.errors import SpecsplitError  # noqa: E402
from specsplit.grpc_server import server_options  # noqa: E402
from specsplit.proto import drafter_pb2, drafter_pb2_grpc  # noqa: E402
from specsplit.transport import make_receiver  # noqa: E402


class RowsOnly(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, transport: str, device: str, hidden_size: int):
        self.receiver = make_receiver(transport, device, hidden_size)
        self.device = torch.device(device)

    def ProposeStream(self, request_iterator, context):
        for request in request_iterator:
            yield self._answer(request, context)

    def _answer(self, request, context):
        if request.WhichOneof("hidden") is None:  # the control-only round trip the parent subtracts
            return drafter_pb2.ProposeResponse()
        try:
            rows = self.receiver.receive(request)  # [num_rows, hidden_size] on self.device
        except SpecsplitError as err:
            context.abort(err.code, err.message)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return drafter_pb2.ProposeResponse(step0_ns=rows.shape[0])

    def OpenHiddenTransport(self, request, context):
        try:
            self.receiver.open(request)
        except SpecsplitError as err:
            context.abort(err.code, err.message)
        return drafter_pb2.OpenHiddenTransportResponse(device=str(self.device))


def main() -> None:
    transport, device, hidden_size, port = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    server = grpc.server(futures.ThreadPoolExecutor(2), options=server_options())  # the stream + an open call
    drafter_pb2_grpc.add_DrafterServicer_to_server(RowsOnly(transport, device, hidden_size), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("ready", flush=True)
    sys.stdin.read()  # the parent closes stdin to stop us
    server.stop(0)


if __name__ == "__main__":
    main()
