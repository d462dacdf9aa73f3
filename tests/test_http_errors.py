"""Requests aiohttp cannot parse, sent as raw bytes to a real ``smetric serve`` and to the
picker's HTTP port: each is answered in OpenAI's JSON error shape, quoting nothing it was
sent, and no response names the server's software versions."""

from __future__ import annotations

import inspect
import json
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from smetric.serve.http_errors import JsonErrorHandler, JsonErrorRunner
from smetric.testing.fault_suite import SmetricProcess

from conftest import run

# Each malformed request, and a marker of its own bytes that the answer must not quote.
MALFORMED = {
    "invalid chunk size": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"zzQUOTED\r\nhello\r\n0\r\n\r\n",
        b"QUOTED",
    ),
    "20 KB header": (
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"QUOTED" * 3400 + b"\r\n\r\n",
        b"QUOTED",
    ),
    "20 KB URL": (b"GET /" + b"QUOTED" * 3400 + b" HTTP/1.1\r\nHost: x\r\n\r\n", b"QUOTED"),
    "bad method token": (b"QU(OTED /health HTTP/1.1\r\nHost: x\r\n\r\n", b"OTED"),
    "HTTP/2 preface": (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b"PRI"),
    "NUL in the path": (b"GET /QUO\x00TED HTTP/1.1\r\nHost: x\r\n\r\n", b"QUO"),
}
WELL_FORMED = {
    "a route": b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    "no route": b"GET /nowhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
}


def exchange(port: int, request: bytes) -> bytes:
    """Send ``request`` on a fresh connection; every byte until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def assert_plain_json_error(answer: bytes, quoted: bytes) -> None:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    assert b"application/json" in head, answer[:300]
    data = json.loads(body)
    assert list(data) == ["error"]
    error = data["error"]
    assert sorted(error) == ["code", "message", "type"]
    assert (error["type"], error["code"]) == ("invalid_request_error", status)
    assert 400 <= status < 500 and isinstance(error["message"], str)
    assert quoted not in body


def assert_no_banner(answer: bytes) -> None:
    head = answer.partition(b"\r\n\r\n")[0].decode("latin-1")
    servers = re.findall(r"(?im)^server:\s*(.*?)\s*$", head)
    assert servers == ["smetric"], head


def check_front_door(port: int) -> None:
    for name, (request, quoted) in MALFORMED.items():
        answer = exchange(port, request)
        assert answer, f"{name}: closed without an answer"
        assert_plain_json_error(answer, quoted)
        assert_no_banner(answer)
    for request in WELL_FORMED.values():
        assert_no_banner(exchange(port, request))


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    router = SmetricProcess(
        tmp_path_factory.mktemp("serve"), args=("serve", "-e", "http://127.0.0.1:9")
    )
    router.start()
    try:
        router.wait_listening(60)
        yield router.port
    finally:
        router.stop()


@pytest.mark.server
@pytest.mark.subprocess
def test_serve_answers_what_it_cannot_parse_in_json_without_a_banner(serve: int) -> None:
    check_front_door(serve)


@pytest.mark.server
@pytest.mark.subprocess
def test_the_pickers_http_port_answers_the_same(tmp_path: Path) -> None:
    pytest.importorskip("grpc")
    args = [sys.executable, "-m", "smetric", "pick", "-e", "http://127.0.0.1:9"]
    args += ["--port", "0", "--metrics-port", "0"]
    picker = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert picker.stdout is not None
        line = picker.stdout.readline()
        found = re.search(r"metrics on http://[^:]+:(\d+)", line)
        assert found, line + (picker.stderr.read() if picker.stderr else "")
        check_front_door(int(found.group(1)))
    finally:
        picker.terminate()
        _, log = picker.communicate(timeout=30)
    # Any client can send bytes that are not HTTP: they must not fill the log.
    assert "Error handling request" not in log and "Traceback" not in log, log[-3000:]


def test_the_aiohttp_internals_relied_on_are_still_there() -> None:
    """aiohttp offers no hook for its connection handler's class: the runner relies on
    ``AppRunner._make_server`` returning the ``Server`` that makes one handler per
    connection, and on ``handle_error``'s signature; a release that changes either must
    fail here, not in production."""
    parameters = list(inspect.signature(RequestHandler.handle_error).parameters)
    assert parameters == ["self", "request", "status", "exc", "message"]

    async def go() -> None:
        runner = JsonErrorRunner(web.Application())
        await runner.setup()
        try:
            assert runner.server is not None
            handler = runner.server()
            assert type(handler) is JsonErrorHandler
        finally:
            await runner.cleanup()

    run(go)
