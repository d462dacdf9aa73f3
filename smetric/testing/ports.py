"""Ports for the servers tests and benchmarks start on loopback.

A port chosen before the server binds it (bind port 0, read the number, close, pass it on)
can be taken by another process in between, which under parallel runs it is. So whatever
can bind port 0 does, and says which port it got: ``smetric serve``, ``engine`` and
``pick`` print it in their startup line, read here; in-process servers and ZMQ sockets
report their bound address. Only programs that can neither (vLLM, llama.cpp's server,
sglang-router) get a port picked for them, and their starters pick again and restart
when the bind fails.
"""

from __future__ import annotations

import re
import socket
import subprocess
import time
from typing import IO

# A startup line names where it serves first: "smetric serve: ... on http://HOST:PORT ...",
# as ``smetric serve`` and ``engine`` (and the benchmarks' trivial engine) print it.
_STARTUP = re.compile(r" on http://\S+?:(\d+)")
# ... and what ``smetric engine`` adds to it when it publishes KV events.
_EVENTS = re.compile(r"KV events on tcp://\S+?:(\d+), replay on tcp://\S+?:(\d+)")
# Bind failures as programs word them (errno 98): the port was taken after it was picked.
ADDRESS_IN_USE = re.compile(r"address already in use|couldn't bind|EADDRINUSE", re.IGNORECASE)


def port_for_external() -> int:
    """A loopback port nothing holds at this instant, for a program that cannot bind port 0
    and report it; another process may take it before the program binds it, so its
    starter retries with a fresh one when the program fails with ``ADDRESS_IN_USE``."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def startup_port(text: str) -> int | None:
    """The port in the first startup line within ``text``."""
    match = _STARTUP.search(text)
    return None if match is None else int(match.group(1))


def startup_events_ports(text: str) -> tuple[int, int] | None:
    """The KV-event and replay ports in the startup line of ``smetric engine``."""
    match = _EVENTS.search(text)
    return None if match is None else (int(match.group(1)), int(match.group(2)))


def read_startup_port(
    stdout: IO[bytes], process: subprocess.Popen[bytes], timeout_s: float = 60.0
) -> int:
    """The port from the startup line a server subprocess (``smetric serve`` or
    ``engine``) writes to ``stdout``, a pipe, once it listens; RuntimeError if it exits
    first."""
    deadline = time.monotonic() + timeout_s
    seen = b""
    while time.monotonic() < deadline:
        line = stdout.readline()
        if not line:
            break
        seen += line
        port = startup_port(line.decode(errors="replace"))
        if port is not None:
            return port
    process.poll()
    raise RuntimeError(f"no startup line (exit {process.returncode}): {seen[-2000:]!r}")
