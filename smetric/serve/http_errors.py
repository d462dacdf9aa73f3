"""Errors below the app, in OpenAI's error shape, and no version banner.

A request aiohttp cannot parse (bad chunk framing, an oversized header or URL, a method
that is no token, an HTTP/2 preface, a NUL in the path) never reaches the app's routes or
middlewares: aiohttp's connection handler answers it itself with a ``text/plain`` page that
quotes the offending bytes back, and every response names the server's Python and aiohttp
versions. A client's SDK reads neither as an error, and the banner tells a scanner what to
try. So both HTTP front doors (``smetric serve`` and the picker's metrics port) run their
app through ``JsonErrorRunner``: its connection handlers answer those errors with
``{"error": {"message", "type", "code"}}`` (the route is unknown at that level, so
OpenAI's shape) with a message that says what is wrong and quotes nothing, and every
response, the app's own included, says only ``Server: smetric``. ``web.run_app`` builds
its own runner, so ``run_app`` here does its job for ``serve``'s workers.

aiohttp has no public hook for the connection handler's class: ``AppRunner._make_server``
builds the ``Server`` whose call makes one ``RequestHandler`` per connection, and
``RequestHandler.handle_error`` makes the error page. Both are relied on here, for the
aiohttp releases pyproject.toml allows; tests/test_http_errors.py fails if they change.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from aiohttp import hdrs, web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from smetric.serve.errors import OPENAI

SERVER = "smetric"


def error_message(status: int) -> str:
    """What went wrong, in words that quote nothing the client sent."""
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Error"
    if status >= 500:
        return f"{phrase}: the router failed to answer this request"
    return f"{phrase}: the request is not valid HTTP/1.1"


class JsonErrorHandler(RequestHandler):
    """aiohttp's connection handler, answering what it cannot parse in OpenAI's shape."""

    __slots__ = ()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            # The router's own failure: aiohttp's handling logs it with its traceback
            # (and refuses once bytes went out).
            status = super().handle_error(request, status, exc, message).status
        else:
            # A client's bytes that are not HTTP: any client can send them at will, so
            # they never reach the log above debug, and never verbatim.
            if request.writer.output_size > 0:
                raise ConnectionError("the response had begun; the connection is broken")
            self.logger.debug("unparseable request: %s", error_message(status))
        response = OPENAI.response(status, error_message(status))
        response.headers[hdrs.SERVER] = SERVER
        response.force_close()
        return response


class _JsonErrorServer(web.Server):
    """The app's ``Server`` as aiohttp builds it, handing out ``JsonErrorHandler``."""

    def __call__(self) -> RequestHandler:
        handler = super().__call__()
        handler.__class__ = JsonErrorHandler  # same slots: only the methods differ
        return handler


class JsonErrorRunner(web.AppRunner):
    """``web.AppRunner`` whose connections answer parse errors in JSON and whose every
    response says ``Server: smetric``."""

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        app.on_response_prepare.append(_name_server)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorServer  # no state of its own: only __call__ differs
        return server


async def _name_server(request: web.Request, response: web.StreamResponse) -> None:
    # aiohttp fills in its version banner only where the header is absent.
    response.headers[hdrs.SERVER] = SERVER


def run_app(
    app: web.Application,
    sock: socket.socket,
    *,
    shutdown_timeout: float,
    loop_factory: Callable[[], asyncio.AbstractEventLoop],
    **kwargs: Any,
) -> None:
    """``web.run_app`` on one listening socket through ``JsonErrorRunner`` (``run_app``
    builds its own runner): serve until SIGINT or SIGTERM, then close the socket, give the
    requests in flight ``shutdown_timeout`` and clean the app up."""

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        runner = JsonErrorRunner(app, shutdown_timeout=shutdown_timeout, **kwargs)
        await runner.setup()
        try:
            await web.SockSite(runner, sock).start()
            await stop.wait()
        finally:
            await runner.cleanup()  # the drain: nothing is cancelled before it ends

    with (
        contextlib.suppress(KeyboardInterrupt),
        asyncio.Runner(loop_factory=loop_factory) as runner,
    ):
        runner.run(serve())
