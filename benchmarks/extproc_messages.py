"""What one ``ext_proc`` message costs a Python gRPC server, answered or only read.

    python benchmarks/extproc_messages.py [--messages 8000] [--streams 8] [--rounds 3]

Envoy sends the picker every piece of a streamed reply as one ``ProcessingRequest`` on
the request's gRPC stream. In the shipped configuration (``STREAMED``) the picker answers
each with a ``ProcessingResponse`` and Envoy holds the piece until then; a filter in
Envoy's observability mode would send the pieces without waiting, and the server would
only read them. This measures both on the stack the picker runs (``grpc.aio``, the
``ext_proc`` service and messages), with nothing of the picker's own: a server process
that reads each piece and answers it, or only reads it, while a client in this process
sends ``--messages`` pieces of a chat completion chunk's size over ``--streams`` streams
at once. Printed per round: the server's CPU (user and system, from ``getrusage``) per
message, started after the server listens, so its start-up is left out.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import resource
import statistics
from collections.abc import AsyncIterator
from multiprocessing.synchronize import Event

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

CHUNK = (
    b'data: {"id":"x","object":"chat.completion.chunk","model":"m","choices":[{"index":0,'
    b'"delta":{"content":"ok"},"finish_reason":null}]}\n\n'
)
CONTINUE = ext_proc.ProcessingResponse(response_body=ext_proc.BodyResponse())


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Reader(ext_proc_grpc.ExternalProcessorServicer):
    def __init__(self, answer: bool) -> None:
        self.answer = answer

    async def Process(
        self,
        request_iterator: AsyncIterator[ext_proc.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[ext_proc.ProcessingResponse]:
        async for message in request_iterator:
            message.response_body.body  # noqa: B018 - read the piece, as the picker does
            if self.answer:
                yield CONTINUE


def serve(answer: bool, reports: multiprocessing.Queue, done: Event) -> None:
    """The server process: its port and CPU so far once it listens, its CPU at ``done``."""

    async def run() -> None:
        server = grpc.aio.server()
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(Reader(answer), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        reports.put((port, cpu_s()))
        while not done.is_set():
            await asyncio.sleep(0.05)
        reports.put(cpu_s())
        await server.stop(None)

    asyncio.run(run())


async def send(port: int, answer: bool, messages: int, streams: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ext_proc_grpc.ExternalProcessorStub(channel)
        piece = ext_proc.ProcessingRequest(response_body=ext_proc.HttpBody(body=CHUNK))

        async def one() -> None:
            call = stub.Process()
            for _ in range(messages // streams):
                await call.write(piece)
                if answer:
                    await call.read()
            await call.done_writing()
            while await call.read() is not grpc.aio.EOF:
                pass

        await asyncio.gather(*(one() for _ in range(streams)))


def cost_us(answer: bool, messages: int, streams: int) -> float:
    """The server's CPU us per message, answering each or not."""
    reports: multiprocessing.Queue = multiprocessing.Queue()
    done = multiprocessing.Event()
    process = multiprocessing.Process(target=serve, args=(answer, reports, done))
    process.start()
    try:
        port, before = reports.get(timeout=30)
        asyncio.run(send(port, answer, messages, streams))
        done.set()
        after = reports.get(timeout=30)
    finally:
        done.set()
        process.join(timeout=30)
    return (after - before) / messages * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=8000)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    costs: dict[str, list[float]] = {"answered": [], "read only": []}
    for _ in range(args.rounds):  # alternating, so that both see the same machine
        for label, answer in (("answered", True), ("read only", False)):
            costs[label].append(cost_us(answer, args.messages, args.streams))
    print(
        f"{args.messages} messages over {args.streams} streams, {args.rounds} rounds; "
        "server CPU us per message, median (range)"
    )
    for label, values in costs.items():
        print(f"{label:<10} {statistics.median(values):6.1f} ({min(values):.1f}-{max(values):.1f})")


if __name__ == "__main__":
    main()
