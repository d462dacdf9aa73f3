"""Ports for the servers tests and benchmarks start on loopback.

A port chosen before the server binds it (bind port 0, read the number, close, pass it on)
can be taken by another process in between, which under parallel runs it is. So whatever
can bind port 0 does, and says which port it got: ``smetric serve``, ``engine`` and
``pick`` print it in their startup line (``serve``'s and ``engine``'s read here,
``pick``'s by ``testing.gateway``); in-process servers and ZMQ sockets
report their bound address. Only programs that can neither (vLLM, llama.cpp's server,
sglang-router) get a port picked for them, and their starters pick again and restart
when the bind fails.
"""

from __future__ import annotations

import queue
import re
import socket
import subprocess
import threading
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
    first or says nothing of the kind within ``timeout_s``.

    A thread reads the pipe, so a child that stays silent cannot block the caller past
    the deadline, and it goes on draining the pipe for the child's whole life: a pipe
    nobody reads fills and then blocks the child's next write."""
    lines: queue.Queue[bytes] = queue.Queue()
    found = threading.Event()
    threading.Thread(target=_drain, args=(stdout, lines, found), daemon=True).start()
    deadline = time.monotonic() + timeout_s
    seen = b""
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if not line:  # the child closed its stdout
            break
        seen += line
        port = startup_port(line.decode(errors="replace"))
        if port is not None:
            found.set()
            return port
    found.set()
    process.poll()
    raise RuntimeError(
        f"no startup line within {timeout_s:g} s (exit {process.returncode}): {seen[-2000:]!r}"
    )


def _drain(stdout: IO[bytes], lines: queue.Queue[bytes], found: threading.Event) -> None:
    """Every line of ``stdout`` to ``lines`` until ``found``, then to nowhere; b"" at the end."""
    for line in iter(stdout.readline, b""):
        if not found.is_set():
            lines.put(line)
    lines.put(b"")
