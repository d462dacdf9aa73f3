"""The picker as a service: ``ext_proc`` and gRPC health on one port, Prometheus metrics
and HTTP health on another, and the router's engine checks, scrapes and KV-event
subscriptions running beside them.

gRPC health answers the services the endpoint-picker protocol names: ``liveness`` (the
process answers), ``readiness`` and ``envoy.service.ext_proc.v3.ExternalProcessor`` (some
engine is healthy, so a pick can succeed), and ``""`` (the same as readiness).
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from smetric.gateway.extproc import ExternalProcessor
from smetric.gateway.picker import Picker
from smetric.serve.app import alive
from smetric.serve.http_errors import JsonErrorRunner

EXT_PROC_SERVICE = ext_proc.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
READINESS_SERVICES = ("", "readiness", EXT_PROC_SERVICE)
MESSAGE_OVERHEAD = 1 << 20
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class PickerServer:
    """Start with ``start``, stop with ``stop``; ``grpc_port`` and ``metrics_port`` are the
    bound ports (0 asks the OS for free ones)."""

    def __init__(self, picker: Picker, host: str, grpc_port: int, metrics_port: int) -> None:
        self.picker = picker
        self.host = host
        self.grpc_port = grpc_port
        self.metrics_port = metrics_port
        self.health = health.aio.HealthServicer()
        self._readiness: asyncio.Task[None] | None = None

    async def start(self) -> None:
        router = self.picker.router
        app = web.Application(middlewares=router.middlewares())
        app.router.add_get("/metrics", router.prometheus)
        app.router.add_get("/health", router.health)
        app.router.add_get("/live", alive)
        app.cleanup_ctx.append(router.lifecycle)
        self.runner = JsonErrorRunner(app, access_log=None)
        await self.runner.setup()  # the router's checks, scrapes and subscriptions start
        site = web.TCPSite(self.runner, self.host, self.metrics_port)
        await site.start()
        self.metrics_port = self.runner.addresses[0][1]
        # A whole (BUFFERED) body comes in one message: room for the largest body the
        # router accepts, and its headers and metadata besides (gRPC's default is 4 MiB).
        largest = min(router.settings.max_body_bytes + MESSAGE_OVERHEAD, 2**31 - 1)
        self.server = grpc.aio.server(options=[("grpc.max_receive_message_length", largest)])
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(
            ExternalProcessor(self.picker), self.server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.grpc_port = self.server.add_insecure_port(f"{self.host}:{self.grpc_port}")
        if self.grpc_port == 0:
            raise OSError(f"cannot listen on {self.host} for gRPC (port in use?)")
        await self.health.set("liveness", _SERVING)
        await self._update_readiness()
        await self.server.start()
        self._readiness = asyncio.create_task(self._track_readiness())

    async def _update_readiness(self) -> None:
        status = _SERVING if self.picker.ready() else _NOT_SERVING
        for service in READINESS_SERVICES:
            await self.health.set(service, status)

    async def _track_readiness(self) -> None:
        interval = self.picker.router.settings.health_interval_s
        while True:
            await asyncio.sleep(interval)
            await self._update_readiness()

    async def stop(self, grace_s: float) -> None:
        """Stop taking new streams, let those open finish within ``grace_s``, then stop
        the router's background work."""
        if self._readiness is not None:
            self._readiness.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._readiness
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        await self.runner.cleanup()
