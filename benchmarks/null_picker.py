"""An endpoint picker that decides nothing: the floor under any picker on ``smetric pick``'s
stack.

    python benchmarks/null_picker.py IP:PORT

It serves ``ext_proc`` and gRPC health on the stack ``smetric pick`` runs (``grpc.aio``,
Envoy's generated messages, the replies ``smetric.gateway.protocol`` builds), and answers
each message as the picker answers it in the shipped configuration (``BUFFERED`` request
body, ``STREAMED`` response body), except that it reads nothing and always names
``IP:PORT``. What a request costs it is what the exchange with Envoy costs, with no
analysis, no decision and no bookkeeping: the least a decision through Envoy can cost a
picker written on this stack. The startup line ("... on http://127.0.0.1:PORT") names
its gRPC port.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from smetric.gateway import protocol


class NullProcessor(ext_proc_grpc.ExternalProcessorServicer):
    def __init__(self, endpoint: str) -> None:
        self.replies = {
            "request_headers": protocol.continue_headers("request", {}),
            "request_body": protocol.continue_body(
                "request", {protocol.DESTINATION: endpoint}, endpoint
            ),
            "response_headers": protocol.continue_headers("response", {}),
            "response_body": protocol.CONTINUE_RESPONSE_BODY,
            "response_trailers": protocol.continue_trailers("response"),
        }

    async def Process(
        self,
        request_iterator: AsyncIterator[ext_proc.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[ext_proc.ProcessingResponse]:
        async for message in request_iterator:
            reply = self.replies.get(message.WhichOneof("request") or "")
            if reply is not None:
                yield reply


async def serve(endpoint: str) -> None:
    # Room for a whole agent body in one message, as the picker makes (4 MiB by default).
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(NullProcessor(endpoint), server)
    checks = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    await checks.set("liveness", health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"null picker on http://127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    if len(sys.argv) != 2 or ":" not in sys.argv[1]:
        sys.exit(__doc__.split("\n\n")[1])
    asyncio.run(serve(sys.argv[1]))
