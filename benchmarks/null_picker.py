"""An endpoint picker that decides nothing: the floor under any picker on ``smetric pick``'s
stack.

    python benchmarks/null_picker.py IP:PORT [--stack aio|threads|grpclib]
                                             [--option NAME=INT ...]

It serves ``ext_proc`` and answers each message as the picker answers it in the shipped
configuration (``BUFFERED`` request body, ``STREAMED`` response body), except that it reads
nothing and always names ``IP:PORT``, with replies ``smetric.gateway.protocol`` built once.
What a request costs it is what the exchange with Envoy costs on its stack, with no
analysis, no decision and no bookkeeping: the least a decision through Envoy can cost a
picker written on that stack.

Stacks: ``aio``, the one ``smetric pick`` runs (``grpc.aio``); ``threads``, gRPC's threaded
server; ``grpclib``, pure Python over ``h2``. ``--option`` passes a gRPC channel argument to
the server (``aio`` and ``threads``), e.g. ``grpc.http2.max_frame_size=4194304``. The gRPC
stacks also answer gRPC health (``liveness``), which the shipped configuration checks.
The startup line ("... on http://127.0.0.1:PORT") names the port.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from smetric.gateway import protocol

METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
# Room for a whole agent body in one message, as the picker makes (4 MiB by default).
MAX_MESSAGE = ("grpc.max_receive_message_length", 64 << 20)


def replies(endpoint: str) -> dict[str, ext_proc.ProcessingResponse]:
    """The answer to each kind of message, naming ``endpoint`` with the body."""
    return {
        "request_headers": protocol.continue_headers("request", {}),
        "request_body": protocol.continue_body(
            "request", {protocol.DESTINATION: endpoint}, endpoint
        ),
        "response_headers": protocol.continue_headers("response", {}),
        "response_body": protocol.CONTINUE_RESPONSE_BODY,
        "response_trailers": protocol.continue_trailers("response"),
    }


class AsyncProcessor(ext_proc_grpc.ExternalProcessorServicer):
    def __init__(self, endpoint: str) -> None:
        self.replies = replies(endpoint)

    async def Process(
        self,
        request_iterator: AsyncIterator[ext_proc.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[ext_proc.ProcessingResponse]:
        async for message in request_iterator:
            if reply := self.replies.get(message.WhichOneof("request") or ""):
                yield reply


class ThreadedProcessor(ext_proc_grpc.ExternalProcessorServicer):
    def __init__(self, endpoint: str) -> None:
        self.replies = replies(endpoint)

    def Process(
        self, request_iterator: Iterator[ext_proc.ProcessingRequest], context: grpc.ServicerContext
    ) -> Iterator[ext_proc.ProcessingResponse]:
        for message in request_iterator:
            if reply := self.replies.get(message.WhichOneof("request") or ""):
                yield reply


def started(port: int) -> None:
    if port == 0:
        raise SystemExit("cannot listen on 127.0.0.1")
    print(f"null picker on http://127.0.0.1:{port}", flush=True)


async def serve_aio(endpoint: str, options: list[tuple[str, int]]) -> None:
    server = grpc.aio.server(options=[MAX_MESSAGE, *options])
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(AsyncProcessor(endpoint), server)
    checks = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    await checks.set("liveness", health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    started(port)
    await server.wait_for_termination()


def serve_threads(endpoint: str, options: list[tuple[str, int]]) -> None:
    server = grpc.server(ThreadPoolExecutor(max_workers=32), options=[MAX_MESSAGE, *options])
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(ThreadedProcessor(endpoint), server)
    checks = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    checks.set("liveness", health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    started(port)
    server.wait_for_termination()


async def serve_grpclib(endpoint: str) -> None:
    from grpclib.const import Cardinality, Handler
    from grpclib.server import Server, Stream

    answers = replies(endpoint)

    class Processor:
        async def process(
            self, stream: Stream[ext_proc.ProcessingRequest, ext_proc.ProcessingResponse]
        ) -> None:
            async for message in stream:
                if reply := answers.get(message.WhichOneof("request") or ""):
                    await stream.send_message(reply)

        def __mapping__(self) -> dict[str, Handler]:
            kind = Cardinality.STREAM_STREAM
            request, response = ext_proc.ProcessingRequest, ext_proc.ProcessingResponse
            return {METHOD: Handler(self.process, kind, request, response)}

    # IPPROTO_TCP named, so that asyncio sets TCP_NODELAY on its connections (it checks
    # the protocol, which ``socket.create_server`` leaves 0).
    listening = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    listening.bind(("127.0.0.1", 0))
    server = Server([Processor()])
    await server.start(sock=listening)
    started(listening.getsockname()[1])
    await server.wait_closed()


def option(text: str) -> tuple[str, int]:
    name, _, value = text.partition("=")
    if not name or not value.lstrip("-").isdigit():
        raise argparse.ArgumentTypeError(f"expected NAME=INT, got {text!r}")
    return name, int(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("endpoint", help="the engine every request is sent to, IP:PORT")
    parser.add_argument("--stack", choices=("aio", "threads", "grpclib"), default="aio")
    parser.add_argument("--option", type=option, action="append", default=[])
    args = parser.parse_args()
    if args.stack == "aio":
        asyncio.run(serve_aio(args.endpoint, args.option))
    elif args.stack == "threads":
        serve_threads(args.endpoint, args.option)
    else:
        asyncio.run(serve_grpclib(args.endpoint))


if __name__ == "__main__":
    main()
